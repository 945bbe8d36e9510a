package leaselimit_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/policy"
)

// fakeClock is a Clock moved by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// TestCoalescedMiss: concurrent callers of a cold key share script calls,
// and every one of them gets a decision within the limit.
func TestCoalescedMiss(t *testing.T) {
	m, c := newMini(t)
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
	before := m.CommandCount()
	close(start)
	wg.Wait()
	calls := m.CommandCount() - before
	if allowed.Load() != callers {
		t.Errorf("allowed %d of %d under a limit of 1000", allowed.Load(), callers)
	}
	if calls >= callers {
		t.Errorf("%d callers made %d Redis commands; misses should be coalesced", callers, calls)
	}
	t.Logf("%d concurrent callers of a cold key: %d Redis commands", callers, calls)
}

// TestNegativeCache: after Redis denies a key, the Limiter denies it locally
// (SourceCache) without asking Redis until tokens are due.
func TestNegativeCache(t *testing.T) {
	m, c := newMini(t)
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
	before := m.CommandCount()
	for i := 0; i < 100; i++ {
		d, err := lim.Allow(ctx, "k")
		if err != nil || d.Allowed || d.Source != leaselimit.SourceCache || d.RetryAfter <= 0 {
			t.Fatalf("cached Allow #%d = %+v, %v; want a cache denial", i, d, err)
		}
	}
	if n := m.CommandCount() - before; n != 0 {
		t.Errorf("negatively cached key made %d Redis commands", n)
	}
	// The cache lasts at most DenyCap (1s by default); then Redis is asked again.
	clk.Add(1100 * time.Millisecond)
	if d, _ := lim.Allow(ctx, "k"); d.Source != leaselimit.SourceAuthority {
		t.Errorf("after the cap: source %v; want authority", d.Source)
	}
}

// TestCloseRefunds: tokens leased but not spent go back to Redis on Close.
func TestCloseRefunds(t *testing.T) {
	m, c := newMini(t)
	ctx := context.Background()
	l := policy.PerHour(1000)
	lim, err := leaselimit.New(c, l, leaselimit.WithLease(policy.Lease{MaxShare: 1}))
	if err != nil {
		t.Fatal(err)
	}
	// Build up demand so the lease grows beyond one token.
	spent := 0
	for i := 0; i < 300; i++ {
		d, err := lim.Allow(ctx, "k")
		if err != nil || !d.Allowed {
			t.Fatalf("Allow #%d = %+v, %v", i, d, err)
		}
		spent++
		if i%50 == 0 {
			time.Sleep(5 * time.Millisecond)
		}
	}
	if err := lim.Close(); err != nil {
		t.Fatal(err)
	}
	exact := mustNew(t, c, l, leaselimit.WithoutLease())
	d, err := exact.AllowN(ctx, "k", 1)
	if err != nil {
		t.Fatal(err)
	}
	// Refill in the meantime is at most a few tokens (1000/h).
	if got, want := d.Remaining+1, int64(1000-spent); got < want || got > want+2 {
		t.Errorf("after Close the bucket holds %d; want %d (leased tokens refunded)", got, want)
	}
	_ = m
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

// TestFailLocalReportsShare: a FailLocal decision reports the share that
// decided (Limit, Remaining and ResetAfter of this instance's 1/FleetSize).
// Regression: denials computed ResetAfter from the global limit with the
// local remaining count, and every decision reported the global Limit.
func TestFailLocalReportsShare(t *testing.T) {
	m, c := newMini(t)
	clk := newFakeClock()
	ctx := context.Background()
	l := policy.PerMinute(100).WithName("share")
	lim := mustNew(t, c, l, leaselimit.WithClock(clk),
		leaselimit.WithFailureMode(policy.FailLocal), leaselimit.WithFleetSize(4),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: time.Hour}))
	m.Close() // Redis is down: every decision is FailLocal's
	share := policy.Limit{Name: "share", Rate: 25, Period: time.Minute, Burst: 25}
	for i := int64(0); i <= share.Burst; i++ {
		d, err := lim.Allow(ctx, "k")
		if err != nil || d.Source != leaselimit.SourceFallback {
			t.Fatalf("Allow #%d with Redis down = %+v, %v; want a fallback", i+1, d, err)
		}
		if d.Limit != share {
			t.Fatalf("Allow #%d: Limit %v; want the share %v", i+1, d.Limit, share)
		}
		taken := min(i+1, share.Burst)
		if d.Allowed != (i < share.Burst) || d.Remaining != share.Burst-taken || d.ResetAfter != share.Interval(taken) {
			t.Errorf("Allow #%d = %+v; want allowed=%v, remaining %d, ResetAfter %v (the share's)",
				i+1, d, i < share.Burst, share.Burst-taken, share.Interval(taken))
		}
	}
}

// TestClockForBreakerRetry: under WithClock, a FailClosed denial's
// RetryAfter (until the breaker lets a probe through) is on that clock.
// Regression: the breaker's open-until was on the real clock and the
// decision's "now" on the Limiter's, so with a clock set in January the
// retry-after came out as the months in between.
func TestClockForBreakerRetry(t *testing.T) {
	m, c := newMini(t)
	clk := newFakeClock()
	ctx := context.Background()
	lim := mustNew(t, c, policy.PerMinute(10).WithName("clock"), leaselimit.WithClock(clk), leaselimit.WithoutLease(),
		leaselimit.WithFailureMode(policy.FailClosed),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: time.Hour}))
	m.Close()
	if d, err := lim.Allow(ctx, "k"); err != nil || d.Source != leaselimit.SourceFallback {
		t.Fatalf("Allow with Redis down = %+v, %v", d, err)
	}
	if lim.BreakerState() != breaker.Open {
		t.Fatalf("breaker %v after a failure with Failures 1", lim.BreakerState())
	}
	clk.Add(10 * time.Minute)
	d, err := lim.Allow(ctx, "k")
	if err != nil || d.Allowed || d.Source != leaselimit.SourceFallback {
		t.Fatalf("Allow with the breaker open = %+v, %v", d, err)
	}
	if d.RetryAfter != 50*time.Minute {
		t.Errorf("RetryAfter %v 10 minutes into a 1h open breaker, on the fake clock; want 50m", d.RetryAfter)
	}
}
