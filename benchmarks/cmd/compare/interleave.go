package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/leaselimit/leaselimit/benchmarks/internal/design"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// Sequential cells on a shared 2-core machine swung 1.16×–3.94× from run
// to run: the machine's state drifts over a cell of seconds. So every
// design of a workload runs in each of several rounds, one short slice
// each, in an order that changes from round to round (see roundOrder),
// and a design is reported against the baseline of the same round: the
// median of those per-round ratios and their range. A ratio taken within
// one round shares the round's conditions.

// setup is one design made ready for a workload: its clients, deciders
// and keys, warmed up, and what its slices measured so far.
type setup struct {
	name    string
	prefix  string
	keys    []string
	walk    []int // for a workload measured cold, each goroutine's place in its walk of keys (see drive)
	clients []*redis.Client
	decs    []design.Decider
	reqs    *design.Counter

	res   cellResult
	rates []float64 // decisions/s of each round's slice
	p50s  []float64 // the median latency of each round's slice, in seconds
}

// close releases the deciders and clients.
func (s *setup) close() error {
	var first error
	for _, d := range s.decs {
		if d != nil {
			if err := d.Close(); err != nil && first == nil {
				first = fmt.Errorf("%s: close: %w", s.name, err)
			}
		}
	}
	for _, c := range s.clients {
		if c != nil {
			if err := c.Close(); err != nil && first == nil {
				first = fmt.Errorf("%s: close client: %w", s.name, err)
			}
		}
	}
	return first
}

// prepare makes design name ready for wl: clients and deciders, then a
// warm-up of connections and script caches on throwaway keys, and, for an
// unlimited workload that is not measured cold, cfg.warmup on its own keys
// (leases reach their steady size).
func prepare(ctx context.Context, cfg config, wl workload, name string) (*setup, error) {
	s := &setup{name: name, reqs: new(design.Counter), res: cellResult{workload: wl, design: name}}
	s.prefix = "cmp-" + cfg.runID + ":" + strings.ReplaceAll(wl.name, " ", "_") + ":" + name + ":"
	s.keys = sliceKeys(s.prefix, wl.keys)
	if wl.cold {
		s.walk = walkStarts(cfg.goroutines, wl.keys)
	}
	s.clients = make([]*redis.Client, wl.instances)
	s.decs = make([]design.Decider, wl.instances)
	for i := range s.clients {
		s.clients[i] = design.NewClient(cfg.addr, s.reqs)
		d, err := design.New(name, s.clients[i], wl.limit)
		if err != nil {
			return s, err
		}
		s.decs[i] = d
	}
	for i, c := range s.clients {
		w, err := design.New(name, c, wl.limit)
		if err != nil {
			return s, err
		}
		_, werr := drive(ctx, cfg, wl, []design.Decider{w}, []string{s.prefix + "warm" + strconv.Itoa(i)}, nil, 50*time.Millisecond, false)
		if cerr := w.Close(); werr == nil {
			werr = cerr
		}
		if werr != nil {
			return s, fmt.Errorf("warm-up: %w", werr)
		}
	}
	if !wl.limited && !wl.cold && cfg.warmup > 0 {
		if _, err := drive(ctx, cfg, wl, s.decs, s.keys, nil, cfg.warmup, false); err != nil {
			return s, fmt.Errorf("warm-up: %w", err)
		}
	}
	return s, nil
}

// sliceKeys returns n keys under prefix.
func sliceKeys(prefix string, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = prefix + "k" + strconv.Itoa(i)
	}
	return keys
}

// slice measures one slice of s for d. A limited workload starts every
// slice on fresh keys, so each starts from a full bucket and its ideal is
// that slice's own.
//
// Any other first runs cfg.leadIn on its keys, unmeasured. A design may
// defer work: a lease's unused tokens go back to Redis when it expires, a
// TTL after its grant, and the janitor sends them on its next tick. Slices
// run back to back, so without a lead-in that work lands in the next
// design's slice, on its client and Redis CPU, while the slice that made
// it pays for none of its own: on the cold long tail, leases then measured
// 0.86-0.95x exact mode's rate, and 0.80-0.84x in runs of each alone
// (each design's deferred work landing in its own later slices). With a
// lead-in longer than the deferral, the previous design's work ends
// before the slice starts and this design's own from the lead-in lands in
// the slice, as in a steady run.
func (s *setup) slice(ctx context.Context, cfg config, round int, d time.Duration) error {
	wl := s.res.workload
	keys := s.keys
	if wl.limited {
		keys = sliceKeys(s.prefix+"r"+strconv.Itoa(round)+":", wl.keys)
	} else if cfg.leadIn > 0 {
		if _, err := drive(ctx, cfg, wl, s.decs, keys, s.walk, cfg.leadIn, false); err != nil {
			return fmt.Errorf("lead-in: %w", err)
		}
	}
	if cfg.profiler != nil {
		if err := cfg.profiler.start(); err != nil {
			return err
		}
	}
	c0, err := redistest.ReadStats(cfg.addr)
	if err != nil {
		return err
	}
	r0 := s.reqs.Load()
	cpu0 := processCPU()
	var ms0 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	// The callers carry the cell's labels, so that a merged profile can be
	// read one design at a time (go tool pprof -tagfocus design=NAME); the
	// designs' own background goroutines, started before, carry none.
	var m measured
	pprof.Do(ctx, pprof.Labels("design", s.name, "workload", wl.name), func(ctx context.Context) {
		m, err = drive(ctx, cfg, wl, s.decs, keys, s.walk, d, true)
	})
	if err != nil {
		return err
	}
	var ms1 runtime.MemStats
	runtime.ReadMemStats(&ms1)
	cpu1 := processCPU()
	c1, err := redistest.ReadStats(cfg.addr)
	if err != nil {
		return err
	}
	r := &s.res
	if cfg.profiler != nil {
		cats, err := cfg.profiler.stop()
		if err != nil {
			return err
		}
		r.categories = addUp(r.categories, cats)
	}
	delta := c1.Sub(c0)
	r.reqs += s.reqs.Load() - r0
	r.cmds += delta.TotalCommands - 1 // the first INFO is counted in the second reading
	r.calls = addUp(r.calls, delta.Calls)
	r.usec = addUp(r.usec, delta.Usec)
	r.cpu += delta.CPU
	r.clientCPU += cpu1 - cpu0
	r.mallocs += int64(ms1.Mallocs - ms0.Mallocs)
	r.decisions += m.decisions
	r.admitted += m.admitted
	r.fallbacks += m.fallbacks
	r.elapsed += m.elapsed
	r.hist.Merge(&m.hist)
	if wl.limited {
		r.idealSum += idealOf(wl, m.decisions, m.elapsed)
	}
	s.rates = append(s.rates, float64(m.decisions)/m.elapsed.Seconds())
	s.p50s = append(s.p50s, m.hist.Quantile(0.5).Seconds())
	return nil
}

