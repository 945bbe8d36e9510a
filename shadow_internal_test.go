package leaselimit

import (
	"fmt"
	"math"
	"testing"
)

// TestEnforceShareOfKeyShapes: a rollout share means what it says on key
// sets as users name them, sequential and sharing a prefix: within ±0.03
// of the share over 400 sequential keys of the shapes that FNV-1a's top
// bits skewed (0.795 of user:%d enforced at 0.5, 0.975 of key-%d at 0.1,
// none of acct_%06d at 0.5), and over 2000 keys of more shapes. A well-mixed
// digest decides each key like a fair coin, so a set of n keys strays from
// the share by about sqrt(share·(1-share)/n): 0.025 at 0.5 over 400 keys,
// 0.011 over 2000; ±0.03 is a bound for 2000 keys of any shape, and for
// 400 keys only of the shapes measured here.
func TestEnforceShareOfKeyShapes(t *testing.T) {
	sets := map[int][]string{
		400:  {"user:%d", "key-%d", "acct_%06d"},
		2000: {"user:%d", "key-%d", "acct_%06d", "%d", "tenant/%d/api", "10.0.%d"},
	}
	for n, shapes := range sets {
		for _, shape := range shapes {
			for _, share := range []float64{0.1, 0.25, 0.5, 0.9} {
				l := &Limiter{view: view{enforce: share}}
				got := 0
				for i := range n {
					if l.enforced(fmt.Sprintf(shape, i)) {
						got++
					}
				}
				if frac := float64(got) / float64(n); math.Abs(frac-share) > 0.03 {
					t.Errorf("%d keys %q, share %v: enforced %.3f", n, shape, share, frac)
				}
			}
		}
	}
}
