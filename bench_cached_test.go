package leaselimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
)

// BenchmarkAllowCachedDenial measures a key far over its limit, denied
// from the negative cache, from b.RunParallel goroutines (one Limiter,
// miniredis behind it): the path a flood from one abusive key takes.
func BenchmarkAllowCachedDenial(b *testing.B) {
	_, c := newMiniTB(b)
	lim, err := leaselimit.New(c, policy.Limit{Name: "cached", Rate: 1, Period: time.Hour, Burst: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer lim.Close()
	ctx := context.Background()
	for range 3 {
		if _, err := lim.Allow(ctx, "k"); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if d, err := lim.Allow(ctx, "k"); err != nil || d.Allowed {
				b.Errorf("Allow = %+v, %v; want a denial", d, err)
				return
			}
		}
	})
}
