package leaselimit_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// TestCoalescedMiss: concurrent callers of a cold key share script calls,
// and every one of them gets a decision within the limit.
func TestCoalescedMiss(t *testing.T) {
	_, c := newMini(t)
	calls := countCalls(c)
	lim := mustNew(t, c, policy.PerMinute(1000))
	ctx := context.Background()
	const callers = 64
	var wg sync.WaitGroup
	var allowed atomic.Int64
	start := make(chan struct{})
	for i := 0; i < callers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			d, err := lim.Allow(ctx, "cold")
			if err != nil {
				t.Error(err)
				return
			}
			if d.Allowed {
				allowed.Add(1)
			}
		}()
	}
	before := calls.n.Load()
	close(start)
	wg.Wait()
	made := calls.n.Load() - before
	if allowed.Load() != callers {
		t.Errorf("allowed %d of %d under a limit of 1000", allowed.Load(), callers)
	}
	if made >= callers {
		t.Errorf("%d callers made %d Redis commands; misses should be coalesced", callers, made)
	}
	t.Logf("%d concurrent callers of a cold key: %d Redis commands", callers, made)
}

// TestNegativeCache: after Redis denies a key, the Limiter denies it locally
// (SourceCache) without asking Redis until tokens are due.
func TestNegativeCache(t *testing.T) {
	_, c := newMini(t)
	calls := countCalls(c)
	clk := newFakeClock()
	lim := mustNew(t, c, policy.PerMinute(2), leaselimit.WithClock(clk))
	ctx := context.Background()
	for i := 0; i < 2; i++ {
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("Allow #%d = %+v, %v", i, d, err)
		}
	}
	d, err := lim.Allow(ctx, "k")
	if err != nil || d.Allowed || d.Source != leaselimit.SourceAuthority {
		t.Fatalf("third Allow = %+v, %v; want an authority denial", d, err)
	}
	before := calls.n.Load()
	for i := 0; i < 100; i++ {
		d, err := lim.Allow(ctx, "k")
		if err != nil || d.Allowed || d.Source != leaselimit.SourceCache || d.RetryAfter <= 0 {
			t.Fatalf("cached Allow #%d = %+v, %v; want a cache denial", i, d, err)
		}
	}
	if n := calls.n.Load() - before; n != 0 {
		t.Errorf("negatively cached key made %d Redis commands", n)
	}
	// The cache lasts at most DenyCap (1s by default); then Redis is asked again.
	clk.Add(1100 * time.Millisecond)
	if d, _ := lim.Allow(ctx, "k"); d.Source != leaselimit.SourceAuthority {
		t.Errorf("after the cap: source %v; want authority", d.Source)
	}
}

// TestCacheRetryAfter: a negative-cache denial reports when the request can
// next be admitted, not how long the cache entry has left. Regression: with
// PerMinute(10) spent, Allow every 400ms reported 599ms, 199ms, ... (the
// cache's lifetime, capped at 1s) while the next token was 5.6s away; over
// HTTP every 429 after the first said Retry-After: 1.
func TestCacheRetryAfter(t *testing.T) {
	m, c := newMini(t)
	clk := newFakeClock()
	m.SetTime(clk.Now())
	step := func(d time.Duration) {
		clk.Add(d)
		m.SetTime(clk.Now())
	}
	ctx := context.Background()
	lim := mustNew(t, c, policy.PerMinute(10).WithName("retry"), leaselimit.WithClock(clk))
	for i := range 10 {
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("Allow #%d = %+v, %v", i+1, d, err)
		}
	}
	// The bucket is empty; the next token is due 6s after it was full.
	const perToken = 6 * time.Second
	sources := map[leaselimit.Source]int{}
	for elapsed := time.Duration(0); elapsed < perToken-400*time.Millisecond; elapsed += 400 * time.Millisecond {
		d, err := lim.Allow(ctx, "k")
		if err != nil || d.Allowed {
			t.Fatalf("at %v: Allow = %+v, %v; want a denial", elapsed, d, err)
		}
		sources[d.Source]++
		want := perToken - elapsed
		if diff := d.RetryAfter - want; diff < -time.Millisecond || diff > time.Millisecond {
			t.Errorf("at %v: %v denial with RetryAfter %v; the next token is %v away", elapsed, d.Source, d.RetryAfter, want)
		}
		step(400 * time.Millisecond)
	}
	if sources[leaselimit.SourceCache] == 0 {
		t.Errorf("no cache denial among %v", sources)
	}
	// A larger request waits for its larger number of tokens.
	if d, err := lim.AllowN(ctx, "k", 3); err != nil || d.Allowed || d.RetryAfter < 2*perToken {
		t.Errorf("AllowN(3) = %+v, %v; want a denial with RetryAfter >= %v", d, err, 2*perToken)
	}
}