// addUp adds the values of d to sum's, by name, and returns sum (made if
// nil).
func addUp[V int64 | time.Duration](sum, d map[string]V) map[string]V {
	if sum == nil {
		sum = make(map[string]V)
	}
	for name, v := range d {
		sum[name] += v
	}
	return sum
}

// runWorkload prepares every design for wl, then runs rounds of slices,
// the designs in a balanced order (see roundOrder), and returns each
// design's results with its per-round rates.
func runWorkload(ctx context.Context, cfg config, wl workload, names []string) (_ []*setup, err error) {
	setups := make([]*setup, 0, len(names))
	defer func() {
		for _, s := range setups {
			if cerr := s.close(); cerr != nil && err == nil {
				err = cerr
			}
		}
	}()
	for _, name := range names {
		s, perr := prepare(ctx, cfg, wl, name)
		setups = append(setups, s)
		if perr != nil {
			return nil, fmt.Errorf("%s / %s: %w", wl.name, name, perr)
		}
	}
	slice := cfg.duration / time.Duration(cfg.rounds)
	for round := range cfg.rounds {
		for _, i := range roundOrder(len(setups), round) {
			s := setups[i]
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if err := s.slice(ctx, cfg, round, slice); err != nil {
				return nil, fmt.Errorf("%s / %s: %w", wl.name, s.name, err)
			}
		}
	}
	for _, s := range setups {
		fmt.Fprintf(os.Stderr, "compare: %-40s %-18s %.0f decisions/s\n", wl.name, s.name, s.res.rate())
	}
	return setups, nil
}

// spread is the median of the per-round ratios of a to b and their range.
type spread struct{ median, lo, hi float64 }

// ratios compares per-round values a and b (the same rounds): rates, or
// median latencies.
func ratios(a, b []float64) (spread, bool) {
	if len(a) == 0 || len(a) != len(b) {
		return spread{}, false
	}
	rs := make([]float64, len(a))
	for i := range a {
		if b[i] <= 0 {
			return spread{}, false
		}
		rs[i] = a[i] / b[i]
	}
	slices.Sort(rs)
	med := rs[len(rs)/2]
	if len(rs)%2 == 0 {
		med = (rs[len(rs)/2-1] + rs[len(rs)/2]) / 2
	}
	return spread{median: med, lo: rs[0], hi: rs[len(rs)-1]}, true
}

// processCPU returns the CPU time this process has used (user + system).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// roundOrder is the order in which n designs run in round r: a Williams
// design, the rotations of 0, 1, n-1, 2, n-2, ... (and, for an odd n, of
// its reverse in the next n rounds), in which every design runs first as
// often as any other and follows each other design equally often over n
// rounds (2n for an odd n). A plain rotation of the designs' list gave each
// design the same predecessor in every round, and a predecessor's work
// lands in the slice after its own: a design's keys and resend keys expire
// a few seconds after its slice, on Redis's CPU, in the next design's.
// Measured with one caller on the cold long tail: whichever of leases and
// exact mode followed the other had 4-5 us more Redis CPU per decision
// (41.1 against 36.4 us, then 45.7 against 41.7 with the order swapped).
// Rounds run back to back, so a round's last design also precedes the
// next round's first: over a cycle one predecessor comes once more than
// the others, where a plain rotation gave every design one predecessor.
func roundOrder(n, r int) []int {
	base := make([]int, n)
	for i := range base {
		if i%2 == 1 {
			base[i] = (i + 1) / 2
		} else {
			base[i] = (n - i/2) % n
		}
	}
	if n%2 == 1 && (r/n)%2 == 1 {
		slices.Reverse(base)
	}
	order := make([]int, n)
	for i, b := range base {
		order[i] = (b + r) % n
	}
	return order
}
