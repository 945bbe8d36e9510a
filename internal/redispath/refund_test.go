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
// 20,000 adjustments, a budget of 1s (refundBudget 2s) and Redis paused
// for 1.1s (CLIENT PAUSE), on a client that honours deadlines. Regression (a
// review): finalWait cut the send at 1s, and Close dropped them all (with
// Redis healthy, 93,000 adjustments owed after an outage on 128,000 keys).
func TestCloseSendsALargeFlushWhole(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	auth, tel := authAndTel(t, c, "large-flush")
	const budget, n = time.Second, 20_000
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
	srv.Do(t, "CLIENT", "PAUSE", "1100")
	if failed := p.RefundFinal(rs, n); len(failed) > 0 {
		t.Errorf("%d of %d adjustments not sent (first: %v); want all sent, Redis paused for 1.1s", len(failed), n, failed[0].Err)
	}
}
