package leaselimit_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"golang.org/x/time/rate"
)

// TestForDifferential: limits reached through For, interleaved at random
// on the same keys of one engine in exact mode, decide exactly as one
// golang.org/x/time/rate limiter per (limit, key). The limits refill so
// slowly that the test's own duration never adds a token, so the oracle's
// clock can stand still.
func TestForDifferential(t *testing.T) {
	srv := redistest.Start(t)
	limits := []policy.Limit{
		{Name: "free", Rate: 5, Period: time.Hour, Burst: 5},
		{Name: "pro", Rate: 100, Period: 24 * time.Hour, Burst: 40},
		{Name: "pro", Rate: 100, Period: 24 * time.Hour, Burst: 17}, // same name, other burst: another bucket
		{Name: "team", Rate: 1, Period: time.Hour, Burst: 120},
	}
	root := mustNew(t, srv.Client(t), limits[0], leaselimit.WithoutLease())
	keys := []string{"alice", "bob", "carol"}
	oracle := map[string]*rate.Limiter{}
	now := time.Now()
	rng := rand.New(rand.NewSource(1))
	ctx := context.Background()
	for i := 0; i < 600; i++ {
		l := limits[rng.Intn(len(limits))]
		key := keys[rng.Intn(len(keys))]
		n := int64(1 + rng.Intn(3))
		if n > l.Burst {
			n = l.Burst
		}
		id := fmt.Sprintf("%v/%s", l, key)
		o := oracle[id]
		if o == nil {
			o = rate.NewLimiter(rate.Limit(float64(l.Rate)/l.Period.Seconds()), int(l.Burst))
			oracle[id] = o
		}
		want := o.AllowN(now, int(n))
		d, err := root.For(l).AllowN(ctx, key, n)
		if err != nil {
			t.Fatalf("request %d: For(%v).AllowN(%q, %d) = %v", i, l, key, n, err)
		}
		if d.Allowed != want {
			t.Fatalf("request %d: For(%v).AllowN(%q, %d).Allowed = %v; x/time/rate says %v", i, l, key, n, d.Allowed, want)
		}
		if d.Limit != l {
			t.Fatalf("request %d: Decision.Limit = %v; want %v", i, d.Limit, l)
		}
		if got, want := d.Remaining, int64(o.TokensAt(now)); got != want {
			t.Fatalf("request %d: %v %q Remaining = %d; x/time/rate holds %d", i, l, key, got, want)
		}
	}
}

