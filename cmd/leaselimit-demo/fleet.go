package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit"
)

// Key classes of the traffic mix.
const (
	classHot     = iota // one popular key, well over its limit
	classAbusive        // one client far over its limit
	classTail           // many keys, each well under its limit
	numClasses
)

var classNames = [numClasses]string{"hot key", "abusive", "long tail"}

// Shares of the offered load.
const (
	hotShare     = 0.40
	abusiveShare = 0.52
)

const (
	hotKey     = "tenant:big-customer"
	abusiveKey = "client:scraper"
)

// Windows of a run: the outage act splits its run in three.
const (
	winBefore = iota // Redis up (the whole run in act 1)
	winDown          // Redis stopped
	winAfter         // Redis back
	numWindows
)

const numSources = 4 // leaselimit.SourceLease .. SourceFallback

// decideFunc is one instance's rate-limit decision for key.
type decideFunc func(ctx context.Context, key string) (allowed bool, src leaselimit.Source, err error)

// traffic describes the request stream the load balancer spreads over the
// fleet: every worker of every instance sends an equal share of it.
type traffic struct {
	load     float64 // requests per second across the fleet
	tailKeys int
	seed     uint64
	workers  int // per instance
	tail     []string
}

func newTraffic(cfg *config) *traffic {
	t := &traffic{load: cfg.load, tailKeys: cfg.tailKeys, seed: cfg.seed, workers: cfg.workers}
	t.tail = make([]string, cfg.tailKeys)
	for i := range t.tail {
		t.tail[i] = fmt.Sprintf("tenant:%05d", i)
	}
	return t
}

// rng returns the random source of one worker: the same seed, instance and
// worker give the same sequence of keys in every design.
func (t *traffic) rng(inst, worker int) *rand.Rand {
	return rand.New(rand.NewPCG(t.seed, uint64(inst)<<32|uint64(worker)))
}

// pick draws the next request's key.
func (t *traffic) pick(r *rand.Rand) (string, int) {
	x := r.Float64()
	switch {
	case x < hotShare:
		return hotKey, classHot
	case x < hotShare+abusiveShare:
		return abusiveKey, classAbusive
	}
	return t.tail[r.IntN(len(t.tail))], classTail
}

// demand returns the offered requests per second of a class.
func (t *traffic) demand(class int) float64 {
	switch class {
	case classHot:
		return t.load * hotShare
	case classAbusive:
		return t.load * abusiveShare
	}
	return t.load * (1 - hotShare - abusiveShare)
}

// series is one fleet under test: a design, or a failure policy in the
// outage act. insts holds one decide function per instance.
type series struct {
	label string // for the report, progress lines and the chart
	insts []decideFunc
	stats *seriesStats
}

// seriesStats counts a series' decisions. Counters are shared atomics so the
// progress line can read them live; latencies go to per-worker slices.
type seriesStats struct {
	// counts[window][class][source][allowed]
	counts [numWindows][numClasses][numSources][2]atomic.Int64
	errors [numWindows]atomic.Int64
	errMu  sync.Mutex
	errs   map[string]int64 // distinct error messages

	bins      []atomic.Int64 // hot-key admitted per bin
	firstAuth []atomic.Int64 // per instance: ns from the run start to the first authority decision after Redis came back

	latency  [][]time.Duration // per worker
	sortOnce sync.Once
	sorted   []time.Duration
}

func (s *seriesStats) count(w, class int, src leaselimit.Source, allowed bool) int64 {
	a := 0
	if allowed {
		a = 1
	}
	return s.counts[w][class][src][a].Load()
}

// sum adds up counts over the windows, classes and sources selected (nil:
// all), for allowed decisions only or for all.
func (s *seriesStats) sum(windows, classes []int, sources []leaselimit.Source, onlyAllowed bool) int64 {
	if windows == nil {
		windows = []int{winBefore, winDown, winAfter}
	}
	if classes == nil {
		classes = []int{classHot, classAbusive, classTail}
	}
	if sources == nil {
		sources = []leaselimit.Source{leaselimit.SourceLease, leaselimit.SourceAuthority, leaselimit.SourceCache, leaselimit.SourceFallback}
	}
	var n int64
	for _, w := range windows {
		for _, c := range classes {
			for _, src := range sources {
				n += s.count(w, c, src, true)
				if !onlyAllowed {
					n += s.count(w, c, src, false)
				}
			}
		}
	}
	return n
}

// latencies returns every sampled latency, sorted. Call it once the run is
// over.
func (s *seriesStats) latencies() []time.Duration {
	s.sortOnce.Do(func() { s.sorted = s.mergeLatencies() })
	return s.sorted
}

func (s *seriesStats) mergeLatencies() []time.Duration {
	n := 0
	for _, l := range s.latency {
		n += len(l)
	}
	all := make([]time.Duration, 0, n)
	for _, l := range s.latency {
		all = append(all, l...)
	}
	sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
	return all
}