// TestWaitFailsFastOnCache: WaitN whose deadline ends before the next token
// fails at once with ErrWouldExceedDeadline, from a cache denial too.
// Regression: the cache reported its own lifetime (1s), so WaitN slept and
// retried until its context ended instead.
func TestWaitFailsFastOnCache(t *testing.T) {
	m, c := newMini(t)
	clk := newFakeClock()
	m.SetTime(clk.Now())
	ctx := context.Background()
	lim := mustNew(t, c, policy.PerMinute(2).WithName("wait-fast"), leaselimit.WithClock(clk))
	for range 2 {
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("Allow = %+v, %v", d, err)
		}
	}
	if d, err := lim.Allow(ctx, "k"); err != nil || d.Allowed || d.Source != leaselimit.SourceAuthority {
		t.Fatalf("third Allow = %+v, %v; want an authority denial", d, err)
	}
	// The next token is 30s away; the cache is now set for this key.
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err := lim.Wait(wctx, "k")
	if !errors.Is(err, leaselimit.ErrWouldExceedDeadline) {
		t.Fatalf("Wait with a 5s deadline, next token 30s away = %v; want ErrWouldExceedDeadline", err)
	}
}

// TestShortDeadlineLeadsARefill: a caller whose ctx ends before the time
// budget, and who leads its key's lease refill, gets ctx's error at its
// deadline while Redis holds the call, and the refill goes on without it:
// its grant still lands in the lease, whose unused tokens Close gives back,
// so that the bucket is left with exactly what was admitted taken from it.
// Regression (a review): on a client with ContextTimeoutEnabled the refill
// ran on the caller's goroutine, detached from its ctx so that the grant
// would land, and held a 3ms caller for the whole budget.
func TestShortDeadlineLeadsARefill(t *testing.T) {
	srv := redistest.Start(t)
	c := redisClientOpts(t, &redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true,
		ReadTimeout: 2 * leaselimit.MaxTimeout, WriteTimeout: 2 * leaselimit.MaxTimeout})
	// No refill within the test: the bucket's level is the ledger.
	l := policy.Limit{Name: "short-refill", Rate: 1, Period: time.Hour, Burst: 1000}
	lim := newBudgeted(t, c, l, leaselimit.WithTimeout(leaselimit.MaxTimeout))
	ctx := context.Background()
	// A key's first sight is an exact call; its next miss refills a lease.
	if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
		t.Fatalf("first Allow = %+v, %v", d, err)
	}
	unpause := pauseWrites(t, srv) // holds the refill's script
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	type result struct {
		d   leaselimit.Decision
		err error
	}
	got := make(chan result, 1)
	go func() {
		d, err := lim.Allow(short, "k")
		got <- result{d, err}
	}()
	// Well short of the budget (10s), long past the caller's 50ms.
	select {
	case r := <-got:
		if !errors.Is(r.err, context.DeadlineExceeded) {
			t.Errorf("Allow with a 50ms deadline while Redis holds its refill = %+v, %v; want ctx's error", r.d, r.err)
		}
	case <-time.After(5 * time.Second):
		unpause()
		<-got
		t.Fatalf("Allow with a 50ms deadline was still held 5s later by its refill (budget %v)", leaselimit.MaxTimeout)
	}
	unpause()
	// Close waits for the refill, answered now, and gives back what its
	// grant put in the lease: one token admitted, one taken.
	if err := lim.Close(); err != nil {
		t.Fatalf("Close = %v", err)
	}
	peek := newBudgeted(t, c, l, leaselimit.WithoutLease())
	if d, err := peek.Peek(ctx, "k"); err != nil || d.Remaining != l.Burst-1 {
		t.Errorf("Peek after Close = %+v, %v; want %d tokens left (one admitted)", d, err, l.Burst-1)
	}
}