// TestForLimitersAreCheap: 1000 limits through For on one engine add no
// goroutine and little heap, against 1000 Limiters from New. Each limit's
// key is asked for twice, so that it holds a lease entry on both sides
// (asked for once, it was decided exactly and left none); both sides have
// WithMaxKeys(1024), so that the comparison weighs the engines and the
// limits, not 1000 doorkeepers sized for the default 100,000 keys (1 MiB
// each: the New side took 1.1 GB).
func TestForLimitersAreCheap(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	const limits = 1000
	plan := func(i int) policy.Limit {
		return policy.Limit{Name: fmt.Sprintf("customer-%d", i), Rate: int64(100 + i), Period: time.Minute, Burst: 100}
	}
	// heap is the live heap once collections stop freeing memory: what an
	// earlier test left to a finalizer (a Client dropped without Close)
	// or to a sync.Pool is freed a cycle or more after the first, and
	// freed during a measurement it was counted against it (a fall of
	// 8 MB while For's limits were made, in CI).
	heap := func() int64 {
		var ms runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&ms)
		for range 10 {
			last := ms.HeapAlloc
			time.Sleep(10 * time.Millisecond) // finalizers run on a goroutine of their own
			runtime.GC()
			runtime.ReadMemStats(&ms)
			if ms.HeapAlloc+64<<10 >= last {
				break
			}
		}
		return int64(ms.HeapAlloc)
	}
	// The goroutines earlier tests left to end (go-redis's dials, clients
	// closing) end before the first count, so that the counts are this
	// test's own: in CI, once the tests that mostly wait ran last (see
	// mostlyWaits), 3 of them ended during For's measurement, which the
	// heap's fall (read unsigned, it failed the comparison) came with.
	for n, deadline := runtime.NumGoroutine(), time.Now().Add(5*time.Second); time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
		m := runtime.NumGoroutine()
		if m == n {
			break
		}
		n = m
	}

	g0, h0 := runtime.NumGoroutine(), heap()
	const maxKeys = 1024
	root := mustNew(t, client, plan(-1), leaselimit.WithMaxKeys(maxKeys))
	for i := 0; i < limits; i++ {
		l := root.For(plan(i))
		for range 2 {
			if _, err := l.Allow(ctx, "k"); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := root.LocalKeys(); n != limits {
		t.Errorf("LocalKeys = %d after %d limits' keys, each asked for twice; want %d", n, limits, limits)
	}
	gFor, hFor := runtime.NumGoroutine()-g0, heap()-h0

	g1, h1 := runtime.NumGoroutine(), heap()
	sep := make([]*leaselimit.Limiter, limits)
	for i := range sep {
		sep[i] = mustNew(t, client, plan(i).WithName(fmt.Sprintf("sep-%d", i)), leaselimit.WithMaxKeys(maxKeys))
		for range 2 {
			if _, err := sep[i].Allow(ctx, "k"); err != nil {
				t.Fatal(err)
			}
		}
	}
	gSep, hSep := runtime.NumGoroutine()-g1, heap()-h1
	t.Logf("%d limits: For on one engine: +%d goroutines, +%.1f KiB heap; %d Limiters from New: +%d goroutines, +%.1f KiB heap",
		limits, gFor, float64(hFor)/1024, limits, gSep, float64(hSep)/1024)
	// New's one Limiter starts the janitor; For starts nothing.
	if gFor > 1 {
		t.Errorf("1000 limits through For added %d goroutines; want at most 1 (the engine's janitor)", gFor)
	}
	if gSep < limits {
		t.Errorf("1000 Limiters from New added %d goroutines; the comparison expects one janitor each", gSep)
	}
	if hFor < 0 {
		t.Errorf("the heap fell by %d B while For's limits were made: memory not this test's was freed meanwhile, and the comparison means nothing", -hFor)
	}
	if hFor*4 > hSep {
		t.Errorf("For's heap (%d B) is more than a quarter of 1000 Limiters' (%d B)", hFor, hSep)
	}
}

// TestForContract: For returns the receiver for its own limit and one
// Limiter per limit; Close on a Limiter from For is refused and closes
// nothing; Close on the Limiter from New closes them all, and For after
// that returns Limiters whose calls return ErrClosed; an invalid limit
// gives a Limiter whose every call returns the validation error.
func TestForContract(t *testing.T) {
	_, c := newMini(t)
	free := policy.Limit{Name: "free", Rate: 10, Period: time.Minute, Burst: 10}
	pro := policy.Limit{Name: "pro", Rate: 1000, Period: time.Minute, Burst: 100}
	root, err := leaselimit.New(c, free)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if root.For(free) != root {
		t.Error("For(its own limit) is not the receiver")
	}
	p := root.For(pro)
	if p.For(pro) != p || root.For(pro) != p {
		t.Error("For(pro) twice gave two Limiters")
	}
	if p.Limit() != pro {
		t.Errorf("For(pro).Limit() = %v", p.Limit())
	}
	if d, err := p.Allow(ctx, "k"); err != nil || !d.Allowed || d.Limit != pro {
		t.Fatalf("For(pro).Allow = %+v, %v", d, err)
	}
	if err := p.Close(); err == nil {
		t.Error("Close on a Limiter from For returned nil")
	}
	if _, err := root.Allow(ctx, "k"); err != nil {
		t.Fatalf("root after Close on a For Limiter: %v", err)
	}

	bad := root.For(policy.Limit{Name: "bad", Rate: 0, Period: time.Second, Burst: 1})
	if _, err := bad.Allow(ctx, "k"); err == nil || errors.Is(err, leaselimit.ErrClosed) {
		t.Errorf("For(invalid).Allow error = %v; want the validation error", err)
	}
	if _, err := bad.Peek(ctx, "k"); err == nil {
		t.Error("For(invalid).Peek returned no error")
	}
	if err := bad.Reset(ctx, "k"); err == nil {
		t.Error("For(invalid).Reset returned no error")
	}

	if err := root.Close(); err != nil {
		t.Fatal(err)
	}
	for _, l := range []*leaselimit.Limiter{p, root.For(pro), root.For(policy.PerSecond(3))} {
		if _, err := l.Allow(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("Allow after Close = %v; want ErrClosed", err)
		}
		if _, err := l.Peek(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("Peek after Close = %v; want ErrClosed", err)
		}
		if err := l.Reset(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("Reset after Close = %v; want ErrClosed", err)
		}
	}
}

// TestForMaxKeysBoundsTheEngine: WithMaxKeys bounds the keys of every
// limit of an engine together. Each key is asked for twice in a row, so
// that it earns an entry (a key seen once is decided exactly and leaves
// none: asked for once, as before, the table stayed empty).
func TestForMaxKeysBoundsTheEngine(t *testing.T) {
	_, c := newMini(t)
	root := mustNew(t, c, policy.PerSecond(1000), leaselimit.WithMaxKeys(64))
	ctx := context.Background()
	for i := 0; i < 8; i++ {
		l := root.For(policy.Limit{Name: fmt.Sprintf("tier-%d", i), Rate: 1000, Period: time.Second, Burst: 1000})
		for k := 0; k < 200; k++ {
			for range 2 {
				if _, err := l.Allow(ctx, fmt.Sprintf("k%d", k)); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	if n := root.LocalKeys(); n > 64 || n < 32 {
		t.Errorf("LocalKeys = %d after 1,600 keys over 8 limits, each asked for twice; want near WithMaxKeys(64), never over", n)
	}
}

// TestPlanUpgradeFleet: a key moved from one plan to another while a fleet
// of 4 instances calls it in tight loops. From the switch on, the new plan's
// bucket alone decides: the fleet admits no more than its Burst + Rate·T.
func TestPlanUpgradeFleet(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	srv := redistest.Start(t)
	free := policy.Limit{Name: "free", Rate: 50, Period: time.Second, Burst: 20}
	pro := policy.Limit{Name: "pro", Rate: 400, Period: time.Second, Burst: 100}
	const instances = 4
	roots := make([]*leaselimit.Limiter, instances)
	for i := range roots {
		roots[i] = mustNew(t, srv.Client(t), free, leaselimit.WithFailureMode(policy.FailClosed))
	}
	var plan atomic.Pointer[policy.Limit]
	plan.Store(&free)
	var upgraded atomic.Bool
	var freeAdmitted, proAdmitted, fallbacks atomic.Int64
	ctx := context.Background()
	stop := tightLoops(2*instances, func(w, _ int) bool {
		d, err := roots[w/2].For(*plan.Load()).Allow(ctx, "user-42")
		if err != nil {
			t.Error(err)
			return false
		}
		if d.Source == leaselimit.SourceFallback {
			fallbacks.Add(1)
		}
		switch {
		case d.Allowed && d.Limit == pro:
			proAdmitted.Add(1)
		case d.Allowed && upgraded.Load() && d.Limit != free:
			t.Errorf("admitted under %v", d.Limit)
		case d.Allowed:
			freeAdmitted.Add(1)
		}
		return true
	})
	time.Sleep(time.Second)
	switched := time.Now()
	plan.Store(&pro)
	upgraded.Store(true)
	time.Sleep(2 * time.Second)
	stop()
	elapsed := time.Since(switched)
	if fallbacks.Load() > 0 {
		t.Fatalf("%d fallback decisions on a healthy Redis", fallbacks.Load())
	}
	bound := float64(pro.Burst) + float64(pro.Rate)*elapsed.Seconds()
	got := float64(proAdmitted.Load())
	t.Logf("free admitted %d; after the upgrade pro admitted %.0f in %v, bound %.0f (%.1f%%)",
		freeAdmitted.Load(), got, elapsed, bound, 100*got/bound)
	if got > bound {
		t.Errorf("pro admitted %.0f > Burst + Rate·T = %.0f", got, bound)
	}
	if got < 0.8*bound {
		t.Errorf("pro admitted %.0f < 80%% of its bound %.0f: the new plan's bucket is not being used", got, bound)
	}
}

// TestForOfARefusedView: For on a view that With refused gives Limiters
// that refuse too. It gave the part of the view applied before the
// refused option, with no error: With(WithShadow(), WithEnforce(7)) then
// For(other) shadowed every decision and said nothing.
func TestForOfARefusedView(t *testing.T) {
	_, c := newMini(t)
	a := policy.Limit{Name: "a", Rate: 1, Period: time.Hour, Burst: 1}
	b := policy.Limit{Name: "b", Rate: 1, Period: time.Hour, Burst: 1}
	root := mustNew(t, c, a)
	bad := root.With(leaselimit.WithShadow(), leaselimit.WithEnforce(7))
	if _, err := bad.Allow(context.Background(), "k"); err == nil {
		t.Fatal("a view with WithEnforce(7) decided")
	}
	for _, l := range []*leaselimit.Limiter{bad.For(b), bad.For(a, b)} {
		if d, err := l.Allow(context.Background(), "k"); err == nil {
			t.Errorf("For on a refused view decided %+v; want the view's error", d)
		}
	}
}
