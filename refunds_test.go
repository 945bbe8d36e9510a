package leaselimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
)

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
