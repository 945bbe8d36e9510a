package leaselimit_test

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// hotLimit admits everything the benchmarks can send, so they measure the
// cost of a decision rather than of a denial.
var hotLimit = policy.Limit{Name: "bench", Rate: 1_000_000_000, Period: time.Second, Burst: 1_000_000_000}

// BenchmarkAllowLeaseHit measures a hot key served from its lease, from
// b.RunParallel goroutines (one Limiter, miniredis behind it).
func BenchmarkAllowLeaseHit(b *testing.B) {
	_, c := newMiniTB(b)
	lim, err := leaselimit.New(c, hotLimit)
	if err != nil {
		b.Fatal(err)
	}
	defer lim.Close()
	benchLeaseHit(b, func() *leaselimit.Limiter { return lim })
}

// BenchmarkForLeaseHit is BenchmarkAllowLeaseHit through For, as a service
// with plans calls it: lim.For(plans[user.Plan]).Allow(ctx, key), with 16
// plans on the engine and the hot key on one of them.
func BenchmarkForLeaseHit(b *testing.B) {
	_, c := newMiniTB(b)
	lim, err := leaselimit.New(c, policy.PerSecond(10))
	if err != nil {
		b.Fatal(err)
	}
	defer lim.Close()
	plans := make([]policy.Limit, 16)
	for i := range plans {
		plans[i] = hotLimit.WithName(fmt.Sprintf("plan-%d", i))
		lim.For(plans[i])
	}
	benchLeaseHit(b, func() *leaselimit.Limiter { return lim.For(plans[7]) })
}

// benchLeaseHit calls limiter().Allow on one hot key from every processor.
func benchLeaseHit(b *testing.B, limiter func() *leaselimit.Limiter) {
	ctx := context.Background()
	var srcs [4]atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			d, err := limiter().Allow(ctx, "hot")
			if err != nil || !d.Allowed {
				b.Errorf("Allow = %+v, %v", d, err)
				return
			}
			srcs[d.Source].Add(1)
		}
	})
	b.StopTimer()
	total := float64(b.N)
	b.ReportMetric(float64(srcs[leaselimit.SourceLease].Load())/total, "lease-frac")
}

// BenchmarkAllowManyKeys spreads decisions over 10k keys.
func BenchmarkAllowManyKeys(b *testing.B) {
	_, c := newMiniTB(b)
	lim, err := leaselimit.New(c, hotLimit)
	if err != nil {
		b.Fatal(err)
	}
	defer lim.Close()
	keys := make([]string, 10_000)
	for i := range keys {
		keys[i] = "key-" + strconv.Itoa(i)
	}
	ctx := context.Background()
	var seq atomic.Uint64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := seq.Add(1) * 7919
		for pb.Next() {
			i++
			if _, err := lim.Allow(ctx, keys[i%uint64(len(keys))]); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkAllowLeaseHitTelemetry compares a lease hit with no provider (the
// global no-op), with an SDK provider that samples nothing, and with one
// that samples everything (spans go to an in-memory recorder).
func BenchmarkAllowLeaseHitTelemetry(b *testing.B) {
	for _, tc := range []struct {
		name    string
		sampler sdktrace.Sampler
	}{{"none", nil}, {"sdk-never", sdktrace.NeverSample()}, {"sdk-always", sdktrace.AlwaysSample()}} {
		b.Run(tc.name, func(b *testing.B) {
			_, c := newMiniTB(b)
			var opts []leaselimit.Option
			if tc.sampler != nil {
				tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(tc.sampler),
					sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
				mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
				defer tp.Shutdown(context.Background())
				defer mp.Shutdown(context.Background())
				opts = append(opts, leaselimit.WithTracerProvider(tp), leaselimit.WithMeterProvider(mp))
			}
			lim, err := leaselimit.New(c, hotLimit, opts...)
			if err != nil {
				b.Fatal(err)
			}
			defer lim.Close()
			ctx := context.Background()
			for i := 0; i < 20000; i++ { // warm the lease up
				_, _ = lim.Allow(ctx, "hot")
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := lim.Allow(ctx, "hot"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkAllowExact measures exact-mode decisions (every one a Redis
// call) on a real redis-server, from 64 goroutines per processor so that
// calls batch: one hot key, and cold keys that never repeat within the
// run; cold keys from one goroutine (alone), each call a round trip of
// its own; and cold keys with leases on (cold-leases). allocs/op is allocations per decision, the lane's and the
// authority's included; cpu-ns/op the client's CPU time per decision
// (this process's, so not the server's), which a busy machine disturbs
// less than ns/op.
func BenchmarkAllowExact(b *testing.B) {
	srv := redistest.Start(b)
	cold := func(i uint64) string { return "cold-" + strconv.FormatUint(i, 36) }
	for _, tc := range []struct {
		name        string
		key         func(i uint64) string
		parallelism int
		leases      bool
	}{
		{"hot", func(uint64) string { return "hot" }, 64, false},
		{"cold", cold, 64, false},
		{"cold-alone", cold, 0, false},
		// The lease design on keys it never sees twice: each decision
		// is exact, and should cost what exact mode's does.
		{"cold-leases", cold, 64, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			opts := []leaselimit.Option{leaselimit.WithoutLease()}
			if tc.leases {
				opts = nil
			}
			lim, err := leaselimit.New(srv.Client(b), hotLimit.WithName("exact-"+tc.name), opts...)
			if err != nil {
				b.Fatal(err)
			}
			defer lim.Close()
			keys := make([]string, b.N+1)
			for i := range keys {
				keys[i] = tc.key(uint64(i))
			}
			ctx := context.Background()
			var seq atomic.Uint64
			b.ReportAllocs()
			cpu0, cpuOK := processCPU()
			defer func() {
				if cpu1, ok := processCPU(); ok && cpuOK && !b.Failed() {
					b.ReportMetric(float64(cpu1-cpu0)/float64(b.N), "cpu-ns/op")
				}
			}()
			if tc.parallelism == 0 {
				b.ResetTimer()
				for i := range b.N {
					if d, err := lim.Allow(ctx, keys[i]); err != nil || !d.Allowed {
						b.Fatalf("Allow = %+v, %v", d, err)
					}
				}
				b.StopTimer()
				return
			}
			b.SetParallelism(tc.parallelism)
			b.ResetTimer()
			defer b.StopTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					d, err := lim.Allow(ctx, keys[seq.Add(1)%uint64(len(keys))])
					if err != nil || !d.Allowed {
						b.Errorf("Allow = %+v, %v", d, err)
						return
					}
				}
			})
		})
	}
}
