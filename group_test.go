package leaselimit_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"golang.org/x/time/rate"
)

// TestMultiLimitAllOrNothing: a request under two limits that one of them
// denies takes nothing from the other (nested Limiters took 5 per-second
// tokens for 5 requests the daily quota refused), and the Decision names
// the limit that denied, with the time until both admit.
func TestMultiLimitAllOrNothing(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	for _, mode := range []string{"exact", "lease"} {
		t.Run(mode, func(t *testing.T) {
			burst := policy.Limit{Name: "burst-" + mode, Rate: 20, Period: time.Hour, Burst: 20}
			daily := policy.Limit{Name: "daily-" + mode, Rate: 10, Period: 24 * time.Hour, Burst: 10}
			var opts []leaselimit.Option
			if mode == "exact" {
				opts = append(opts, leaselimit.WithoutLease())
			}
			root := mustNew(t, srv.Client(t), burst, opts...)
			both := root.For(burst, daily)
			if got := both.Limits(); len(got) != 2 || got[0] != burst || got[1] != daily {
				t.Fatalf("Limits() = %v", got)
			}
			for i := 0; i < 10; i++ {
				d, err := both.Allow(ctx, "user")
				if err != nil || !d.Allowed || d.Source == leaselimit.SourceFallback {
					t.Fatalf("request %d = %+v, %v", i, d, err)
				}
				if len(d.Parts) != 2 || d.Parts[0].Remaining != int64(19-i) || d.Parts[1].Remaining != int64(9-i) {
					t.Fatalf("request %d Parts = %+v", i, d.Parts)
				}
				if d.Limit != daily || d.Remaining != int64(9-i) {
					t.Errorf("request %d: Limit %v, Remaining %d; want the daily quota, the fewest left", i, d.Limit.Name, d.Remaining)
				}
			}
			for i := 0; i < 5; i++ {
				d, err := both.Allow(ctx, "user")
				if err != nil || d.Allowed {
					t.Fatalf("request past the daily quota = %+v, %v; want denied", d, err)
				}
				if d.Limit != daily || d.RetryAfter < 2*time.Hour+20*time.Minute || d.RetryAfter > 2*time.Hour+24*time.Minute {
					t.Errorf("denial: Limit %s, RetryAfter %v; want daily, about 2h24m (one token a day / 10)", d.Limit.Name, d.RetryAfter)
				}
			}
			p, err := root.For(burst).Peek(ctx, "user")
			if err != nil {
				t.Fatal(err)
			}
			if p.Remaining != 10 {
				t.Errorf("the burst limit holds %d after 10 admitted and 5 denied; want 10 (denials take nothing)", p.Remaining)
			}
		})
	}
}

// TestMultiLimitResent: a multi-limit call whose reply is lost after Redis
// applied it, and which go-redis therefore sends again on a new connection,
// takes its tokens once: the resent call finds its first reply (see
// acquire_all.lua's resend key). Regression: it took them twice, so each
// lost reply cost the key a request's tokens.
func TestMultiLimitResent(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.NewProxy(t, srv.Addr)
	ctx := context.Background()
	perHour := policy.Limit{Name: "resent-hour", Rate: 20, Period: time.Hour, Burst: 20}
	daily := policy.Quota("resent-day", 10, policy.Day, time.UTC)
	root := mustNew(t, redisClient(t, proxy.Addr), perHour, leaselimit.WithoutLease())
	both := root.For(perHour, daily)
	// Another key first, so that Redis has the script cached: the dropped
	// call must be one Redis applied, not a NOSCRIPT.
	if d, err := both.Allow(ctx, "warm-up"); err != nil || !d.Allowed {
		t.Fatalf("warm-up Allow = %+v, %v", d, err)
	}
	var matched atomic.Bool
	proxy.DropReplies(func(chunk []byte) bool {
		// The first script call only: the resend goes through.
		return bytes.Contains(bytes.ToLower(chunk), []byte("evalsha")) && matched.CompareAndSwap(false, true)
	})
	d, err := both.Allow(ctx, "user")
	proxy.DropReplies(nil)
	if err != nil || !d.Allowed || d.Source != leaselimit.SourceAuthority {
		t.Fatalf("Allow with its first reply lost = %+v, %v; want admitted at Redis", d, err)
	}
	if proxy.DroppedReplies() == 0 {
		t.Fatal("no reply was dropped: the test did not test")
	}
	for _, l := range []policy.Limit{perHour, daily} {
		p, err := root.For(l).Peek(ctx, "user")
		if err != nil {
			t.Fatal(err)
		}
		if p.Remaining != l.Burst-1 {
			t.Errorf("%s holds %d after one request whose reply was lost once; want %d (taken once)", l.Name, p.Remaining, l.Burst-1)
		}
	}
}

