package leaselimit_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// TestShadowMode: in shadow mode every request is admitted, marked as
// shadow, with ShadowDenied where the limit would have denied; admissions
// take their tokens and would-be denials take nothing, so enforcing the
// limit afterwards starts from the bucket it would have had; the decisions
// are counted with ratelimit.shadow and what the limit decided.
func TestShadowMode(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	for _, mode := range []string{"exact", "lease"} {
		t.Run(mode, func(t *testing.T) {
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
			l := policy.Limit{Name: "shadow-" + mode, Rate: 5, Period: time.Hour, Burst: 5}
			opts := []leaselimit.Option{leaselimit.WithShadow(), leaselimit.WithMeterProvider(mp)}
			if mode == "exact" {
				opts = append(opts, leaselimit.WithoutLease())
			}
			lim := mustNew(t, srv.Client(t), l, opts...)
			for i := 0; i < 12; i++ {
				d, err := lim.Allow(ctx, "k")
				if err != nil {
					t.Fatal(err)
				}
				if !d.Allowed || !d.Shadow || d.ShadowDenied != (i >= 5) || d.RetryAfter != 0 {
					t.Fatalf("shadow request %d = %+v; want admitted, Shadow, ShadowDenied %v", i, d, i >= 5)
				}
			}
			if err := lim.Wait(ctx, "k"); err != nil {
				t.Errorf("Wait in shadow mode = %v; want at once", err)
			}
			enforced := lim.Enforcing(1)
			if d, err := enforced.Allow(ctx, "k"); err != nil || d.Allowed || d.Shadow {
				t.Errorf("the same limit enforced afterwards = %+v, %v; want denied: shadow admissions took their tokens", d, err)
			}
			p, err := enforced.Peek(ctx, "k")
			if err != nil || p.Remaining != 0 {
				t.Errorf("Peek = %+v, %v", p, err)
			}
			allowed, denied := shadowCounts(t, reader)
			if allowed != 5 || denied != 8 {
				t.Errorf("ratelimit.decisions with ratelimit.shadow: %d allowed, %d denied; want 5 and 8", allowed, denied)
			}
		})
	}
}

// shadowCounts reads the shadow decisions of ratelimit.decisions by what
// the limit decided.
func shadowCounts(t *testing.T, reader *sdkmetric.ManualReader) (allowed, denied int64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			if mt.Name != telemetry.MetricDecisions {
				continue
			}
			for _, dp := range mt.Data.(metricdata.Sum[int64]).DataPoints {
				if v, ok := dp.Attributes.Value(telemetry.AttrShadow); !ok || !v.AsBool() {
					continue
				}
				if v, _ := dp.Attributes.Value(attribute.Key(telemetry.AttrAllowed)); v.AsBool() {
					allowed += dp.Value
				} else {
					denied += dp.Value
				}
			}
		}
	}
	return allowed, denied
}

// TestEnforceShare: WithEnforce enforces a deterministic share of keys, the
// same on every instance, and shadows the others.
func TestEnforceShare(t *testing.T) {
	_, c := newMini(t)
	ctx := context.Background()
	l := policy.Limit{Name: "rollout", Rate: 1, Period: time.Hour, Burst: 1}
	a := mustNew(t, c, l, leaselimit.WithEnforce(0.25), leaselimit.WithoutLease())
	b := mustNew(t, c, l.WithName("rollout-b"), leaselimit.WithEnforce(0.25), leaselimit.WithoutLease())
	const keys = 2000
	enforced := 0
	for i := 0; i < keys; i++ {
		key := fmt.Sprintf("user-%d", i)
		da, err := a.Allow(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		db, err := b.Allow(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if da.Shadow != db.Shadow {
			t.Fatalf("%s: shadow on one instance (%v) and not the other (%v)", key, da.Shadow, db.Shadow)
		}
		if !da.Shadow {
			enforced++
		}
	}
	if share := float64(enforced) / keys; share < 0.22 || share > 0.28 {
		t.Errorf("WithEnforce(0.25) enforced %.3f of %d keys", share, keys)
	}
	if _, err := leaselimit.New(c, l, leaselimit.WithEnforce(1.5)); err == nil {
		t.Error("WithEnforce(1.5) accepted")
	}
	if _, err := a.Enforcing(-1).Allow(ctx, "k"); err == nil {
		t.Error("Enforcing(-1) accepted")
	}
}
