package leaselimit_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// TestKeyEarnsLeaseWhenItRepeats: on a real redis-server, keys seen once
// are decided exactly and leave no local state; a key that comes back
// gets an entry and, as it keeps coming, decisions from its lease.
func TestKeyEarnsLeaseWhenItRepeats(t *testing.T) {
	srv := redistest.Start(t)
	c, err := leaselimit.NewClient(redisClient(t, srv.Addr))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	lim := c.Limiter(policy.PerSecond(1_000_000).WithName("earn"))
	ctx := context.Background()
	allow := func(key string) leaselimit.Decision {
		t.Helper()
		d, err := lim.Allow(ctx, key)
		if err != nil || !d.Allowed {
			t.Fatalf("Allow(%s) = %+v, %v", key, d, err)
		}
		return d
	}
	for i := range 1000 {
		if d := allow("once-" + strconv.Itoa(i)); d.Source != leaselimit.SourceAuthority {
			t.Fatalf("first decision of a key from %v; want the authority", d.Source)
		}
	}
	if n := c.LocalKeys(); n != 0 {
		t.Fatalf("%d keys with local state after 1000 keys seen once; want 0", n)
	}
	allow("again")
	if n := c.LocalKeys(); n != 0 {
		t.Fatalf("%d keys with local state after a first sight; want 0", n)
	}
	var sources [4]int
	for range 200 {
		sources[allow("again").Source]++
	}
	if n := c.LocalKeys(); n != 1 {
		t.Errorf("%d keys with local state once a key repeats; want 1", n)
	}
	if sources[leaselimit.SourceLease] == 0 {
		t.Errorf("200 more decisions of a repeated key by source %v; want some from its lease", sources)
	}
}
