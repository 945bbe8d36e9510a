package leaselimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// TestSameNameOtherLimit: two limits that share a Name but not their
// rate, period or burst never read each other's bucket. Regression:
// PerSecond(10) and PerMinute(100), both named "default", used one Redis
// key whose state is in units of the period, so after one PerSecond call
// PerMinute admitted 0 of its 100.
func TestSameNameOtherLimit(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	c := srv.Client(t)
	for _, pair := range [][2]policy.Limit{
		{policy.PerSecond(10), policy.PerMinute(100)},
		{policy.PerMinute(100), policy.PerMinute(100).WithBurst(5)},
		{policy.PerMinute(5), policy.PerHour(100)},
	} {
		first, second := pair[0], pair[1]
		t.Run(first.String()+" then "+second.String(), func(t *testing.T) {
			key := "user-" + first.String() + second.String()
			a := mustNew(t, c, first, leaselimit.WithoutLease())
			b := mustNew(t, c, second, leaselimit.WithoutLease())
			start := time.Now()
			if d, err := a.Allow(ctx, key); err != nil || !d.Allowed {
				t.Fatalf("first limit: Allow = %+v, %v", d, err)
			}
			// The second limit sees a full bucket of its own: exactly
			// its burst is admitted, then a denial.
			for i := int64(0); i < second.Burst; i++ {
				d, err := b.Allow(ctx, key)
				if err != nil || !d.Allowed {
					t.Fatalf("second limit: Allow #%d of its burst %d = %+v, %v", i+1, second.Burst, d, err)
				}
			}
			if d, err := b.Allow(ctx, key); err != nil || d.Allowed {
				t.Fatalf("second limit: Allow past its burst = %+v, %v; want a denial", d, err)
			}
			// And the first limit's bucket is as it left it, burst - 1, but
			// for what it refilled meanwhile (10/s refills a token every
			// 100ms, which a loaded machine may take for the second's
			// burst): after this call, burst - 2 and at most that much more.
			d, err := a.Allow(ctx, key)
			refilled := int64(time.Since(start) / first.Interval(1))
			if err != nil || !d.Allowed || d.Remaining < first.Burst-2 || d.Remaining > min(first.Burst-2+refilled, first.Burst-1) {
				t.Fatalf("first limit after the second's burst: Allow = %+v, %v; want allowed with %d remaining (%d more for the %d tokens it may have refilled)",
					d, err, first.Burst-2, min(refilled, 1), refilled)
			}
		})
	}
}
