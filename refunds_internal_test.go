package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
)

// TestDroppedRefundsCounted: refunds past the queue's bound are dropped and
// counted, in tokens, on ratelimit.lease.refunds.dropped. Regression: they
// were counted in a field nothing exposed.
func TestDroppedRefundsCounted(t *testing.T) {
	_, c := newMini(t, nil)
	l, reader := meteredLimiter(t, c, policy.PerSecond(100).WithName("dropped"))
	l.refunds.mu.Lock()
	l.refunds.max = 0 // a full queue
	l.refunds.mu.Unlock()
	rkey := l.auth.Key(l.limit, "k")
	l.refunds.add(authority.Refund{Key: rkey, Limit: l.limit, Tokens: 5})
	l.refunds.add(authority.Refund{Key: rkey, Limit: l.limit, Tokens: 7})
	dropped := droppedTokens(t, reader)
	if dropped != 12 {
		t.Errorf("%s = %d; want the 12 tokens of the two refunds past the bound", telemetry.MetricDropped, dropped)
	}
}

// droppedTokens reads ratelimit.lease.refunds.dropped from reader.
func droppedTokens(t *testing.T, reader *sdkmetric.ManualReader) int64 {
	t.Helper()
	return counterSum(t, reader, telemetry.MetricDropped)
}

// counterSum is the sum of the data points of the int64 counter name in
// reader.
func counterSum(t *testing.T, reader *sdkmetric.ManualReader, name string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			if mt.Name == name {
				for _, dp := range mt.Data.(metricdata.Sum[int64]).DataPoints {
					n += dp.Value
				}
			}
		}
	}
	return n
}

