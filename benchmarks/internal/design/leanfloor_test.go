package design

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// TestLeanFloorIsATokenBucket: the floor, its hand-off variant, the
// lean contract and the layers decide as a token bucket does, in order within a batch,
// when their callers come one at a time and in a flood: a burst of 100 on
// one key admits exactly 100 of 6,400 concurrent calls (a refill of one
// token an hour adds none during the test), and separate keys have
// separate buckets.
func TestLeanFloorIsATokenBucket(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	c := NewClient(srv.Addr, nil)
	defer c.Close()
	for _, name := range append([]string{LeanFloor, LeanHandoff, LeanContract}, Layers...) {
		t.Run(name, func(t *testing.T) {
			d, err := New(name, c, policy.Limit{Name: "lean", Rate: 1, Period: time.Hour, Burst: 5})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			admitted := 0
			for range 8 {
				r, err := d.Allow(ctx, name+"one")
				if err != nil {
					t.Fatal(err)
				}
				if r.Allowed {
					admitted++
				}
			}
			if admitted != 5 {
				t.Errorf("one at a time: %d of 8 admitted; want the burst of 5", admitted)
			}

			flood, err := New(name, c, policy.Limit{Name: "lean", Rate: 1, Period: time.Hour, Burst: 100})
			if err != nil {
				t.Fatal(err)
			}
			defer flood.Close()
			var ok atomic.Int64
			var wg sync.WaitGroup
			for g := range 64 {
				wg.Go(func() {
					for i := range 100 {
						key := name + "hot"
						if i%10 == 0 {
							key = name + "cold" + strconv.Itoa(g) // a key of its own: 10 calls, all admitted
						}
						r, err := flood.Allow(ctx, key)
						if err != nil {
							t.Error(err)
							return
						}
						if r.Allowed && key == name+"hot" {
							ok.Add(1)
						}
					}
				})
			}
			wg.Wait()
			if got := ok.Load(); got != 100 {
				t.Errorf("a flood on one key admitted %d; want exactly its burst of 100", got)
			}
			for g := range 64 {
				if r, err := flood.Allow(ctx, name+"cold"+strconv.Itoa(g)); err != nil || !r.Allowed {
					t.Fatalf("key cold%d after 10 calls = %+v, %v; want admitted (90 left)", g, r, err)
				}
			}
		})
	}
}

// TestLeanContractResendTakesOnce: a batch sent twice under one batch key
// (as go-redis resends a pipeline whose connection broke) takes its tokens
// once and answers the same both times, and bucket keys are digests.
func TestLeanContractResendTakesOnce(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	c := NewClient(srv.Addr, nil)
	defer c.Close()
	d, err := New(LeanContract, c, policy.Limit{Name: "resend", Rate: 1, Period: time.Hour, Burst: 5})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	bucket := d.(*leanDecider).keyOf("user-1")
	if strings.Contains(bucket, "user-1") || !strings.HasSuffix(bucket, "}") {
		t.Fatalf("bucket key %q holds the user's key, or no digest", bucket)
	}
	keys := []string{"ll-contr:batch:{x}:resent", bucket, bucket}
	first, err := leanContractScript.Run(ctx, c, keys, leanContractLife, 1, 3600_000_000, 5, 1, 2).Text()
	if err != nil {
		t.Fatal(err)
	}
	again, err := leanContractScript.Run(ctx, c, keys, leanContractLife, 1, 3600_000_000, 5, 1, 2).Text()
	if err != nil {
		t.Fatal(err)
	}
	if first != "1 4 2 2" || again != first {
		t.Errorf("replies %q then %q; want \"1 4 2 2\" twice (1 then 2 of 5 tokens, taken once)", first, again)
	}
	for i := range 2 {
		if r, err := d.Allow(ctx, "user-1"); err != nil || !r.Allowed {
			t.Fatalf("Allow %d after the resent batch = %+v, %v; want admitted (2 of 5 left)", i+1, r, err)
		}
	}
	if r, err := d.Allow(ctx, "user-1"); err != nil || r.Allowed {
		t.Errorf("Allow with the bucket empty = %+v, %v; want denied", r, err)
	}
}

// TestLeanContractReadsARepeatedKeyOnce: calls on one key in one batch are
// decided in order on one read of its bucket, which is written once after
// them (issue 25, item 2), as leaselimit's batch script does.
func TestLeanContractReadsARepeatedKeyOnce(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	c := NewClient(srv.Addr, nil)
	defer c.Close()
	d, err := New(LeanContract, c, policy.Limit{Name: "repeat", Rate: 1, Period: time.Hour, Burst: 5})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	hot, cold := d.(*leanDecider).keyOf("hot"), d.(*leanDecider).keyOf("cold")
	keys := []string{"ll-contr:batch:{x}:repeat", hot, cold, hot, hot, hot, hot, hot, hot}
	args := []any{leanContractLife, 1, 3600_000_000, 5, 2, 1, 1, 1, 1, 1, 1, 1}
	if err := c.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	got, err := leanContractScript.Run(ctx, c, keys, args...).Text()
	if err != nil {
		t.Fatal(err)
	}
	// hot: 2 of 5, then 1 at a time to empty, then denied three times; cold: 1.
	if want := "2 3 1 4 1 2 1 1 1 0 0 0 0 0 0 0"; got != want {
		t.Errorf("reply %q; want %q", got, want)
	}
	stats, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	// GET: hot and cold once each; SET: the batch key (claimed with NX
	// GET), hot, cold.
	for cmd, want := range map[string]string{"get": "calls=2,", "set": "calls=3,"} {
		if !strings.Contains(stats, "cmdstat_"+cmd+":"+want) {
			t.Errorf("commandstats after one batch: want %s %s in\n%s", cmd, want, stats)
		}
	}
	if r, err := d.Allow(ctx, "hot"); err != nil || r.Allowed {
		t.Errorf("Allow on the emptied hot key = %+v, %v; want denied", r, err)
	}
	if r, err := d.Allow(ctx, "cold"); err != nil || !r.Allowed {
		t.Errorf("Allow on cold (4 of 5 left) = %+v, %v; want admitted", r, err)
	}
}

