package leaselimit_test

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// TestPeekChangesNothing: Peek reads the bucket without writing it (its
// stored value and TTL are unchanged, no write command runs) and agrees
// with the next Allow, in exact and lease mode on a real redis-server.
func TestPeekChangesNothing(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	for _, mode := range []string{"exact", "lease"} {
		t.Run(mode, func(t *testing.T) {
			l := policy.Limit{Name: "peek-" + mode, Rate: 10, Period: time.Hour, Burst: 50}
			var opts []leaselimit.Option
			if mode == "exact" {
				opts = append(opts, leaselimit.WithoutLease())
			}
			lim := mustNew(t, srv.Client(t), l, opts...)

			d, err := lim.Peek(ctx, "fresh")
			if err != nil {
				t.Fatal(err)
			}
			if !d.Allowed || d.Remaining != l.Burst || d.RetryAfter != 0 || d.ResetAfter != 0 || d.Source != leaselimit.SourceAuthority {
				t.Errorf("Peek of an unused key = %+v; want a full bucket", d)
			}
			for i := 0; i < 7; i++ {
				if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
					t.Fatalf("Allow = %+v, %v", d, err)
				}
			}
			keys := toStrings(srv.Do(t, "KEYS", "*peek-"+mode+"*"))
			if len(keys) != 1 {
				t.Fatalf("buckets in Redis: %v; want 1", keys)
			}
			before := srv.Do(t, "GET", keys[0])
			writes := writeCommands(t, srv)
			d, err = lim.Peek(ctx, "k")
			if err != nil {
				t.Fatal(err)
			}
			if after := srv.Do(t, "GET", keys[0]); after != before {
				t.Errorf("Peek changed the bucket: %v → %v", before, after)
			}
			if w := writeCommands(t, srv); w != writes {
				t.Errorf("Peek ran %d write commands", w-writes)
			}
			if got := toStrings(srv.Do(t, "KEYS", "*peek-"+mode+"*")); len(got) != 1 {
				t.Errorf("buckets after Peek of an unused key: %v", got)
			}
			if d.Remaining != l.Burst-7 || !d.Allowed || d.RetryAfter != 0 || d.ResetAfter <= 0 {
				t.Errorf("Peek after 7 of 50 = %+v; want Remaining 43, Allowed, ResetAfter > 0", d)
			}
			next, err := lim.Allow(ctx, "k")
			if err != nil || !next.Allowed {
				t.Fatalf("Allow = %+v, %v", next, err)
			}
			if next.Remaining != d.Remaining-1 {
				t.Errorf("Allow after Peek: Remaining %d; Peek said %d", next.Remaining, d.Remaining)
			}
		})
	}
}

// writeCommands returns how many SET and DEL commands Redis has run, inside
// scripts or not.
func writeCommands(t *testing.T, srv *redistest.Server) int64 {
	t.Helper()
	st := srv.Stats(t)
	var n int64
	for _, cmd := range []string{"set", "del", "pexpire", "hset"} {
		n += st.Calls[cmd]
	}
	return n
}

// TestPeekAgreesWithNegativeCache: on a busy key at its limit, Peek
// allows only what the next Allow here admits: while this instance's
// negative cache waits for a batch, Peek says denied, whatever the bucket
// gained meanwhile, and its RetryAfter runs to the cache's end. Regression
// (adversarial reviews): Peek read the bucket and the lease but not the
// cache, and said Allowed 6,464 times where the next Allow denied 6,458
// of them; then, a denying Peek's RetryAfter stopped at the bucket's.
func TestPeekAgreesWithNegativeCache(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	lim := mustNew(t, srv.Client(t), policy.Limit{Name: "peek-cache", Rate: 100, Period: time.Second, Burst: 100})
	peeks, disagree, cached, sooner := 0, 0, 0, 0
	for range 3000 {
		p, err := lim.Peek(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		d, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case p.Allowed:
			peeks++
			if !d.Allowed {
				disagree++
			}
		case d.Source == leaselimit.SourceCache:
			// Denied by the cache after a Peek that said denied: the
			// Peek's RetryAfter, read earlier, runs at least as far.
			cached++
			if p.RetryAfter < d.RetryAfter {
				sooner++
			}
		}
	}
	t.Logf("%d of %d Peeks allowed; the next Allow denied %d of them; of %d cached denials after a denying Peek, the Peek said sooner %d times", peeks, 3000, disagree, cached, sooner)
	if disagree > 0 {
		t.Errorf("Peek said Allowed and the next Allow denied %d times", disagree)
	}
	if cached == 0 {
		t.Error("no denial from the cache: the scenario did not reach the limit")
	}
	// A refill in flight (a prefetch) may land between a Peek and the
	// next Allow and start a cache window the Peek could not know of:
	// once in 2,855 cached denials in a CI run under -race. With the
	// regression every one of them was sooner (2,874 of 2,874).
	if sooner*100 > cached {
		t.Errorf("a denying Peek's RetryAfter ended before the cache's %d times of %d (regression: it stopped at the bucket's)", sooner, cached)
	}
}