// TestRefundQueueFlush: refunds whose breaker holds calls back stay queued
// for the next round; one whose send failed once it may have reached Redis
// is sent again under its id (applied once) for authority.ResendWithin,
// then dropped and counted; a charge is kept until Redis answers.
func TestRefundQueueFlush(t *testing.T) {
	m, c := newMini(t, &redis.Options{MaxRetries: -1})
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	l, err := New(c, policy.PerSecond(100).WithName("flush"), WithMeterProvider(mp),
		WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	q := l.refunds
	rkey := l.auth.Key(l.limit, "k")

	// The breaker open: kept.
	done, err := l.path.Shared().Allow()
	if err != nil {
		t.Fatal(err)
	}
	done(circuit.ErrBudget)
	if !l.path.Shared().Rejects(time.Now) {
		t.Fatal("breaker not open after a failure")
	}
	q.add(authority.Refund{Key: rkey, Limit: l.limit, Tokens: 3})
	q.flush()
	if got := len(q.take()); got != 1 {
		t.Fatalf("%d refunds queued after a flush with the breaker open; want the 1 kept", got)
	}

	// A healthy breaker and a Redis that fails the send (a reply: it was
	// sent): kept under its id, then applied once Redis answers.
	clk := &stepClock{t: time.Now()}
	l2, err := New(c, policy.PerMinute(60).WithName("flush2"), WithMeterProvider(mp), WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	k2 := l2.auth.Key(l2.limit, "k")
	if _, err := l2.auth.Acquire(context.Background(), k2, l2.limit, 10, 10, 1); err != nil {
		t.Fatal(err)
	}
	m.SetError("LOADING Redis is loading the dataset in memory")
	l2.refunds.add(authority.Refund{Key: k2, Limit: l2.limit, Tokens: 4})
	l2.refunds.flush()
	kept := l2.refunds.take()
	if len(kept) != 1 || kept[0].Once() == "" || kept[0].reached == 0 {
		t.Fatalf("queued after a failed send: %+v; want the refund, with its call's id and when it may have reached Redis", kept)
	}
	l2.refunds.putAll(kept)
	m.SetError("")
	l2.refunds.flush()
	if got := len(l2.refunds.take()); got != 0 {
		t.Errorf("%d refunds queued after Redis answered; want none", got)
	}
	if v, err := l2.Peek(context.Background(), "k"); err != nil || v.Remaining != 54 {
		t.Errorf("Peek = %+v, %v; want 54 (50 + the 4 refunded)", v, err)
	}
	// Resent under its id: not applied again.
	l2.refunds.putAll(kept)
	l2.refunds.flush()
	if v, err := l2.Peek(context.Background(), "k"); err != nil || v.Remaining != 54 {
		t.Errorf("Peek after a resend = %+v, %v; want 54 still", v, err)
	}

	// Failing for longer than Redis remembers the id: dropped, counted.
	m.SetError("LOADING Redis is loading the dataset in memory")
	l2.refunds.add(authority.Refund{Key: k2, Limit: l2.limit, Tokens: 4})
	l2.refunds.flush()
	clk.add(authority.ResendWithin + time.Millisecond)
	l2.refunds.flush()
	m.SetError("")
	if got := len(l2.refunds.take()); got != 0 {
		t.Errorf("%d refunds queued past ResendWithin; want none", got)
	}
	if got := droppedTokens(t, reader); got != 4 {
		t.Errorf("dropped = %d tokens; want the 4 of the send that kept failing", got)
	}

	// A charge failing as long is kept, and made once Redis answers: never
	// made, it would over-admit; made twice, it only under-admits.
	m.SetError("LOADING Redis is loading the dataset in memory")
	l2.refunds.add(authority.Refund{Key: k2, Limit: l2.limit, Tokens: -5})
	l2.refunds.flush()
	clk.add(10 * authority.ResendWithin)
	l2.refunds.flush()
	m.SetError("")
	if got := len(l2.refunds.queue); got != 1 {
		t.Fatalf("%d adjustments queued after a charge failed past ResendWithin; want the charge kept", got)
	}
	l2.refunds.flush()
	if v, err := l2.Peek(context.Background(), "k"); err != nil || v.Remaining != 49 {
		t.Errorf("Peek after the charge = %+v, %v; want 49 (54 - 5)", v, err)
	}
}

// stepClock is a Clock moved by hand.
type stepClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *stepClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// TestReachedRedis: an adjustment counts as never having reached Redis
// only when that is certain: the breaker or Close held it back, or, for a
// client that never sends a command twice on its own, go-redis failed to
// dial or to get a connection. A client that retries reports only its
// last attempt, which hides an earlier one that may have been applied
// before its connection broke (its reply lost, then the dial refused).
func TestReachedRedis(t *testing.T) {
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connect: connection refused")}
	read := &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")}
	for _, tc := range []struct {
		err     error
		retries bool
		want    bool
	}{
		{breaker.ErrOpen, true, false},
		{ErrClosed, true, false},
		{dial, true, true},
		{dial, false, false},
		{fmt.Errorf("wrapped: %w", dial), false, false},
		{redis.ErrPoolTimeout, false, false},
		{redis.ErrPoolTimeout, true, true},
		{read, false, true},
		{io.EOF, false, true},
		{context.DeadlineExceeded, false, true},
	} {
		q := &refundQueue{retries: tc.retries}
		if got := q.reachedRedis(tc.err); got != tc.want {
			t.Errorf("reachedRedis(%v) with retries %v = %v; want %v", tc.err, tc.retries, got, tc.want)
		}
	}
}

// TestSettleSurplusCounted: a Settle's surplus sent at once is counted on
// ratelimit.lease.refunds, as one sent through the queue is. Regression:
// only the queued ones were (6 tokens counted while Redis was down, none
// while it was up).
func TestSettleSurplusCounted(t *testing.T) {
	_, c := newMini(t, nil)
	l, reader := meteredLimiter(t, c, policy.PerHour(100).WithName("surplus"), WithoutLease())
	ctx := context.Background()
	r, err := l.Reserve(ctx, "k", 10)
	if err != nil || !r.Decision().Allowed {
		t.Fatalf("Reserve(10) = %+v, %v", r.Decision(), err)
	}
	if err := r.Settle(ctx, 4); err != nil {
		t.Fatal(err)
	}
	l.refunds.mu.Lock()
	queued := len(l.refunds.queue)
	l.refunds.mu.Unlock()
	if queued != 0 {
		t.Fatalf("%d adjustments queued; want the surplus sent at once", queued)
	}
	if n := counterSum(t, reader, telemetry.MetricRefunds); n != 6 {
		t.Errorf("%s = %d after a surplus of 6 sent at once; want 6", telemetry.MetricRefunds, n)
	}
}
