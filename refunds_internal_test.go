package leaselimit

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
)

// TestDroppedRefundsCounted: refunds past the queue's bound are dropped and
// counted, in tokens, on ratelimit.lease.refunds.dropped. Regression: they
// were counted in a field nothing exposed.
func TestDroppedRefundsCounted(t *testing.T) {
	_, c := newMini(t, nil)
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
	l.refunds.add(rkey, l.limit, 5, 0)
	l.refunds.add(rkey, l.limit, 7, 0)
	dropped := droppedTokens(t, reader)
	if dropped != 12 {
		t.Errorf("%s = %d; want the 12 tokens of the two refunds past the bound", telemetry.MetricDropped, dropped)
	}
}

// droppedTokens reads ratelimit.lease.refunds.dropped from reader.
func droppedTokens(t *testing.T, reader *sdkmetric.ManualReader) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			if mt.Name == telemetry.MetricDropped {
				for _, dp := range mt.Data.(metricdata.Sum[int64]).DataPoints {
					n += dp.Value
				}
			}
		}
	}
	return n
}

// TestRefundQueueFlush: refunds whose breaker holds calls back stay queued
// for the next round; a pipeline that fails once sent is dropped (never
// resent, so never applied twice) and counted.
func TestRefundQueueFlush(t *testing.T) {
	m, c := newMini(t, &redis.Options{MaxRetries: -1})
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	l, err := New(c, policy.PerSecond(100).WithName("flush"), WithMeterProvider(mp),
		WithBreaker(breaker.Settings{Failures: 1, OpenFor: time.Hour}))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	q := l.refunds
	rkey := l.auth.Key(l.limit, "k")

	// The breaker open: kept.
	done, err := l.brks.one.Allow()
	if err != nil {
		t.Fatal(err)
	}
	done(breaker.ErrBudget)
	if !l.brks.one.Rejects(time.Now()) {
		t.Fatal("breaker not open after a failure")
	}
	q.add(rkey, l.limit, 3, 0)
	q.flush()
	if got := len(q.take()); got != 1 {
		t.Fatalf("%d refunds queued after a flush with the breaker open; want the 1 kept", got)
	}

	// A healthy breaker and a Redis that fails the send: dropped, counted.
	l2, err := New(c, policy.PerSecond(100).WithName("flush2"), WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	m.SetError("LOADING Redis is loading the dataset in memory")
	l2.refunds.add(l2.auth.Key(l2.limit, "k"), l2.limit, 4, 0)
	l2.refunds.flush()
	m.SetError("")
	if got := len(l2.refunds.take()); got != 0 {
		t.Errorf("%d refunds queued after a failed send; want none (never resent)", got)
	}
	if got := droppedTokens(t, reader); got != 4 {
		t.Errorf("dropped = %d tokens; want the 4 of the failed send", got)
	}
}