// TestMultiLimitFleet: 4 instances call one key under two limits in tight
// loops, with leases: the fleet admits no more than the tighter limit's
// Burst + Rate·T, and no more than the looser one's either.
func TestMultiLimitFleet(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	srv := redistest.Start(t)
	perSecond := policy.Limit{Name: "fleet-ps", Rate: 2000, Period: time.Second, Burst: 200}
	slower := policy.Limit{Name: "fleet-slow", Rate: 500, Period: time.Second, Burst: 100}
	const instances = 4
	lims := make([]*leaselimit.Limiter, instances)
	for i := range lims {
		root := mustNew(t, srv.Client(t), perSecond, leaselimit.WithFailureMode(policy.FailClosed))
		lims[i] = root.For(perSecond, slower)
	}
	r := flood(t, lims, 2, 3*time.Second, func(int, int) string { return "shared" })
	if r.bySource[leaselimit.SourceFallback] > 0 {
		t.Fatalf("%d fallback decisions on a healthy Redis", r.bySource[leaselimit.SourceFallback])
	}
	bound := float64(slower.Burst) + float64(slower.Rate)*r.elapsed.Seconds()
	got := float64(r.admitted)
	t.Logf("admitted %.0f in %v (sources %v); the slower limit's bound %.0f (%.1f%%)", got, r.elapsed, r.bySource, bound, 100*got/bound)
	if got > bound {
		t.Errorf("admitted %.0f > the slower limit's Burst + Rate·T = %.0f", got, bound)
	}
	if got < 0.9*bound*(3*time.Second).Seconds()/r.elapsed.Seconds() {
		t.Errorf("admitted %.0f, under 90%% of the bound %.0f", got, bound)
	}
	if r.bySource[leaselimit.SourceLease] == 0 {
		t.Errorf("no decision from a lease: %v", r.bySource)
	}
}

// TestMultiLimitDifferential: random requests on a few keys under two
// limits together decide as two x/time/rate limiters checked together (both
// must hold n tokens; then both lose them).
func TestMultiLimitDifferential(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	a := policy.Limit{Name: "a", Rate: 7, Period: time.Hour, Burst: 30}
	b := policy.Limit{Name: "b", Rate: 3, Period: 24 * time.Hour, Burst: 45}
	root := mustNew(t, srv.Client(t), a, leaselimit.WithoutLease())
	both := root.For(a, b)
	now := time.Now()
	oracle := map[string][2]*rate.Limiter{}
	rng := rand.New(rand.NewSource(2))
	for i := 0; i < 400; i++ {
		key := fmt.Sprintf("k%d", rng.Intn(3))
		n := int64(1 + rng.Intn(4))
		o, ok := oracle[key]
		if !ok {
			o = [2]*rate.Limiter{rate.NewLimiter(rate.Limit(7.0/3600), 30), rate.NewLimiter(rate.Limit(3.0/86400), 45)}
			oracle[key] = o
		}
		want := o[0].TokensAt(now) >= float64(n) && o[1].TokensAt(now) >= float64(n)
		if want {
			o[0].AllowN(now, int(n))
			o[1].AllowN(now, int(n))
		}
		d, err := both.AllowN(ctx, key, n)
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed != want {
			t.Fatalf("request %d (%s, %d): Allowed %v; the oracles say %v", i, key, n, d.Allowed, want)
		}
		for j, p := range d.Parts {
			if got, want := p.Remaining, int64(o[j].TokensAt(now)); got != want {
				t.Fatalf("request %d: %s holds %d; its oracle %d", i, p.Limit.Name, got, want)
			}
		}
	}
}

