package leaselimit_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// peekRemaining returns Peek's Remaining for key, failing the test on error.
func peekRemaining(t *testing.T, lim *leaselimit.Limiter, key string) int64 {
	t.Helper()
	d, err := lim.Peek(context.Background(), key)
	if err != nil {
		t.Fatalf("Peek(%q): %v", key, err)
	}
	return d.Remaining
}

// TestReserveSettle: in exact mode on a real redis-server, a settled
// reservation refunds its surplus and charges its excess into debt, once,
// whoever calls Settle and however often; Cancel refunds everything.
func TestReserveSettle(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	l := policy.Limit{Name: "llm", Rate: 100, Period: time.Hour, Burst: 100}
	lim := mustNew(t, srv.Client(t), l, leaselimit.WithoutLease())

	r, err := lim.Reserve(ctx, "tenant", 10)
	if err != nil || !r.Decision().Allowed || r.Decision().Remaining != 90 {
		t.Fatalf("Reserve(10) = %+v, %v", r, err)
	}
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.Settle(ctx, 4); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if got := peekRemaining(t, lim, "tenant"); got != 96 {
		t.Errorf("after Settle(4) of 10 (8 times, concurrently): %d left; want 96", got)
	}
	if err := r.Cancel(ctx); err != nil || peekRemaining(t, lim, "tenant") != 96 {
		t.Errorf("Cancel after Settle changed the bucket (err %v)", err)
	}

	c, err := lim.Reserve(ctx, "tenant", 20)
	if err != nil || !c.Decision().Allowed {
		t.Fatalf("Reserve(20) = %+v, %v", c, err)
	}
	if err := c.Cancel(ctx); err != nil || peekRemaining(t, lim, "tenant") != 96 {
		t.Errorf("Cancel did not give the whole estimate back (err %v)", err)
	}

	// An excess past empty: 96 - 10 - 140 = -54, the bucket in debt.
	x, err := lim.Reserve(ctx, "tenant", 10)
	if err != nil || !x.Decision().Allowed {
		t.Fatalf("Reserve(10) = %+v, %v", x, err)
	}
	if err := x.Settle(ctx, 150); err != nil {
		t.Fatal(err)
	}
	p, err := lim.Peek(ctx, "tenant")
	if err != nil {
		t.Fatal(err)
	}
	// 55 tokens (the debt of 54, then one) at 36s each: 33 minutes.
	if p.Allowed || p.Remaining != 0 || p.RetryAfter < 32*time.Minute || p.RetryAfter > 33*time.Minute {
		t.Errorf("Peek of a bucket 54 in debt = %+v; want denied, retry after about 33m", p)
	}
	if d, err := lim.Allow(ctx, "tenant"); err != nil || d.Allowed || d.RetryAfter < 32*time.Minute {
		t.Errorf("Allow on a bucket in debt = %+v, %v; want denied until the debt is paid", d, err)
	}

	// A charge beyond one burst of debt is forgiven.
	y, err := lim.Reserve(ctx, "other", 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := y.Settle(ctx, 10_000); err != nil {
		t.Fatal(err)
	}
	// 101 tokens (a debt of one burst, 100, then one) at 36s each.
	if d, _ := lim.Peek(ctx, "other"); d.RetryAfter > time.Hour+time.Minute || d.RetryAfter < time.Hour {
		t.Errorf("retry after a huge charge = %v; want about 1h0m36s (one burst of debt, then one token)", d.RetryAfter)
	}

	if err := x.Settle(ctx, -1); !errors.Is(err, leaselimit.ErrInvalidCost) {
		t.Errorf("Settle(-1) = %v; want ErrInvalidCost", err)
	}
}

// TestReserveDenied: a denied reservation took nothing and settling it
// changes nothing.
func TestReserveDenied(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	lim := mustNew(t, srv.Client(t), policy.Limit{Name: "small", Rate: 1, Period: time.Hour, Burst: 5}, leaselimit.WithoutLease())
	if _, err := lim.AllowN(ctx, "k", 4); err != nil {
		t.Fatal(err)
	}
	r, err := lim.Reserve(ctx, "k", 3)
	if err != nil || r.Decision().Allowed {
		t.Fatalf("Reserve(3) with 1 left = %+v, %v; want denied", r, err)
	}
	if err := r.Settle(ctx, 0); err != nil || peekRemaining(t, lim, "k") != 1 {
		t.Errorf("settling a denied reservation changed the bucket (err %v)", err)
	}
}

// TestReserveSettleLease: in lease mode the surplus joins this instance's
// lease and the excess comes out of it, with no Redis call.
func TestReserveSettleLease(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	l := policy.Limit{Name: "llm-lease", Rate: 1_000_000, Period: time.Hour, Burst: 1_000_000}
	lim := mustNew(t, srv.Client(t), l)
	// Make the key busy, so that it holds a lease.
	for i := 0; i < 5000; i++ {
		if _, err := lim.Allow(ctx, "k"); err != nil {
			t.Fatal(err)
		}
	}
	r, err := lim.Reserve(ctx, "k", 50)
	if err != nil || !r.Decision().Allowed || r.Decision().Source != leaselimit.SourceLease {
		t.Fatalf("Reserve(50) on a busy key = %+v, %v; want a lease decision", r.Decision(), err)
	}
	before := srv.Stats(t)
	if err := r.Settle(ctx, 20); err != nil {
		t.Fatal(err)
	}
	s, err := lim.Reserve(ctx, "k", 10)
	if err != nil || !s.Decision().Allowed {
		t.Fatal(s.Decision(), err)
	}
	if err := s.Settle(ctx, 15); err != nil {
		t.Fatal(err)
	}
	if calls := srv.Stats(t).Sub(before).Calls["evalsha"]; calls != 0 {
		t.Errorf("settling against a live lease made %d script calls; want 0", calls)
	}
}

// TestSettleWhileRedisIsDown: a settlement made while Redis cannot be
// reached is queued and applied once it is back; one made after Close is
// applied at once.
func TestSettleWhileRedisIsDown(t *testing.T) {
	m, c := newMini(t)
	ctx := context.Background()
	l := policy.Limit{Name: "queued", Rate: 1, Period: time.Hour, Burst: 100}
	lim := mustNew(t, c, l, leaselimit.WithoutLease(), leaselimit.WithTimeout(200*time.Millisecond),
		leaselimit.WithBreaker(breaker.Settings{OpenFor: 50 * time.Millisecond}))
	r, err := lim.Reserve(ctx, "k", 30)
	if err != nil || !r.Decision().Allowed {
		t.Fatal(r, err)
	}
	m.SetError("LOADING Redis is loading the dataset in memory")
	owed := int64(0) // FailOpen's admissions, charged once Redis is back
	for i := 0; i < 10; i++ {
		if d, _ := lim.Allow(ctx, "k"); d.Allowed && d.Source == leaselimit.SourceFallback { // opens the breaker
			owed++
		}
	}
	if err := r.Settle(ctx, 10); err != nil {
		t.Fatalf("Settle while Redis is down = %v; want nil (queued)", err)
	}
	m.SetError("")
	deadline := time.Now().Add(10 * time.Second)
	for {
		d, err := lim.Peek(ctx, "k")
		if err == nil && d.Remaining == 90-owed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the queued settlement never arrived: Peek = %+v, %v; want %d left (100 − 10 settled − %d admitted by the policy)", d, err, 90-owed, owed)
		}
		time.Sleep(20 * time.Millisecond)
	}

	after, err := lim.Reserve(ctx, "k", 40)
	if err != nil || !after.Decision().Allowed {
		t.Fatal(after, err)
	}
	if err := lim.Close(); err != nil {
		t.Fatal(err)
	}
	if err := after.Settle(ctx, 0); err != nil {
		t.Fatalf("Settle after Close = %v", err)
	}
	other := mustNew(t, c, l, leaselimit.WithoutLease())
	if got := peekRemaining(t, other, "k"); got != 90-owed {
		t.Errorf("after Close and Settle(0) of 40: %d left; want %d", got, 90-owed)
	}
}

