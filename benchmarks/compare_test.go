// Package bench compares leaselimit with go-redis/redis_rate and a classic
// per-request Lua token bucket on a real redis-server, as Go benchmarks:
//
//	go test -run '^$' -bench . -benchtime 2s ./...
//
// Every benchmark starts its own redis-server on a free loopback port (and
// skips when redis-server is not on PATH). Each sub-benchmark is one design;
// the metrics besides ns/op are:
//
//	cmds/op  Redis total_commands_processed per decision (INFO stats delta,
//	         without the INFO commands themselves); this counts the commands
//	         scripts run inside Redis too
//	reqs/op  commands the Go client sent per decision (round trips; pipelined
//	         commands count one each)
//	p99-ns   99th percentile latency of one decision, in ns (one decision in
//	         latency.Sample timed per goroutine)
//	admit/op fraction of decisions that were admitted
package bench

import (
	"context"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/benchmarks/internal/design"
	"github.com/leaselimit/leaselimit/benchmarks/internal/latency"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// goroutines is how many goroutines RunParallel should run.
const goroutines = 64

// parallelism returns the b.SetParallelism argument that gives about
// goroutines goroutines (RunParallel starts parallelism × GOMAXPROCS).
func parallelism() int {
	p := (goroutines + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0)
	return max(p, 1)
}

var (
	// unlimited admits everything the benchmarks can send, so they measure
	// the cost of a decision rather than of a denial.
	unlimited = policy.Limit{Name: "bench", Rate: 1_000_000_000, Period: time.Second, Burst: 1_000_000_000}
	// low is far below what the benchmarks send: mostly denials.
	low = policy.Limit{Name: "bench-low", Rate: 100, Period: time.Second, Burst: 100}
)

// round numbers the runs of the benchmark functions, so every run works on
// fresh Redis keys (a fresh, full bucket).
var round atomic.Int64

// BenchmarkHotKey: one key, every decision admitted.
func BenchmarkHotKey(b *testing.B) {
	runDesigns(b, unlimited, 1)
}

// BenchmarkManyKeys: 10,000 keys, each goroutine walking them in its own
// order, every decision admitted.
func BenchmarkManyKeys(b *testing.B) {
	runDesigns(b, unlimited, 10_000)
}

// BenchmarkOverLimit: one key with a limit of 100/s hammered by every
// goroutine: nearly every decision is a denial.
func BenchmarkOverLimit(b *testing.B) {
	runDesigns(b, low, 1)
}

func runDesigns(b *testing.B, limit policy.Limit, nkeys int) {
	srv := redistest.Start(b)
	for _, name := range design.Names {
		b.Run(name, func(b *testing.B) { benchDesign(b, srv, name, limit, nkeys) })
	}
}

// strides are step sizes coprime to 10,000 (and to 1), so a goroutine that
// steps through the keys with one of them visits every key; different
// goroutines use different strides and start points, hence different orders.
var strides = []int{1, 7919, 3, 4999, 7, 6007, 9, 1237, 11, 8191, 13, 2749, 17, 9973, 19, 5281}

func benchDesign(b *testing.B, srv *redistest.Server, name string, limit policy.Limit, nkeys int) {
	ctx := context.Background()
	r := round.Add(1)
	keys := make([]string, nkeys)
	for i := range keys {
		keys[i] = "r" + strconv.FormatInt(r, 10) + ":k" + strconv.Itoa(i)
	}

	var reqs design.Counter
	rdb := design.NewClient(srv.Addr, &reqs)
	defer rdb.Close()

	// Warm up on another key: connections, script caches.
	warm := newDecider(b, name, rdb, limit)
	warmUp(b, ctx, warm, "r"+strconv.FormatInt(r, 10)+":warm")

	dec := newDecider(b, name, rdb, limit)
	defer closeDecider(b, dec)

	before := srv.Stats(b)
	reqs0 := reqs.Load()
	run := runDecisions(b, ctx, dec, keys)
	after := srv.Stats(b)
	run.report(b, name, after.Sub(before).TotalCommands, reqs.Load()-reqs0)
}

// newDecider makes design name's decider on rdb, or fails b.
func newDecider(b *testing.B, name string, rdb *redis.Client, limit policy.Limit) design.Decider {
	b.Helper()
	dec, err := design.New(name, rdb, limit)
	if err != nil {
		b.Fatal(err)
	}
	return dec
}

// closeDecider closes dec (before its client: leaselimit returns its
// leases to Redis), failing b if that fails.
func closeDecider(b *testing.B, dec design.Decider) {
	if err := dec.Close(); err != nil {
		b.Error(err)
	}
}

// decisionRun is what runDecisions measured.
type decisionRun struct {
	admitted, fallbacks int64
	hist                latency.Hist
}

// runDecisions drives dec over keys from b.RunParallel goroutines (about 64
// in all, see parallelism), each walking the keys in its own order and
// timing one decision in latency.Sample. The timer runs only around the
// decisions, so callers measure Redis before and after it.
func runDecisions(b *testing.B, ctx context.Context, dec design.Decider, keys []string) decisionRun {
	par := parallelism()
	nkeys := len(keys)
	hists := make([]latency.Hist, par*runtime.GOMAXPROCS(0))
	var next, admitted, fallbacks atomic.Int64
	b.SetParallelism(par)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		id := int(next.Add(1) - 1)
		h := &hists[id%len(hists)]
		stride := strides[id%len(strides)]
		k := (id * 613) % nkeys
		var ok, fb int64
		for i := 0; pb.Next(); i++ {
			k += stride
			if k >= nkeys {
				k %= nkeys
			}
			var t0 time.Time
			timed := i%latency.Sample == 0
			if timed {
				t0 = time.Now()
			}
			res, err := dec.Allow(ctx, keys[k])
			if timed {
				h.Record(time.Since(t0))
			}
			if err != nil {
				b.Error(err)
				return
			}
			if res.Allowed {
				ok++
			}
			if res.Fallback {
				fb++
			}
		}
		admitted.Add(ok)
		fallbacks.Add(fb)
	})
	b.StopTimer()
	r := decisionRun{admitted: admitted.Load(), fallbacks: fallbacks.Load()}
	for i := range hists {
		r.hist.Merge(&hists[i])
	}
	return r
}

// report adds the per-decision metrics: Redis commands executed (cmds),
// requests sent (reqs), p99 latency, admissions and fallbacks.
func (r *decisionRun) report(b *testing.B, label string, cmds, reqs int64) {
	n := float64(b.N)
	b.ReportMetric(float64(cmds)/n, "cmds/op")
	b.ReportMetric(float64(reqs)/n, "reqs/op")
	b.ReportMetric(float64(r.hist.Quantile(0.99).Nanoseconds()), "p99-ns")
	b.ReportMetric(float64(r.admitted)/n, "admit/op")
	if r.fallbacks > 0 {
		// Redis did not answer within leaselimit's budget: these decisions
		// were made by the failure policy, not by the bucket.
		b.Logf("%s: %d of %d decisions were fallbacks (Redis over budget)", label, r.fallbacks, b.N)
		b.ReportMetric(float64(r.fallbacks)/n, "fallback/op")
	}
}

// warmUp makes a few decisions on key from every goroutine (connections,
// script caches), then closes warm.
func warmUp(b *testing.B, ctx context.Context, warm design.Decider, key string) {
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			for range 4 {
				if _, err := warm.Allow(ctx, key); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := warm.Close(); err != nil {
		b.Fatal(err)
	}
}
