package leaselimit_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/policy"
)

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
// RetryAfter (until the breaker lets a probe through) is on that clock, and
// the open breaker holds Peek and Reset back too.
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
	// On a loaded machine the waiter may find this process behind and wait
	// out the call past the fallback (reason "saturated"): the breaker then
	// learns the failure when the call itself ends, at most a few budgets
	// later.
	for deadline := time.Now().Add(5 * time.Second); lim.BreakerState() != breaker.Open; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("breaker %v after a failure with Failures 1", lim.BreakerState())
		}
	}
	clk.Add(10 * time.Minute)
	d, err := lim.Allow(ctx, "k")
	if err != nil || d.Allowed || d.Source != leaselimit.SourceFallback {
		t.Fatalf("Allow with the breaker open = %+v, %v", d, err)
	}
	if d.RetryAfter != 50*time.Minute {
		t.Errorf("RetryAfter %v 10 minutes into a 1h open breaker, on the fake clock; want 50m", d.RetryAfter)
	}
	// Peek and Reset are held back as decisions are, on the same clock.
	if _, err := lim.Peek(ctx, "k"); !errors.Is(err, breaker.ErrOpen) {
		t.Errorf("Peek with the breaker open = %v; want it held back (breaker.ErrOpen)", err)
	}
	if err := lim.Reset(ctx, "k"); !errors.Is(err, breaker.ErrOpen) {
		t.Errorf("Reset with the breaker open = %v; want it held back (breaker.ErrOpen)", err)
	}
}