// TestPeekEmptyBucket: an exhausted bucket peeks as denied, with the time
// to one token and to a full bucket.
func TestPeekEmptyBucket(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	l := policy.Limit{Name: "peek-empty", Rate: 1, Period: time.Minute, Burst: 3}
	lim := mustNew(t, srv.Client(t), l, leaselimit.WithoutLease())
	if _, err := lim.AllowN(ctx, "k", 3); err != nil {
		t.Fatal(err)
	}
	d, err := lim.Peek(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if d.Allowed || d.Remaining != 0 {
		t.Errorf("Peek of an empty bucket = %+v; want denied, 0 remaining", d)
	}
	if d.RetryAfter < 55*time.Second || d.RetryAfter > time.Minute {
		t.Errorf("RetryAfter = %v; want about 1m (1 token per minute)", d.RetryAfter)
	}
	if d.ResetAfter < 2*time.Minute+55*time.Second || d.ResetAfter > 3*time.Minute {
		t.Errorf("ResetAfter = %v; want about 3m", d.ResetAfter)
	}
	next, err := lim.Allow(ctx, "k")
	if err != nil || next.Allowed {
		t.Errorf("Allow after Peek said empty = %+v, %v", next, err)
	}
}

// TestResetThisInstance: after Reset the bucket is full and this instance
// admits at once: its lease is dropped (not refunded) and its negative
// cache with it.
func TestResetThisInstance(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	for _, mode := range []string{"exact", "lease"} {
		t.Run(mode, func(t *testing.T) {
			l := policy.Limit{Name: "reset-" + mode, Rate: 1, Period: time.Hour, Burst: 10}
			var opts []leaselimit.Option
			if mode == "exact" {
				opts = append(opts, leaselimit.WithoutLease())
			}
			lim := mustNew(t, srv.Client(t), l, opts...)
			for i := 0; i < 12; i++ {
				if _, err := lim.Allow(ctx, "k"); err != nil {
					t.Fatal(err)
				}
			}
			if d, _ := lim.Allow(ctx, "k"); d.Allowed {
				t.Fatal("admitted past the burst")
			}
			if err := lim.Reset(ctx, "k"); err != nil {
				t.Fatal(err)
			}
			d, err := lim.Allow(ctx, "k")
			if err != nil || !d.Allowed {
				t.Fatalf("Allow right after Reset = %+v, %v; want admitted", d, err)
			}
			p, err := lim.Peek(ctx, "k")
			if err != nil {
				t.Fatal(err)
			}
			if p.Remaining != l.Burst-1 {
				t.Errorf("Peek after Reset and one Allow: Remaining %d; want %d", p.Remaining, l.Burst-1)
			}
		})
	}
}

// TestResetDropsJointLeases: Reset through one limit drops this instance's
// state of its bucket in every set of limits that has it: a set's lease of
// the old bucket's tokens serves nothing more, and its cached denial goes.
// Regression: only the resetting Limiter's own sets were dropped; after
// Limiter(a).Reset, Limiter(a, b) here admitted 1,026 of a fresh bucket of
// 1,000, and once a was spent and reset, denied it from its cache for up
// to DenyCap (found by an adversarial review).
func TestResetDropsJointLeases(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	a := policy.Limit{Name: "reset-joint-a", Rate: 1, Period: 24 * time.Hour, Burst: 1000}
	b := policy.Limit{Name: "reset-joint-b", Rate: 1, Period: 24 * time.Hour, Burst: 100_000}
	c := mustClient(t, srv.Client(t))
	alone, both := c.Limiter(a), c.Limiter(a, b)
	for range 400 { // a busy key: the set leases a's and b's tokens here
		if d, err := both.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("Allow before Reset = %+v, %v", d, err)
		}
	}
	if err := alone.Reset(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	// Both views until both deny: the fresh bucket's 1,000 and no more.
	var admitted int64
	for {
		d, err := both.Allow(ctx, "k")
		if err == nil && !d.Allowed {
			d, err = alone.Allow(ctx, "k")
		}
		if err != nil {
			t.Fatal(err)
		}
		if !d.Allowed {
			break
		}
		admitted++
	}
	if admitted > a.Burst {
		t.Errorf("admitted %d after Reset, of a fresh bucket of %d: the set's lease of the old one kept serving", admitted, a.Burst)
	}
	// a is spent, and the set here caches a denial: a Reset of a clears it.
	if d, _ := both.Allow(ctx, "k"); d.Allowed {
		t.Fatalf("the set admitted with a spent: %+v", d)
	}
	if err := alone.Reset(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	if d, err := both.Allow(ctx, "k"); err != nil || !d.Allowed {
		t.Errorf("the set's Allow right after a's Reset = %+v, %v; want admitted by the full bucket", d, err)
	}
}

// TestResetFleet: 4 instances call a key far over its limit in tight loops
// until every one of them denies; another instance resets the key. The
// bound Reset documents holds: once DenyCap has passed on the instances'
// clock (a clock moved by hand, so the test measures no wall time), no
// instance denies from the cache it had before the reset (a denial from the
// cache is only ever one Redis gave it since), each asks Redis again, and
// the fleet admits what the fresh bucket holds and no more.
func TestResetFleet(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	srv := redistest.Start(t)
	l := policy.Limit{Name: "reset-fleet", Rate: 1, Period: time.Hour, Burst: 400}
	settings := policy.Lease{DenyCap: 200 * time.Millisecond}
	clk := newFakeClock()
	const instances = 4
	lims := make([]*leaselimit.Limiter, instances)
	var calls [instances]callCounter // Redis calls of each instance
	for i := range lims {
		c := srv.Client(t)
		c.AddHook(&calls[i])
		lims[i] = mustNew(t, c, l, leaselimit.WithLease(settings), leaselimit.WithClock(clk),
			leaselimit.WithFailureMode(policy.FailClosed))
	}
	admin := mustNew(t, srv.Client(t), l)
	ctx := context.Background()

	// phase: 0 spending the bucket, 1 reset done, 2 DenyCap passed since.
	var phase atomic.Int32
	var admitted [3]atomic.Int64
	var denying [instances]atomic.Bool
	var callsAtAdvance [instances]int64
	var staleCache, fallbacks atomic.Int64
	stop := tightLoops(2*instances, func(w, _ int) bool {
		i := w / 2
		p := phase.Load()
		d, err := lims[i].Allow(ctx, "k")
		if err != nil {
			t.Error(err)
			return false
		}
		switch {
		case d.Source == leaselimit.SourceFallback:
			fallbacks.Add(1)
		case p == 2 && d.Source == leaselimit.SourceCache && calls[i].n.Load() == callsAtAdvance[i]:
			staleCache.Add(1)
		}
		if d.Allowed {
			// Counted by the phase it ended in: a decision in flight
			// across the reset belongs after it.
			admitted[phase.Load()].Add(1)
		} else {
			denying[i].Store(true)
		}
		return true
	})
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !ok() {
			if time.Now().After(deadline) {
				stop()
				t.Fatalf("timed out waiting until %s", what)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitFor("every instance denies", func() bool {
		for i := range denying {
			if !denying[i].Load() {
				return false
			}
		}
		return true
	})
	// Phase 1 starts before the reset (the bucket is empty until it).
	phase.Store(1)
	if err := admin.Reset(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	for i := range calls {
		callsAtAdvance[i] = calls[i].n.Load()
	}
	clk.Add(settings.DenyCap + time.Microsecond)
	phase.Store(2)
	waitFor("every instance asked Redis after DenyCap", func() bool {
		for i := range calls {
			if calls[i].n.Load() == callsAtAdvance[i] {
				return false
			}
		}
		return true
	})
	// Let the fleet spend the fresh bucket.
	time.Sleep(500 * time.Millisecond)
	stop()
	if fallbacks.Load() > 0 {
		t.Fatalf("%d fallback decisions on a healthy Redis", fallbacks.Load())
	}
	got := admitted[1].Load() + admitted[2].Load()
	t.Logf("spent %d before the reset; after it %d before DenyCap passed and %d after (fresh bucket %d)",
		admitted[0].Load(), admitted[1].Load(), admitted[2].Load(), l.Burst)
	if n := staleCache.Load(); n > 0 {
		t.Errorf("%d denials from the negative cache after DenyCap had passed since the reset", n)
	}
	// A token per hour: at most one more accrues during the test.
	if got > l.Burst+1 {
		t.Errorf("admitted %d after the reset; the fresh bucket holds %d", got, l.Burst)
	}
	if got < l.Burst {
		t.Errorf("admitted %d after the reset; want the fresh bucket's %d", got, l.Burst)
	}
}

// callCounter is a go-redis hook that counts the commands a client sends.
type callCounter struct{ n atomic.Int64 }

func (c *callCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *callCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

func (c *callCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}

// TestPeekResetUnavailable: with the breaker open Peek and Reset return an
// error wrapping ErrUnavailable, and Reset changes nothing.
func TestPeekResetUnavailable(t *testing.T) {
	m, c := newMini(t)
	l := policy.Limit{Name: "down", Rate: 1, Period: time.Hour, Burst: 5}
	lim := mustNew(t, c, l, leaselimit.WithTimeout(200*time.Millisecond))
	ctx := context.Background()
	m.SetError("LOADING Redis is loading the dataset in memory")
	for i := 0; i < 10; i++ {
		_, _ = lim.Allow(ctx, "k")
	}
	if _, err := lim.Peek(ctx, "k"); !errors.Is(err, leaselimit.ErrUnavailable) {
		t.Errorf("Peek with Redis down = %v; want ErrUnavailable", err)
	}
	if err := lim.Reset(ctx, "k"); !errors.Is(err, leaselimit.ErrUnavailable) {
		t.Errorf("Reset with Redis down = %v; want ErrUnavailable", err)
	}
}

// TestResetResent: go-redis sends a call again when its connection breaks
// after Redis ran it. A Reset whose replies are lost twice runs three
// times at Redis, and must start one generation: the bucket spent after
// the first run stays spent (it was deleted again by each resend, and the
// fleet admitted a fresh burst per resend).
func TestResetResent(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.NewProxy(t, srv.Addr)
	ctx := context.Background()
	l := policy.Limit{Name: "reset-resent", Rate: 1, Period: 24 * time.Hour, Burst: 20}
	other := mustNew(t, srv.Client(t), l, leaselimit.WithoutLease())
	resetter := mustNew(t, redisClient(t, proxy.Addr), l, leaselimit.WithoutLease(), leaselimit.WithTimeout(2*time.Second))
	if err := resetter.Reset(ctx, "warm-up"); err != nil { // the script cached: no NOSCRIPT below
		t.Fatal(err)
	}
	if d, err := other.AllowN(ctx, "k", l.Burst); err != nil || !d.Allowed {
		t.Fatalf("AllowN(Burst) = %+v, %v", d, err)
	}
	var lost atomic.Int32
	proxy.DropReplies(func(chunk []byte) bool {
		// The first two script calls only: the third send goes through.
		return bytes.Contains(bytes.ToLower(chunk), []byte("evalsha")) && lost.Add(1) <= 2
	})
	// Spend the fresh bucket while the Reset's resends are under way: a
	// resend that deletes it again shows as a full bucket after it.
	spent := make(chan int64, 1)
	go func() {
		var n int64
		for lost.Load() < 3 {
			if d, err := other.Allow(ctx, "k"); err == nil && d.Allowed {
				n++
			}
		}
		spent <- n
	}()
	err := resetter.Reset(ctx, "k")
	proxy.DropReplies(nil)
	lost.Store(3)
	n := <-spent
	if err != nil {
		t.Fatalf("Reset with two replies lost = %v; want nil (go-redis resends)", err)
	}
	if proxy.DroppedReplies() < 2 {
		t.Fatalf("%d replies dropped; want 2: the test did not test", proxy.DroppedReplies())
	}
	p, err := other.Peek(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if n+p.Remaining != l.Burst {
		t.Errorf("after one Reset: %d admitted and %d left; want %d in all (one fresh burst)", n, p.Remaining, l.Burst)
	}
}
