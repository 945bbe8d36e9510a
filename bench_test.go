package leaselimit_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
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
	ctx := context.Background()
	var srcs [4]atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			d, err := lim.Allow(ctx, "hot")
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