// TestShortDeadlineMissesDuringAPrefetch: a caller whose ctx ends before
// the time budget, and whose key's lease runs dry while a prefetch of it
// is on its way, gets ctx's error at its deadline while Redis holds the
// prefetch; the prefetch's grant still lands in the lease, which Close
// gives back, so that the bucket is left with exactly what was admitted
// taken from it. Regression (a review): the caller took the refill's claim
// (Lead), which the prefetch does not hold, and joined the prefetch's
// singleflight call with Do, which no ctx bounds: with a budget of 1s it
// was held 1s for a deadline of 50ms (the whole budget), on a client with
// ContextTimeoutEnabled and on one with go-redis's defaults.
func TestShortDeadlineMissesDuringAPrefetch(t *testing.T) {
	srv := redistest.Start(t)
	clients := []struct {
		name string
		opts redis.Options
	}{
		{"deadlines honoured", redis.Options{ContextTimeoutEnabled: true,
			ReadTimeout: 2 * leaselimit.MaxTimeout, WriteTimeout: 2 * leaselimit.MaxTimeout}},
		{"go-redis defaults", redis.Options{}},
	}
	for i, cl := range clients {
		t.Run(cl.name, func(t *testing.T) {
			o := cl.opts
			o.Addr = srv.Addr
			c := redisClientOpts(t, &o)
			// No refill within the test: the bucket's level is the ledger.
			// Small leases that prefetch as soon as they are touched.
			l := policy.Limit{Name: fmt.Sprintf("prefetch-short-%d", i), Rate: 1, Period: time.Hour, Burst: 100_000}
			lim := newBudgeted(t, c, l, leaselimit.WithTimeout(leaselimit.MaxTimeout),
				leaselimit.WithLease(policy.Lease{MaxTokens: 16, Prefetch: 0.9}))
			ctx := context.Background()
			admitted := int64(0)
			for range 200 { // the lease grows to its cap
				d, err := lim.Allow(ctx, "k")
				if err != nil || !d.Allowed {
					t.Fatalf("Allow on a healthy Redis = %+v, %v", d, err)
				}
				admitted++
			}
			time.Sleep(100 * time.Millisecond) // the last prefetch lands
			unpause := pauseWrites(t, srv)     // holds the next prefetch's script
			type result struct {
				d    leaselimit.Decision
				err  error
				took time.Duration
			}
			// The first of these starts a prefetch, which Redis holds; the
			// lease runs dry a few callers later, and that caller misses.
			for n := 0; ; n++ {
				if n == 100 {
					t.Fatalf("100 callers admitted from a lease of at most %d tokens while Redis held its refill", 16)
				}
				short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
				got := make(chan result, 1)
				start := time.Now()
				go func() {
					d, err := lim.Allow(short, "k")
					got <- result{d, err, time.Since(start)}
				}()
				var r result
				select {
				case r = <-got:
				case <-time.After(5 * time.Second):
					unpause()
					r = <-got
					cancel()
					t.Fatalf("Allow with a 50ms deadline, its lease dry and a prefetch held by Redis, was still held 5s later (budget %v); it returned %+v, %v after %v",
						leaselimit.MaxTimeout, r.d, r.err, r.took.Round(time.Millisecond))
				}
				cancel()
				if r.err != nil {
					if !errors.Is(r.err, context.DeadlineExceeded) {
						t.Errorf("Allow with a 50ms deadline while Redis holds its refill = %+v, %v; want ctx's error", r.d, r.err)
					}
					break
				}
				if r.d.Allowed {
					admitted++
				}
				// The prefetch's goroutine gets to run and send.
				time.Sleep(10 * time.Millisecond)
			}
			unpause()
			// Close waits for the prefetch, answered now, and gives back
			// what its grant put in the lease.
			if err := lim.Close(); err != nil {
				t.Fatalf("Close = %v", err)
			}
			peek := newBudgeted(t, c, l, leaselimit.WithoutLease())
			if d, err := peek.Peek(ctx, "k"); err != nil || d.Remaining != l.Burst-admitted {
				t.Errorf("Peek after Close = %+v, %v; want %d tokens left (%d admitted)", d, err, l.Burst-admitted, admitted)
			}
		})
	}
}
