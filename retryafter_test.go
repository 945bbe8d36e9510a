package leaselimit_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
)

// within reports whether got is want to the millisecond.
func within(got, want time.Duration) bool {
	return got >= want-time.Millisecond && got <= want+time.Millisecond
}

// TestCachedQuotaRetryAfterIsItsBoundary: after Redis denies a spent
// calendar quota, a larger request denied from the negative cache waits
// for the quota's boundary, as the one Redis denied does: a quota's tokens
// come back all at once. Regression (issue 24, item 5): the cache added
// the refill time of the extra tokens at Period/Rate a token, so AllowN(5)
// on 10 a day said 13h33m with midnight 3h57m away, and on 10 an hour 38m
// with the hour ending in 14m.
func TestCachedQuotaRetryAfterIsItsBoundary(t *testing.T) {
	for _, tc := range []struct {
		name  string
		every policy.CalendarUnit
		left  time.Duration // until the window ends
	}{
		{"day", policy.Day, 3*time.Hour + 57*time.Minute},
		{"hour", policy.Hour, 14 * time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, c := newMini(t)
			ctx := context.Background()
			quota := policy.Quota("retry-"+tc.name, 10, tc.every, nil)
			end, _ := quota.Calendar.Window(time.Now())
			m.SetTime(end.Add(-tc.left))
			lim := mustNew(t, c, quota, leaselimit.WithClock(newFakeClock()))
			for i := range 10 {
				if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
					t.Fatalf("Allow #%d = %+v, %v", i+1, d, err)
				}
			}
			d, err := lim.Allow(ctx, "k")
			if err != nil || d.Allowed || d.Source != leaselimit.SourceAuthority || !within(d.RetryAfter, tc.left) {
				t.Fatalf("11th Allow = %+v, %v; want an authority denial until the boundary, %v", d, err, tc.left)
			}
			d, err = lim.AllowN(ctx, "k", 5)
			if err != nil || d.Allowed || d.Source != leaselimit.SourceCache {
				t.Fatalf("AllowN(5) = %+v, %v; want a cache denial", d, err)
			}
			if !within(d.RetryAfter, tc.left) {
				t.Errorf("AllowN(5) from the cache: RetryAfter %v; want the boundary, %v away", d.RetryAfter, tc.left)
			}
		})
	}
}

// TestCachedMultiLimitRetryAfterByMember: after Redis denies a multi-limit
// because its fast bucket is empty, a larger request denied from the
// negative cache waits for that bucket's own refill of its tokens, not
// the envelope's (the slowest member's) refill. Regression (issue 24,
// item 5): For(1/s burst 5, 100/h) AllowN(3) said 1m13s (1s + 2 × 36s)
// where 3s is right, so WaitN with an 8s deadline failed at once.
func TestCachedMultiLimitRetryAfterByMember(t *testing.T) {
	mostlyWaits(t)
	perSecond := policy.Limit{Name: "retry-ps", Rate: 1, Period: time.Second, Burst: 5}
	perHour := policy.PerHour(100).WithName("retry-ph")
	ctx := context.Background()
	// spend empties the per-second bucket and has Redis deny one more.
	spend := func(t *testing.T, lim *leaselimit.Limiter) {
		t.Helper()
		for i := range 5 {
			if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
				t.Fatalf("Allow #%d = %+v, %v", i+1, d, err)
			}
		}
		if d, err := lim.Allow(ctx, "k"); err != nil || d.Allowed || d.Source != leaselimit.SourceAuthority || d.Limit.Name != perSecond.Name {
			t.Fatalf("6th Allow = %+v, %v; want an authority denial by %s", d, err, perSecond.Name)
		}
	}

	t.Run("AllowN", func(t *testing.T) {
		m, c := newMini(t)
		clk := newFakeClock()
		m.SetTime(clk.Now())
		root := mustNew(t, c, perSecond, leaselimit.WithClock(clk))
		lim := root.For(perSecond, perHour)
		spend(t, lim)
		d, err := lim.AllowN(ctx, "k", 3)
		if err != nil || d.Allowed || d.Source != leaselimit.SourceCache {
			t.Fatalf("AllowN(3) = %+v, %v; want a cache denial", d, err)
		}
		if !within(d.RetryAfter, 3*time.Second) {
			t.Errorf("AllowN(3) from the cache: RetryAfter %v; want 3s, when the 1/s bucket holds 3 (100/h holds 95)", d.RetryAfter)
		}
	})

	// On the real clock: WaitN with a deadline the per-second bucket can
	// meet waits and is admitted, rather than failing at once.
	t.Run("WaitN", func(t *testing.T) {
		_, c := newMini(t)
		root := mustNew(t, c, perSecond)
		lim := root.For(perSecond, perHour)
		spend(t, lim)
		wctx, cancel := context.WithTimeout(ctx, 8*time.Second)
		defer cancel()
		if err := lim.WaitN(wctx, "k", 3); err != nil {
			if errors.Is(err, leaselimit.ErrWouldExceedDeadline) {
				t.Fatalf("WaitN(3) with an 8s deadline, 3 tokens of 1/s due in 3s = %v", err)
			}
			t.Fatalf("WaitN(3) = %v", err)
		}
	})
}
