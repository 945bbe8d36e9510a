package leaselimit_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
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
