package leaselimit

import (
	"context"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// TestOldUnknownSurplusDropped: a reservation's surplus whose tokens'
// grant time is unknown (since 0) goes back within half a reset mark's
// life of its Reserve, and is dropped later (a Reset since may have ended
// its generation, and its mark may be gone before the refund lands),
// counted on ratelimit.lease.refunds.dropped.
func TestOldUnknownSurplusDropped(t *testing.T) {
	_, c := newMini(t, nil)
	reader := sdkmetric.NewManualReader()
	l := policy.Limit{Name: "unknown-surplus", Rate: 1, Period: 30 * 24 * time.Hour, Burst: 100}
	lim, err := New(c, l, WithoutLease(), WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))))
	if err != nil {
		t.Fatal(err)
	}
	defer lim.Close()
	ctx := context.Background()
	if d, err := lim.AllowN(ctx, "k", 40); err != nil || !d.Allowed {
		t.Fatalf("AllowN(40) = %+v, %v", d, err)
	}
	left := func() int64 {
		t.Helper()
		d, err := lim.Peek(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		return d.Remaining
	}
	if err := lim.adjust(ctx, "k", 5, stamp{taken: time.Now().Add(-unknownSurplusLife)}); err != nil {
		t.Fatal(err)
	}
	if got := left(); got != 60 {
		t.Errorf("a surplus of unknown time, half a mark's life old: %d left; want 60 (dropped)", got)
	}
	if err := lim.adjust(ctx, "k", 5, stamp{taken: time.Now().Add(-time.Hour)}); err != nil {
		t.Fatal(err)
	}
	if got := left(); got != 65 {
		t.Errorf("a surplus of unknown time, an hour old: %d left; want 65 (given back)", got)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	dropped := int64(0)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == telemetry.MetricDropped {
				for _, p := range sum.DataPoints {
					dropped += p.Value
				}
			}
		}
	}
	if dropped != 5 {
		t.Errorf("ratelimit.lease.refunds.dropped = %d; want 5", dropped)
	}
}