// TestLeanHandoffPastTheBudgetIsAFallback: a hand-off design's call that
// gets no reply within its budget is denied as a fallback, which the
// harness counts, not an error, which stopped a whole run; the design
// serves again once Redis does.
func TestLeanHandoffPastTheBudgetIsAFallback(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	c := NewClient(srv.Addr, nil)
	defer c.Close()
	for _, name := range []string{LeanHandoff, LeanNecessary} {
		t.Run(name, func(t *testing.T) {
			d, err := New(name, c, policy.Limit{Name: "budget", Rate: 1, Period: time.Hour, Burst: 5})
			if err != nil {
				t.Fatal(err)
			}
			if r, err := d.Allow(ctx, "k"); err != nil || !r.Allowed {
				t.Fatalf("Allow before the pause = %+v, %v", r, err)
			}
			srv.Pause(t)
			done := make(chan struct{})
			var r Result
			go func() {
				defer close(done)
				r, err = d.Allow(ctx, "k")
			}()
			select {
			case <-done:
			case <-time.After(10 * leanBudget):
				t.Errorf("Allow on a paused Redis still waiting after %v; budget %v", 10*leanBudget, leanBudget)
			}
			srv.Resume(t)
			<-done
			if err != nil || r.Allowed || !r.Fallback {
				t.Errorf("Allow past the budget = %+v, %v; want denied as a fallback, no error", r, err)
			}
			if r, err := d.Allow(ctx, "k"); err != nil || !r.Allowed || r.Fallback {
				t.Errorf("Allow after the resume = %+v, %v; want admitted by Redis", r, err)
			}
			if err := d.Close(); err != nil {
				t.Error(err)
			}
		})
	}
}

// TestLeanLeaseLeasesARepeatedKey: lean_lease decides a key's first sight
// exactly, leases it two tokens at its second, serves its third from the
// lease with no Redis call, and gives the unused spare back when the lease
// expires and at Close: the bucket ends with exactly the tokens not used.
func TestLeanLeaseLeasesARepeatedKey(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	var count Counter
	c := NewClient(srv.Addr, &count)
	defer c.Close()
	d, err := New(LeanLease, c, policy.Limit{Name: "lease", Rate: 1, Period: time.Hour, Burst: 10})
	if err != nil {
		t.Fatal(err)
	}
	l := d.(*leanLease)
	wholeTokens := func(key string) string {
		v, err := c.Get(ctx, l.batches.namer.Key(key)).Result()
		if err != nil {
			t.Fatal(err)
		}
		return strings.Fields(v)[0]
	}
	if _, err := d.Allow(ctx, "warm"); err != nil { // the connection, the script loaded
		t.Fatal(err)
	}
	// Requests per sight: exact, a refill of two, a lease hit, a refill.
	for i, want := range []int64{1, 1, 0, 1} {
		before := count.Load()
		if r, err := d.Allow(ctx, "k"); err != nil || !r.Allowed {
			t.Fatalf("sight %d = %+v, %v; want admitted", i+1, r, err)
		}
		if got := count.Load() - before; got != want {
			t.Errorf("sight %d made %d requests; want %d", i+1, got, want)
		}
	}
	if got := wholeTokens("k"); got != "5" {
		t.Errorf("bucket after 4 sights holds %s tokens; want 5 (one spare leased)", got)
	}
	l.sweep(l.now() + int64(leanLeaseTTL)) // the lease expired
	if got := wholeTokens("k"); got != "6" {
		t.Errorf("bucket after the lease expired holds %s tokens; want 6 (the spare back)", got)
	}
	for i := range 2 { // back within a lease's life of its last use: a lease again
		if r, err := d.Allow(ctx, "k"); err != nil || !r.Allowed {
			t.Fatalf("sight %d after the expiry = %+v, %v; want admitted", i+1, r, err)
		}
	}
	if got := wholeTokens("k"); got != "4" {
		t.Errorf("bucket after a refill and a hit holds %s tokens; want 4", got)
	}
	if r, err := d.Allow(ctx, "k"); err != nil || !r.Allowed {
		t.Fatalf("a sight refilling the lease = %+v, %v; want admitted", r, err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if got := wholeTokens("k"); got != "3" {
		t.Errorf("bucket after Close holds %s tokens; want 3 (7 used, the spare back)", got)
	}
}
