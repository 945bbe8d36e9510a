package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"time"

	"github.com/google/pprof/profile"
	"github.com/leaselimit/leaselimit/benchmarks/internal/profcat"
)

// With -cpuprofile, every measured slice is profiled on its own (warm-ups
// and set-up are not): its samples are sorted into categories of work
// (see profcat) and added to its cell, so that one interleaved run gives
// every design's client CPU per decision by category; the slices'
// profiles are merged into the file at the end.

// profiler profiles slices and keeps their profiles for the file, made
// before the run so that a path that cannot be written fails at once.
type profiler struct {
	file   *os.File
	slices []*profile.Profile
	buf    bytes.Buffer
}

// newProfiler creates the profile's file at path.
func newProfiler(path string) (*profiler, error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	return &profiler{file: f}, nil
}

// start starts profiling a slice.
func (pr *profiler) start() error {
	pr.buf.Reset()
	return pprof.StartCPUProfile(&pr.buf)
}

// stop stops profiling the slice and returns its CPU time by category.
func (pr *profiler) stop() (map[string]time.Duration, error) {
	pprof.StopCPUProfile()
	p, err := profile.Parse(&pr.buf)
	if err != nil {
		return nil, fmt.Errorf("parse a slice's CPU profile: %w", err)
	}
	pr.slices = append(pr.slices, p)
	return profcat.Split(p)
}

// write merges the slices' profiles into the file, and closes it.
func (pr *profiler) write() error {
	if len(pr.slices) == 0 {
		return pr.file.Close()
	}
	merged, err := profile.Merge(pr.slices)
	if err != nil {
		pr.file.Close()
		return fmt.Errorf("merge the slices' CPU profiles: %w", err)
	}
	if err := merged.Write(pr.file); err != nil {
		pr.file.Close()
		return err
	}
	return pr.file.Close()
}

// printCategories prints each cell's client CPU per decision by category,
// from the profiles of its slices, beside the sampled total and the
// process's CPU by getrusage (the sampler sees most of it, not all).
func printCategories(w io.Writer, groups [][]*setup) {
	names := profcat.Names()
	fmt.Fprintln(w, "Client CPU per decision by category (CPU profiles of the measured slices; see benchmarks/internal/profcat):")
	fmt.Fprintln(w)
	fmt.Fprint(w, "| workload | design | client CPU (getrusage) | sampled |")
	for _, n := range names {
		fmt.Fprintf(w, " %s |", n)
	}
	fmt.Fprint(w, "\n|---|---|---:|---:|")
	for range names {
		fmt.Fprint(w, "---:|")
	}
	fmt.Fprintln(w)
	for _, r := range allResults(groups) {
		n := float64(r.decisions)
		if n == 0 || r.categories == nil {
			continue
		}
		var sampled time.Duration
		for _, d := range r.categories {
			sampled += d
		}
		per := func(d time.Duration) string { return dur(time.Duration(float64(d) / n)) }
		fmt.Fprintf(w, "| %s | %s | %s | %s |", r.workload.name, r.design, per(r.clientCPU), per(sampled))
		for _, name := range names {
			fmt.Fprintf(w, " %s |", per(r.categories[name]))
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w)
}
