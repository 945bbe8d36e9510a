package authority

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// TestShareFloorExact (regression): acquire.lua used to compute
// math.floor(avail * (share_ppm / 1000000)) in doubles; share_ppm/1e6 is not
// exact for most shares, so the product can land just below an integer and
// the floor loses a token: a full bucket of 100 with share 0.29 grants 28,
// not floor(100·0.29) = 29. The documented bound is
// floor(available*share_ppm/1e6); exact would be
// math.floor(avail * share / 1000000) (avail*share < 2^53 for realistic
// bursts) or an integer formulation.
func TestShareFloorExact(t *testing.T) {
	forEachBackend(t, func(t *testing.T, nb backendFactory) {
		ctx := context.Background()
		for _, c := range []struct {
			burst int64
			share float64
			want  int64 // floor(burst * ppm / 1e6) in integers
		}{
			{100, 0.29, 29}, // Lua: 100 * (290000/1e6) = 28.999999999999996
			{100, 0.57, 57},
			{90, 0.7, 63},
			{625, 0.0048, 3},
		} {
			l := policy.Limit{Name: "share", Rate: 1, Period: time.Hour, Burst: c.burst}
			b := nb(t)
			r := b.newAuthority(t, testPrefix)
			g, err := r.Acquire(ctx, r.Key(l, "k"), l, c.burst, 1, c.share)
			if err != nil {
				t.Fatal(err)
			}
			if want := shareOf(c.burst, ppmOf(c.share)); want != c.want {
				t.Fatalf("test table: exact share of %d at %v is %d, not %d", c.burst, c.share, want, c.want)
			}
			if g.Granted != c.want {
				t.Errorf("full bucket of %d, Acquire(want=%d,min=1,share=%v) granted %d; want floor(%d*%d/1e6) = %d",
					c.burst, c.burst, c.share, g.Granted, c.burst, ppmOf(c.share), c.want)
			}
		}
	})
}

// TestShareHugeMeansNoCap: Acquire converts share with int64(share*1e6)
// before clamping. For share*1e6 beyond the int64 range (share >= ~9.3e12,
// +Inf) the conversion is implementation-defined; on amd64 it yields
// math.MinInt64, which is then clamped to 1 ppm, so a huge share grants min
// while share 2 grants as much as share 1.
func TestShareHugeMeansNoCap(t *testing.T) {
	ctx := context.Background()
	l := policy.Limit{Name: "s", Rate: 10, Period: time.Second, Burst: 100}
	for _, share := range []float64{1e13, 1e19, math.Inf(1)} {
		b := newMiniBackend(t)
		r := b.newAuthority(t, testPrefix)
		g, err := r.Acquire(ctx, r.Key(l, "k"), l, 50, 2, share)
		if err != nil {
			t.Fatal(err)
		}
		if g.Granted != 50 {
			t.Errorf("Acquire(want=50,min=2,share=%v) on a full bucket of 100 granted %d; want 50 (as for share 2)", share, g.Granted)
		}
	}
}