// TestReserveAboveBurst: an estimate above the Burst takes a whole Burst
// (no request can take more) and Settle charges the rest, into debt of at
// most one Burst; a multi-limit clamps to its least Burst.
// Regression: it was ErrInvalidCost, a 500 where a caller wanted a request
// admitted and paid for.
func TestReserveAboveBurst(t *testing.T) {
	_, c := newMini(t)
	ctx := context.Background()
	l := policy.Limit{Name: "above", Rate: 1, Period: time.Hour, Burst: 10}
	lim := mustNew(t, c, l, leaselimit.WithoutLease())
	r, err := lim.Reserve(ctx, "k", 25)
	if err != nil || !r.Decision().Allowed || r.Decision().Remaining != 0 {
		t.Fatalf("Reserve(25) of a full bucket of 10 = %+v, %v; want admitted, the whole burst taken", r, err)
	}
	if err := r.Settle(ctx, 14); err != nil {
		t.Fatal(err)
	}
	d, err := lim.Peek(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if got := bucketLevel(d, l); got != -4 {
		t.Errorf("after Settle(14) of a Reserve(25) that took 10: the bucket holds %d; want -4 (in debt)", got)
	}
	if r2, err := lim.Reserve(ctx, "k", 25); err != nil || r2.Decision().Allowed {
		t.Errorf("Reserve(25) of a bucket in debt = %+v, %v; want a denial", r2, err)
	}

	small := policy.Limit{Name: "above-small", Rate: 1, Period: time.Hour, Burst: 4}
	r3, err := lim.For(l, small).Reserve(ctx, "m", 25)
	if err != nil || !r3.Decision().Allowed {
		t.Fatalf("multi-limit Reserve(25) = %+v, %v; want admitted at its least Burst", r3, err)
	}
	if err := r3.Cancel(ctx); err != nil {
		t.Fatal(err)
	}
	for _, x := range []policy.Limit{l, small} {
		d, err := lim.For(x).Peek(ctx, "m")
		if err != nil || d.Remaining != x.Burst {
			t.Errorf("%s after Cancel of a clamped reservation: %+v, %v; want %d left", x.Name, d, err, x.Burst)
		}
	}
}

// TestOldExcessNotChargedToFreshLease: a reservation taken before a Reset
// and settled above its estimate after it is not charged to the fresh
// bucket (docs/semantics.md), even when this instance holds a lease of the
// fresh bucket to pay it from. On a real redis-server. Regression: the
// excess came out of that lease, 20 of the fresh bucket's tokens.
func TestOldExcessNotChargedToFreshLease(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	limit := policy.Limit{Name: "old-excess", Rate: 1, Period: 24 * time.Hour, Burst: 10_000}
	c, err := leaselimit.NewClient(srv.Client(t), leaselimit.WithTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	lim := c.Limiter(limit)
	for range 3 { // a first sight is exact; then a lease
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("Allow = %+v, %v", d, err)
		}
	}
	res, err := lim.Reserve(ctx, "k", 10)
	if err != nil || !res.Decision().Allowed {
		t.Fatalf("Reserve(10) = %+v, %v", res.Decision(), err)
	}
	if err := lim.Reset(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	admitted, leased := int64(0), 0
	for range 300 { // the fresh bucket's, through a lease of it
		d, err := lim.Allow(ctx, "k")
		if err != nil || !d.Allowed {
			t.Fatalf("Allow = %+v, %v", d, err)
		}
		admitted++
		if d.Source == leaselimit.SourceLease {
			leased++
		}
	}
	if leased == 0 {
		t.Fatal("no lease of the fresh bucket: nothing to pay the excess from")
	}
	if err := res.Settle(ctx, 30); err != nil { // 20 over the estimate, of the old generation
		t.Fatal(err)
	}
	if err := c.Close(); err != nil { // the lease goes back to the fresh bucket
		t.Fatal(err)
	}
	if got, want := bucketHolds(t, srv.Client(t), limit, "k"), limit.Burst-admitted; got != want {
		t.Errorf("the fresh bucket holds %d after %d admitted in its generation; want %d (the old reservation's excess is not its to pay)", got, admitted, want)
	}
}

// bucketHolds is what key's bucket under limit holds, read through a
// Client of its own that leases nothing.
func bucketHolds(t *testing.T, rdb redis.UniversalClient, limit policy.Limit, key string) int64 {
	t.Helper()
	check, err := leaselimit.NewClient(rdb, leaselimit.WithoutLease())
	if err != nil {
		t.Fatal(err)
	}
	defer check.Close()
	return peekRemaining(t, check.Limiter(limit), key)
}

// TestCancelAfterResetGoesBack: after a Reset, a reservation on a key this
// instance holds no lease of gives its tokens back on Cancel, on the
// instance that reset the key and on another alike: they came from the
// fresh bucket. On a real redis-server. Regression: a lease made for the
// reservation left its tokens' generation unknown, and the refund was
// dropped for the day the Reset's mark lives (9990 of 10,000, and 9989
// of 9,999).
func TestCancelAfterResetGoesBack(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	limit := policy.Limit{Name: "cancel-after-reset", Rate: 1, Period: 24 * time.Hour, Burst: 10_000}
	reserveAndCancel := func(lim *leaselimit.Limiter, key string) {
		t.Helper()
		res, err := lim.Reserve(ctx, key, 10)
		if err != nil || !res.Decision().Allowed {
			t.Fatalf("Reserve(10) = %+v, %v", res.Decision(), err)
		}
		if err := res.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
	}
	newClient := func() *leaselimit.Client {
		c, err := leaselimit.NewClient(srv.Client(t), leaselimit.WithTimeout(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}

	// One instance: Allow, Reset, Reserve, Cancel.
	a := newClient()
	lim := a.Limiter(limit)
	if d, err := lim.Allow(ctx, "same"); err != nil || !d.Allowed {
		t.Fatalf("Allow = %+v, %v", d, err)
	}
	if err := lim.Reset(ctx, "same"); err != nil {
		t.Fatal(err)
	}
	reserveAndCancel(lim, "same")

	// Another instance, after the first reset the key.
	if err := lim.Reset(ctx, "other"); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	b := newClient()
	other := b.Limiter(limit)
	if d, err := other.Allow(ctx, "other"); err != nil || !d.Allowed {
		t.Fatalf("Allow = %+v, %v", d, err)
	}
	reserveAndCancel(other, "other")
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}

	if got := bucketHolds(t, srv.Client(t), limit, "same"); got != limit.Burst {
		t.Errorf("Allow, Reset, Reserve(10), Cancel on one instance: the bucket holds %d; want %d", got, limit.Burst)
	}
	if got := bucketHolds(t, srv.Client(t), limit, "other"); got != limit.Burst-1 {
		t.Errorf("Reset on one instance, then Allow, Reserve(10), Cancel on another: the bucket holds %d; want %d", got, limit.Burst-1)
	}
}

// TestShortDeadlineSettles: a Settle whose ctx ends before the time
// budget, made while Redis holds its adjustment, returns about its
// deadline, and the adjustment still lands: a surplus goes back, an excess
// is charged, to every limit's bucket. Regression (a review): Settle ran
// its adjustment on a ctx detached from the caller's, deadline and all,
// and waited for it: with a budget of 1s a caller with a 50ms deadline
// was held 1s for one limit and 2s for two (a budget per limit), on a
// client with ContextTimeoutEnabled and on one with go-redis's defaults.
func TestShortDeadlineSettles(t *testing.T) {
	srv := redistest.Start(t)
	clients := []struct {
		name string
		opts redis.Options
	}{
		{"deadlines honoured", redis.Options{ContextTimeoutEnabled: true,
			ReadTimeout: 2 * leaselimit.MaxTimeout, WriteTimeout: 2 * leaselimit.MaxTimeout}},
		{"go-redis defaults", redis.Options{}},
	}
	limits := []policy.Limit{
		{Name: "settle-short-a", Rate: 1, Period: time.Hour, Burst: 1000},
		{Name: "settle-short-b", Rate: 1, Period: time.Hour, Burst: 2000},
	}
	for _, cl := range clients {
		for _, n := range []int{1, 2} {
			for _, actual := range []int64{1, 9} { // of an estimate of 5: a surplus, an excess
				t.Run(fmt.Sprintf("%s/%d limits/actual %d", cl.name, n, actual), func(t *testing.T) {
					o := cl.opts
					o.Addr = srv.Addr
					c := redisClientOpts(t, &o)
					prefix := fmt.Sprintf("settle-short-%d-%d-%v", n, actual, o.ContextTimeoutEnabled)
					client := mustClient(t, c, leaselimit.WithTimeout(leaselimit.MaxTimeout), leaselimit.WithoutLease(),
						leaselimit.WithPrefix(prefix))
					lim := client.Limiter(limits[0], limits[1:n]...)
					ctx := context.Background()
					r, err := lim.Reserve(ctx, "k", 5)
					if err != nil || !r.Decision().Allowed {
						t.Fatalf("Reserve on a healthy Redis = %+v, %v", r.Decision(), err)
					}
					unpause := pauseWrites(t, srv) // holds the adjustment's script
					short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
					defer cancel()
					got := make(chan error, 1)
					start := time.Now()
					go func() { got <- r.Settle(short, actual) }()
					select {
					case err := <-got:
						if err != nil {
							t.Errorf("Settle with a 50ms deadline while Redis holds its adjustment = %v; want nil (it carries on)", err)
						}
					case <-time.After(5 * time.Second):
						unpause()
						err := <-got
						t.Fatalf("Settle with a 50ms deadline was still held 5s later (budget %v); it returned %v after %v",
							leaselimit.MaxTimeout, err, time.Since(start).Round(time.Millisecond))
					}
					unpause()
					// Close waits for the adjustment, answered now (or
					// queued, then sent at Close).
					if err := client.Close(); err != nil {
						t.Fatalf("Close = %v", err)
					}
					peek := mustClient(t, c, leaselimit.WithoutLease(), leaselimit.WithPrefix(prefix))
					for _, l := range limits[:n] {
						if got := peekRemaining(t, peek.Limiter(l), "k"); got != l.Burst-actual {
							t.Errorf("%s after Close: %d left; want %d (settled at %d)", l.Name, got, l.Burst-actual, actual)
						}
					}
				})
			}
		}
	}
}

// TestSettleAfterMarkLife: a Reservation settled later than a reset
// mark's life (authority.MarkLife) after its grant, across a Reset of its
// key, gives nothing back to the fresh bucket: the Reset's mark is gone by
// then, and the surplus is dropped as tokens of an older generation may
// be. Regression: the surplus went to the fresh bucket, past the bound
// (the mark then lived a day).
func TestSettleAfterMarkLife(t *testing.T) {
	m, c := newMini(t)
	ctx := context.Background()
	m.SetTime(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC))
	l := policy.Limit{Name: "mark-life", Rate: 1, Period: 365 * 24 * time.Hour, Burst: 100} // no whole token in the test's week
	lim := mustNew(t, c, l, leaselimit.WithoutLease())
	r, err := lim.Reserve(ctx, "k", 10)
	if err != nil || !r.Decision().Allowed {
		t.Fatalf("Reserve(10) = %+v, %v", r.Decision(), err)
	}
	if err := lim.Reset(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	if d, err := lim.AllowN(ctx, "k", 50); err != nil || !d.Allowed {
		t.Fatalf("AllowN(50) of the fresh bucket = %+v, %v", d, err)
	}
	later := authority.MarkLife + time.Hour
	m.FastForward(later) // the mark expires
	m.SetTime(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC).Add(later))
	if err := r.Settle(ctx, 2); err != nil {
		t.Fatalf("Settle(2) a week later: %v", err)
	}
	if d, err := lim.Peek(ctx, "k"); err != nil || d.Remaining != 50 {
		t.Errorf("the fresh bucket after an old reservation's surplus of 8: %+v, %v; want 50 left (dropped)", d, err)
	}
}
