package redispath

import (
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// TestCloseSendsALargeFlushWhole: Close's final send of many adjustments
// gets its whole refundBudget, though that is longer than finalWait: here
// 40,000 adjustments, a budget of 1s (refundBudget 3s, its cap) and Redis
// paused for 1.02s (CLIENT PAUSE), past finalWait, on a client that honours
// deadlines. Regression (a review): finalWait cut the send at 1s, and Close
// dropped them all (with Redis healthy, 93,000 adjustments owed after an
// outage on 128,000 keys). (20,000 with a pause of 1.1s left them 0.9s,
// 45 µs each: under -race, with CI compiling the next packages beside it,
// that was once too little; now 1.98s, 49.5 µs each, where they took
// 29-34 µs under -race, sent in 2.16-2.37s of the 3s.)
func TestCloseSendsALargeFlushWhole(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	auth, tel := authAndTel(t, c, "large-flush")
	const budget, n = time.Second, 40_000
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
	srv.Do(t, "CLIENT", "PAUSE", "1020")
	start := time.Now()
	failed := p.RefundFinal(rs, n)
	t.Logf("%d adjustments sent in %v, %d failed", n, time.Since(start).Round(time.Millisecond), len(failed))
	if len(failed) > 0 {
		t.Errorf("%d of %d adjustments not sent (first: %v); want all sent, Redis paused for 1.02s", len(failed), n, failed[0].Err)
	}
}
