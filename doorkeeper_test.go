package leaselimit_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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

// TestFullTableAccountsEveryToken: on a real redis-server, two Clients
// with a table of one key per shard (WithMaxKeys(64)) share 200 keys of a
// bucket that does not refill within the test, their callers each asking
// for a key one to three times in a row, in tight loops: keys evict each
// other, or are declined while another's lease is live (see
// lease's table.Admit). After Close gives the leases back, an exact
// Limiter drains every key: what the fleet admitted and what is left add
// up to each key's burst, to the token.
func TestFullTableAccountsEveryToken(t *testing.T) {
	const keys, workers, ops, burst = 200, 8, 2500, 50
	srv := redistest.Start(t)
	limit := policy.Limit{Name: "full-table", Rate: 1, Period: time.Hour, Burst: burst}
	admitted := make([]atomic.Int64, keys)
	var wg sync.WaitGroup
	var fleet []*leaselimit.Client
	for range 2 {
		c, err := leaselimit.NewClient(redisClient(t, srv.Addr), leaselimit.WithMaxKeys(64), leaselimit.WithTimeout(10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		fleet = append(fleet, c)
		lim := c.Limiter(limit)
		for w := range workers {
			rng := rand.New(rand.NewPCG(uint64(len(fleet)), uint64(w)))
			wg.Go(func() {
				for i := 0; i < ops; {
					k := rng.IntN(keys)
					for range 1 + rng.IntN(3) {
						d, err := lim.Allow(context.Background(), "k"+strconv.Itoa(k))
						if err != nil {
							t.Error(err)
							return
						}
						if d.Allowed {
							admitted[k].Add(1)
						}
						i++
					}
				}
			})
		}
	}
	wg.Wait()
	for _, c := range fleet {
		if n := c.LocalKeys(); n > 64 {
			t.Errorf("a Client holds %d keys; WithMaxKeys(64)", n)
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}
	drain := mustNew(t, redisClient(t, srv.Addr), limit, leaselimit.WithoutLease())
	var total int64
	for k := range keys {
		left := int64(0)
		for {
			d, err := drain.Allow(context.Background(), "k"+strconv.Itoa(k))
			if err != nil {
				t.Fatal(err)
			}
			if !d.Allowed {
				break
			}
			left++
		}
		if got := admitted[k].Load() + left; got != burst {
			t.Errorf("key k%d: %d admitted + %d left = %d; want its burst, %d", k, admitted[k].Load(), left, got, burst)
		}
		total += admitted[k].Load()
	}
	if total < keys*burst/2 {
		t.Errorf("the fleet admitted %d of %d tokens; the load was meant to spend most of them", total, keys*burst)
	}
}
