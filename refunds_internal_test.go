package leaselimit

import (
	"context"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
)

// TestDroppedRefundsCounted: refunds past the queue's bound are dropped and
// counted, in tokens, on ratelimit.lease.refunds.dropped. Regression: they
// were counted in a field nothing exposed.
func TestDroppedRefundsCounted(t *testing.T) {
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	l, err := New(c, policy.PerSecond(100).WithName("dropped"), WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	l.refunds.mu.Lock()
	l.refunds.max = 0 // a full queue
	l.refunds.mu.Unlock()
	rkey := l.auth.Key(l.limit, "k")
	l.refunds.add(rkey, 5)
	l.refunds.add(rkey, 7)
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var dropped int64
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			if mt.Name == telemetry.MetricDropped {
				for _, dp := range mt.Data.(metricdata.Sum[int64]).DataPoints {
					dropped += dp.Value
				}
			}
		}
	}
	if dropped != 12 {
		t.Errorf("%s = %d; want the 12 tokens of the two refunds past the bound", telemetry.MetricDropped, dropped)
	}
}
