package redispath

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// TestCloseSendsALargeFlushWhole: Close's final send of many adjustments
// gets its whole refundBudget, though that is longer than finalWait: here
// 10,000 adjustments and a budget of 1s (refundBudget 1.5s), on a client
// that honours deadlines; the pipeline's context must carry the whole
// 1.5s, and every adjustment must be sent. Regression (a review):
// finalWait cut the send at 1s, and Close dropped them all (with Redis
// healthy, 93,000 adjustments owed after an outage on 128,000 keys). The
// test once paused Redis for 1.02s, past finalWait, and asked that 40,000
// be sent in the 3s (the cap): they took 29-34 µs each under -race on a
// quiet machine, 50-70 µs on a slower one, where it failed two runs in
// five, at the code before and after the change that met it. The deadline
// the pipeline gets is what the regression cut, and it is read here
// directly, not through how fast this machine sends.
func TestCloseSendsALargeFlushWhole(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	deadlines := &deadlineHook{}
	c.AddHook(deadlines)
	auth, tel := authAndTel(t, c, "large-flush")
	const budget, n = time.Second, 10_000
	p := New(Config{Client: c, Auth: auth, Budget: budget, Name: "large-flush", Unavailable: errors.New("unavailable"), Tel: tel})
	defer p.Wait()
	defer p.Close()
	if p.refundBudget(n) <= p.finalWait() {
		t.Fatalf("refundBudget(%d) = %v, finalWait %v: the test needs the first longer", n, p.refundBudget(n), p.finalWait())
	}
	l := policy.Limit{Name: "large-flush", Rate: 1, Period: time.Hour, Burst: 10}
	rs := make([]authority.Refund, n)
	for i := range rs {
		rs[i] = authority.Refund{Key: auth.Key(l, strconv.Itoa(i)), Limit: l, Tokens: 1}
	}
	start := time.Now()
	failed := p.RefundFinal(rs, n)
	t.Logf("%d adjustments sent in %v, %d failed", n, time.Since(start).Round(time.Millisecond), len(failed))
	if len(failed) > 0 {
		t.Errorf("%d of %d adjustments not sent (first: %v); want all sent", len(failed), n, failed[0].Err)
	}
	first, ok := deadlines.first()
	if !ok {
		t.Fatal("no pipeline of adjustments was sent with a deadline")
	}
	if got := first.Sub(start); got < p.refundBudget(n) {
		t.Errorf("the first send's deadline came %v after RefundFinal was called; want at least refundBudget, %v (finalWait %v)", got, p.refundBudget(n), p.finalWait())
	}
}

// deadlineHook records the deadline of the first pipeline sent.
type deadlineHook struct {
	mu       sync.Mutex
	deadline time.Time
	seen     bool
}

func (h *deadlineHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *deadlineHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h *deadlineHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if d, ok := ctx.Deadline(); ok {
			h.mu.Lock()
			if !h.seen {
				h.deadline, h.seen = d, true
			}
			h.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}

// first returns the first pipeline's deadline, and whether one was sent.
func (h *deadlineHook) first() (time.Time, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.deadline, h.seen
}