// TestMultiLimitReserveAndContract: Reserve and Settle on a multi-limit
// adjust every bucket; For refuses a limit given twice or more than
// MaxLimits, and a cost above any burst.
func TestMultiLimitReserveAndContract(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	a := policy.Limit{Name: "ra", Rate: 1, Period: time.Hour, Burst: 100}
	b := policy.Limit{Name: "rb", Rate: 1, Period: time.Hour, Burst: 50}
	root := mustNew(t, srv.Client(t), a, leaselimit.WithoutLease())
	both := root.For(a, b)
	r, err := both.Reserve(ctx, "k", 30)
	if err != nil || !r.Decision().Allowed {
		t.Fatal(r, err)
	}
	if err := r.Settle(ctx, 10); err != nil {
		t.Fatal(err)
	}
	p, err := both.Peek(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Parts) != 2 || p.Parts[0].Remaining != 90 || p.Parts[1].Remaining != 40 || p.Limit != b {
		t.Errorf("Peek after Reserve(30), Settle(10) = %+v; want 90 and 40 left, b the tighter", p)
	}
	if err := both.Reset(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	if p, _ := both.Peek(ctx, "k"); p.Parts[0].Remaining != 100 || p.Parts[1].Remaining != 50 {
		t.Errorf("Peek after Reset = %+v; want both full", p.Parts)
	}
	// Over the least Burst, b's, whether or not over a's: the error
	// names b's (it named a's for n above a's Burst).
	for _, n := range []int64{60, 101} {
		if _, err := both.AllowN(ctx, "k", n); !errors.Is(err, leaselimit.ErrInvalidCost) || !strings.Contains(err.Error(), "burst 50 of "+b.Name) {
			t.Errorf("AllowN(%d) over b's burst of 50 = %v; want ErrInvalidCost naming b's burst", n, err)
		}
	}
	if _, err := root.For(a, a).Allow(ctx, "k"); !errors.Is(err, policy.ErrInvalidLimit) {
		t.Errorf("For(a, a) = %v; want ErrInvalidLimit", err)
	}
	five := []policy.Limit{b, b.WithName("c"), b.WithName("d"), b.WithName("e")}
	if _, err := root.For(a, five...).Allow(ctx, "k"); !errors.Is(err, policy.ErrInvalidLimit) {
		t.Errorf("For of 5 limits = %v; want ErrInvalidLimit", err)
	}
	if root.For(a, b) != both {
		t.Error("For(a, b) twice gave two Limiters")
	}
}

// TestForDoesNotAllocate: For of a limit, or of limits together, seen
// before allocates nothing.
func TestForDoesNotAllocate(t *testing.T) {
	_, c := newMini(t)
	a := policy.PerSecond(10).WithName("a")
	b := policy.PerMinute(100).WithName("b")
	// A quota whose zone is another *time.Location of the same name.
	quota := policy.Quota("q", 10, policy.Day, time.FixedZone("Z", 3600))
	again := policy.Quota("q", 10, policy.Day, time.FixedZone("Z", 3600))
	root := mustNew(t, c, a)
	root.For(b)
	root.For(a, b)
	root.For(quota)
	if n := testing.AllocsPerRun(100, func() {
		root.For(b)
		root.For(a, b)
		root.For(again)
	}); n != 0 {
		t.Errorf("For of known limits allocates %.1f times per call pair; want 0", n)
	}
}

// TestMultiLimitDenialNamesTheLimit: in lease mode as in exact mode, a
// denial names the limit the request waits for longest. The per-second
// limit waits a second and the hourly quota until the hour ends, so the
// test starts after the hour's last seconds: in them, the quota would be
// the one that waits less.
func TestMultiLimitDenialNamesTheLimit(t *testing.T) {
	_, c := newMini(t)
	ctx := context.Background()
	ps := policy.Limit{Name: "ps", Rate: 2, Period: time.Second, Burst: 2}
	hourly := policy.Quota("hourly", 3, policy.Hour, nil)
	if left := time.Until(time.Now().Truncate(time.Hour).Add(time.Hour)); left < 10*time.Second {
		time.Sleep(left + 100*time.Millisecond)
	}
	for _, mode := range []string{"exact", "lease"} {
		var opts []leaselimit.Option
		if mode == "exact" {
			opts = append(opts, leaselimit.WithoutLease())
		}
		root := mustNew(t, c, ps.WithName("ps-"+mode), opts...)
		both := root.For(ps.WithName("ps-"+mode), hourly.WithName("hourly-"+mode))
		for i := 0; i < 2; i++ {
			if d, err := both.Allow(ctx, "k"); err != nil || !d.Allowed {
				t.Fatalf("%s: request %d = %+v, %v", mode, i, d, err)
			}
		}
		d, err := both.AllowN(ctx, "k", 2)
		if err != nil || d.Allowed || d.Limit.Name != "hourly-"+mode {
			t.Errorf("%s: AllowN(2) = %+v, %v; want denied by the hourly quota", mode, d, err)
		}
	}
}

// TestForKeepsQuotaZonesAndShares: For of a quota whose zone was loaded
// again is the same Limiter; For on a Limiter from Enforcing keeps its share.
func TestForKeepsQuotaZonesAndShares(t *testing.T) {
	_, c := newMini(t)
	root := mustNew(t, c, policy.PerSecond(10).WithName("zones"))
	quota := func() policy.Limit {
		loc, err := time.LoadLocation("Europe/Berlin")
		if err != nil {
			t.Skip("no time zone database:", err)
		}
		return policy.Quota("berlin", 10, policy.Day, loc)
	}
	first, again := root.For(quota()), root.For(quota())
	if first != again {
		t.Error("For of the same quota with a freshly loaded zone gave two Limiters")
	}
	shadow := root.Enforcing(0).For(policy.PerMinute(1).WithName("tried"))
	for i := 0; i < 3; i++ {
		if d, err := shadow.Allow(context.Background(), "k"); err != nil || !d.Allowed || !d.Shadow {
			t.Fatalf("For on an Enforcing(0) Limiter: %+v, %v; want shadow decisions", d, err)
		}
	}
}
