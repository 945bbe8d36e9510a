package leaselimit_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
)

// TestColdKeyCostsWhatExactDoes: a key the lease protocol has not seen
// lately is decided by Redis for exactly its n, as in exact mode, and
// allocates no more than exact mode does for it (the issue's "cold keys
// pay nothing for leases"). Regression: the refill's closure captured a
// variable of the miss path, which moved it to the heap on every miss, a
// cold key's included: one allocation more per cold decision.
func TestColdKeyCostsWhatExactDoes(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	perDecision := func(name string, opts ...leaselimit.Option) float64 {
		lim := mustNew(t, srv.Client(t), hotLimit.WithName("cold-allocs-"+name), opts...)
		i := 0
		allocs := testing.AllocsPerRun(2000, func() {
			i++
			d, err := lim.Allow(ctx, name+"-"+strconv.Itoa(i))
			if err != nil || !d.Allowed || d.Source != leaselimit.SourceAuthority {
				t.Fatalf("cold key %d: %+v, %v; want Redis's admission", i, d, err)
			}
		})
		return allocs
	}
	exact := perDecision("exact", leaselimit.WithoutLease())
	leased := perDecision("leases")
	t.Logf("allocations per cold decision: exact mode %.2f, leases %.2f", exact, leased)
	// Half an allocation of room: a decision's count is whole, the
	// average over the runs moves with the GC and the lane's senders.
	if leased > exact+0.5 {
		t.Errorf("a cold key allocates %.2f times per decision with leases, %.2f in exact mode; want no more", leased, exact)
	}
}