func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q * float64(len(sorted)-1))
	return sorted[i]
}

// runState is what the workers of one run share with its driver.
type runState struct {
	start  time.Time
	window atomic.Int32
	bin    time.Duration
}

// runFleet runs every series at once for d: each instance of each series
// gets its share of the traffic from its own workers. During the run, ctl
// (if not nil) is called in its own goroutine and may change the window.
// tick is called about once a second with the time since the start and the
// current window. It
// returns the measured length of the run: from the start of the first
// request to the end of the last.
func runFleet(ctx context.Context, tr *traffic, all []*series, d, bin time.Duration,
	tick func(el time.Duration, window int), ctl func(ctx context.Context, st *runState)) time.Duration {
	st := &runState{start: time.Now(), bin: bin}
	nbins := int(d/bin) + 2
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	deadline := st.start.Add(d)

	var wg sync.WaitGroup
	for _, s := range all {
		n := len(s.insts)
		s.stats = &seriesStats{
			errs:      map[string]int64{},
			bins:      make([]atomic.Int64, nbins),
			firstAuth: make([]atomic.Int64, n),
			latency:   make([][]time.Duration, n*tr.workers),
		}
		// Each worker's share of the load balancer's traffic.
		interval := time.Duration(float64(time.Second) * float64(n*tr.workers) / tr.load)
		expect := min(int(d/interval)+16, maxSamples)
		for i, dec := range s.insts {
			for w := 0; w < tr.workers; w++ {
				wg.Add(1)
				slot := i*tr.workers + w
				s.stats.latency[slot] = make([]time.Duration, 0, expect)
				go func() {
					defer wg.Done()
					worker(runCtx, st, tr, s.stats, i, slot, tr.rng(i, w), dec, interval, deadline)
				}()
			}
		}
	}

	ctlDone := make(chan struct{})
	go func() {
		defer close(ctlDone)
		if ctl != nil {
			ctl(runCtx, st)
		}
	}()

	t := time.NewTicker(time.Second)
	timer := time.NewTimer(d)
loop:
	for {
		select {
		case <-t.C:
			if tick != nil {
				tick(time.Since(st.start), int(st.window.Load()))
			}
		case <-timer.C:
			break loop
		case <-ctx.Done():
			break loop
		}
	}
	t.Stop()
	timer.Stop()
	cancel()
	wg.Wait()
	el := time.Since(st.start)
	<-ctlDone
	return el
}

// maxLag is how far a worker may fall behind its schedule before it gives up
// the requests it owes (the design cannot keep up with the offered load).
const maxLag = 100 * time.Millisecond

// maxSamples bounds the latencies a worker keeps.
const maxSamples = 1 << 18

// worker sends one worker's share of the traffic through dec on schedule
// until the deadline or ctx ends.
func worker(ctx context.Context, st *runState, tr *traffic, s *seriesStats, inst, slot int,
	r *rand.Rand, dec decideFunc, interval time.Duration, deadline time.Time) {
	lat := s.latency[slot]
	defer func() { s.latency[slot] = lat }()
	var seen int64
	res := rand.New(rand.NewPCG(uint64(slot), 0x5eed))
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	// Spread the workers' schedules over one interval.
	next := st.start.Add(time.Duration(r.Int64N(int64(interval) + 1)))
	for {
		now := time.Now()
		if !now.Before(deadline) || ctx.Err() != nil {
			return
		}
		if wait := next.Sub(now); wait > 0 {
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-ctx.Done():
				return
			}
		} else if -wait > maxLag {
			next = now
		}
		next = next.Add(interval)

		key, class := tr.pick(r)
		t0 := time.Now()
		allowed, src, err := dec(ctx, key)
		t1 := time.Now()
		// A decision belongs to the window in which it was made (returned).
		w := int(st.window.Load())
		if err != nil {
			if ctx.Err() != nil {
				return // the run ended during the call
			}
			s.errors[w].Add(1)
			s.errMu.Lock()
			s.errs[err.Error()]++
			s.errMu.Unlock()
			continue
		}
		// Keep every latency; past maxSamples per worker (only in very long
		// or heavy runs), keep a uniform sample (reservoir sampling).
		seen++
		if len(lat) < maxSamples {
			lat = append(lat, t1.Sub(t0))
		} else if j := res.Int64N(seen); j < maxSamples {
			lat[j] = t1.Sub(t0)
		}
		a := 0
		if allowed {
			a = 1
		}
		s.counts[w][class][src][a].Add(1)
		if allowed && class == classHot {
			if b := int(t1.Sub(st.start) / st.bin); b >= 0 && b < len(s.bins) {
				s.bins[b].Add(1)
			}
		}
		if src == leaselimit.SourceAuthority && w == winAfter {
			s.firstAuth[inst].CompareAndSwap(0, int64(t1.Sub(st.start)))
		}
	}
}
