package leaselimit_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"
)

func TestMain(m *testing.M) {
	// The fault tests refuse, drop and stall connections by the thousand,
	// and go-redis logs every failed dial: one line per kind every 10 s
	// (what an operator gets) keeps a failing test's own output readable.
	redis.SetLogger(telemetry.NewRedisLogger(nil))
	// Likewise each Client logs its outages to slog.Default(), and the
	// tests make thousands of Clients: the tests of the lines set their
	// own logger.
	slog.SetDefault(slog.New(slog.DiscardHandler))
	redistest.VerifyTestMain(m)
}

func newMini(t *testing.T) (*miniredis.Miniredis, *redis.Client) {
	t.Helper()
	return newMiniTB(t)
}

// countCalls counts the commands sent through c. Counting miniredis's
// commands would count those of leaselimit's own connection too, which
// asks Redis when a Limiter starts (redispath's witness).
func countCalls(c *redis.Client) *callCounter {
	cc := &callCounter{}
	c.AddHook(cc)
	return cc
}

func newMiniTB(t testing.TB) (*miniredis.Miniredis, *redis.Client) {
	t.Helper()
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { c.Close() })
	return m, c
}

func mustNew(t *testing.T, c redis.UniversalClient, l policy.Limit, opts ...leaselimit.Option) *leaselimit.Limiter {
	t.Helper()
	// A generous budget by default: these tests are about decisions on a
	// healthy Redis, and -race on a loaded 2-core machine is slow. Tests of
	// the budget pass their own WithTimeout, which comes later and wins.
	opts = append([]leaselimit.Option{leaselimit.WithTimeout(10 * time.Second)}, opts...)
	lim, err := leaselimit.New(c, l, opts...)
	if err != nil {
		t.Fatalf("New(%v) = %v", l, err)
	}
	t.Cleanup(func() { _ = lim.Close() })
	return lim
}

// TestExactMatchesXTimeRate feeds the same server times to an exact-mode
// Limiter on miniredis and to golang.org/x/time/rate and compares every
// decision, remaining count and retry-after.
func TestExactMatchesXTimeRate(t *testing.T) {
	limits := []policy.Limit{
		{Name: "a", Rate: 10, Period: time.Second, Burst: 5},
		{Name: "b", Rate: 3, Period: time.Second, Burst: 7},
		{Name: "c", Rate: 100, Period: time.Minute, Burst: 20},
		{Name: "d", Rate: 1000, Period: time.Second, Burst: 1},
		{Name: "e", Rate: 7, Period: 13 * time.Millisecond, Burst: 40},
	}
	ctx := context.Background()
	for _, l := range limits {
		t.Run(l.Name, func(t *testing.T) {
			m, c := newMini(t)
			lim := mustNew(t, c, l, leaselimit.WithoutLease())
			every := float64(l.Rate) / l.Period.Seconds()
			oracle := rate.NewLimiter(rate.Limit(every), int(l.Burst))
			rng := rand.New(rand.NewPCG(uint64(l.Rate), uint64(l.Burst)))
			now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
			meanGap := l.Period / time.Duration(l.Rate)
			mismatch := 0
			for step := 0; step < 2000; step++ {
				now = now.Add(time.Duration(rng.Int64N(int64(2*meanGap))/1000) * time.Microsecond)
				m.SetTime(now)
				n := 1 + rng.Int64N(l.Burst)
				if rng.IntN(2) == 0 {
					n = 1
				}
				want := oracle.AllowN(now, int(n))
				tokens := oracle.TokensAt(now)
				d, err := lim.AllowN(ctx, "k", n)
				if err != nil {
					t.Fatalf("step %d: AllowN(%v, %d) error %v", step, now, n, err)
				}
				if d.Source != leaselimit.SourceAuthority {
					t.Fatalf("step %d: source %v", step, d.Source)
				}
				if d.Allowed != want {
					mismatch++
					t.Errorf("step %d: AllowN(%v, %d) = %v; x/time/rate %v (tokens %.9f)", step, now.Format(time.StampMicro), n, d.Allowed, want, tokens)
					continue
				}
				if wantRem := int64(math.Floor(tokens + 1e-9)); d.Remaining != wantRem {
					t.Errorf("step %d: remaining %d; want %d (%.9f)", step, d.Remaining, wantRem, tokens)
				}
				if !d.Allowed {
					wantRetry := time.Duration((float64(n) - tokens) / every * float64(time.Second))
					if diff := d.RetryAfter - wantRetry; diff < -time.Microsecond || diff > time.Microsecond {
						t.Errorf("step %d: retry-after %v; want %v", step, d.RetryAfter, wantRetry)
					}
				} else if d.RetryAfter != 0 {
					t.Errorf("step %d: allowed with retry-after %v", step, d.RetryAfter)
				}
				if mismatch > 5 {
					t.FailNow()
				}
			}
		})
	}
}

func TestBadInput(t *testing.T) {
	m, c := newMini(t)
	ctx := context.Background()
	lim := mustNew(t, c, policy.PerSecond(10))
	for _, tc := range []struct {
		key  string
		n    int64
		want error
	}{
		{"", 1, leaselimit.ErrInvalidKey},
		{strings.Repeat("x", leaselimit.MaxKeyLen+1), 1, leaselimit.ErrInvalidKey},
		{"k", 0, leaselimit.ErrInvalidCost},
		{"k", -1, leaselimit.ErrInvalidCost},
		{"k", 11, leaselimit.ErrInvalidCost},
		{"k", math.MaxInt64, leaselimit.ErrInvalidCost},
	} {
		if _, err := lim.AllowN(ctx, tc.key, tc.n); !errors.Is(err, tc.want) {
			t.Errorf("AllowN(%.10q, %d) = %v; want %v", tc.key, tc.n, err, tc.want)
		}
		if err := lim.WaitN(ctx, tc.key, tc.n); !errors.Is(err, tc.want) {
			t.Errorf("WaitN(%.10q, %d) = %v; want %v", tc.key, tc.n, err, tc.want)
		}
	}
	if keys := m.Keys(); len(keys) != 0 {
		t.Errorf("bad input wrote keys %v", keys)
	}
	for _, l := range []policy.Limit{
		{Name: "x", Rate: 0, Period: time.Second, Burst: 1},
		{Name: "x", Rate: 1, Period: 0, Burst: 1},
		{Name: "x", Rate: 1, Period: time.Second, Burst: 0},
		{Name: "x", Rate: -1, Period: time.Second, Burst: 1},
		{Name: "", Rate: 1, Period: time.Second, Burst: 1},
		{Name: "a{b}", Rate: 1, Period: time.Second, Burst: 1},
	} {
		if _, err := leaselimit.New(c, l); !errors.Is(err, policy.ErrInvalidLimit) {
			t.Errorf("New(%+v) = %v; want ErrInvalidLimit", l, err)
		}
	}
	if _, err := leaselimit.New(c, policy.PerSecond(1), leaselimit.WithPrefix("a{b")); err == nil {
		t.Error("New with prefix a{b: no error")
	}
	if _, err := leaselimit.New(nil, policy.PerSecond(1)); err == nil {
		t.Error("New(nil client): no error")
	}
	// A nil pointer of a client type is a non-nil interface: NewClient
	// panicked reading its options.
	var unset *redis.Client
	if _, err := leaselimit.NewClient(unset); err == nil {
		t.Error("NewClient((*redis.Client)(nil)): no error")
	}
	var unsetCluster *redis.ClusterClient
	if _, err := leaselimit.New(unsetCluster, policy.PerSecond(1)); err == nil {
		t.Error("New((*redis.ClusterClient)(nil)): no error")
	}
	// A zero value no constructor made panicked as a nil one did.
	if _, err := leaselimit.NewClient(new(redis.Client)); err == nil {
		t.Error("NewClient(new(redis.Client)): no error")
	}
	if _, err := leaselimit.New(new(redis.ClusterClient), policy.PerSecond(1)); err == nil {
		t.Error("New(new(redis.ClusterClient)): no error")
	}
	if keys := m.Keys(); len(keys) != 0 {
		t.Errorf("bad input wrote keys %v", keys)
	}
}

// TestNilContextAndReceiver: a nil ctx, or a method called on a nil
// *Limiter, *Reservation or *Client, gets a clear error and touches
// nothing, in both modes. A nil ctx used to panic, in a lease refill's
// singleflight as well as on the caller's goroutine.
func TestNilContextAndReceiver(t *testing.T) {
	m, c := newMini(t)
	var nilCtx context.Context
	ctx := context.Background()
	for i, mode := range []leaselimit.Option{leaselimit.WithoutLease(), nil} {
		lim := mustNew(t, c, policy.PerSecond(10).WithName(fmt.Sprint("nil", i)), mode)
		calls := map[string]func() error{
			"Allow":  func() error { _, err := lim.Allow(nilCtx, "k"); return err },
			"AllowN": func() error { _, err := lim.AllowN(nilCtx, "k", 2); return err },
			"Wait":   func() error { return lim.Wait(nilCtx, "k") },
			"WaitN":  func() error { return lim.WaitN(nilCtx, "k", 2) },
			"Peek":   func() error { _, err := lim.Peek(nilCtx, "k"); return err },
			"Reset":  func() error { return lim.Reset(nilCtx, "k") },
			"Check":  func() error { return lim.Check(nilCtx) },
			"Reserve": func() error {
				r, err := lim.Reserve(nilCtx, "k", 1)
				if r != nil {
					t.Errorf("mode %d: Reserve(nil ctx) returned a Reservation", i)
				}
				return err
			},
		}
		for name, call := range calls {
			if err := call(); !errors.Is(err, leaselimit.ErrNilContext) {
				t.Errorf("mode %d: %s(nil ctx) = %v; want ErrNilContext", i, name, err)
			}
		}
		if keys := m.Keys(); len(keys) != 0 {
			t.Fatalf("mode %d: calls with a nil ctx wrote keys %v", i, keys)
		}
		// Settle with a nil ctx settles as with context.Background(): a
		// deferred Settle whose error is ignored must not drop an excess.
		// Its surplus comes back (a bucket of 10 an hour: no refill to
		// speak of during the test).
		hourly := mustNew(t, c, policy.PerHour(10).WithName(fmt.Sprint("nilsettle", i)), mode)
		r, err := hourly.Reserve(ctx, "s", 5)
		if err != nil || !r.Decision().Allowed {
			t.Fatalf("mode %d: Reserve = %+v, %v", i, r, err)
		}
		if err := r.Settle(nilCtx, 1); err != nil {
			t.Errorf("mode %d: Settle(nil ctx) = %v; want it settled", i, err)
		}
		if d, err := hourly.AllowN(ctx, "s", 9); err != nil || !d.Allowed {
			t.Errorf("mode %d: AllowN(9) after settling 1 of 5 with a nil ctx = %+v, %v; want admitted (the surplus back)", i, d, err)
		}
		if d, err := hourly.AllowN(ctx, "s", 1); err != nil || d.Allowed {
			t.Errorf("mode %d: AllowN(1) on a spent bucket = %+v, %v; want denied", i, d, err)
		}
		m.FlushAll() // the next mode's nil calls must find no key
	}

	var nilLim *leaselimit.Limiter
	for name, call := range map[string]func() error{
		"Allow":   func() error { _, err := nilLim.Allow(ctx, "k"); return err },
		"Wait":    func() error { return nilLim.Wait(ctx, "k") },
		"Peek":    func() error { _, err := nilLim.Peek(ctx, "k"); return err },
		"Reset":   func() error { return nilLim.Reset(ctx, "k") },
		"Check":   func() error { return nilLim.Check(ctx) },
		"Reserve": func() error { _, err := nilLim.Reserve(ctx, "k", 1); return err },
	} {
		if err := call(); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("(*Limiter)(nil).%s = %v; want an error wrapping ErrClosed", name, err)
		}
	}
	// A zero Limiter (no constructor made it) is as a nil one, and so are
	// its accessors and views.
	zeroLim := new(leaselimit.Limiter)
	for name, l := range map[string]*leaselimit.Limiter{"nil": nilLim, "zero": zeroLim, "zero's view": zeroLim.With(leaselimit.WithShadow())} {
		if _, err := l.Allow(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("a %s Limiter's Allow = %v; want an error wrapping ErrClosed", name, err)
		}
		if lim := l.Limit(); lim != (policy.Limit{}) || l.Limits() != nil {
			t.Errorf("a %s Limiter's Limit = %v, Limits = %v; want none", name, lim, l.Limits())
		}
		for view, v := range map[string]*leaselimit.Limiter{"For": l.For(policy.PerSecond(1).WithName("f")), "Enforcing": l.Enforcing(0.5)} {
			if _, err := v.Allow(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
				t.Errorf("a %s Limiter's %s: Allow = %v; want an error wrapping ErrClosed", name, view, err)
			}
		}
		if st, n := l.BreakerState(), l.LocalKeys(); st != breaker.Open || n != 0 {
			t.Errorf("a %s Limiter's BreakerState, LocalKeys = %v, %d; want open, 0", name, st, n)
		}
	}
	if d := (*leaselimit.Reservation)(nil).Decision(); d.Source != leaselimit.SourceNone {
		t.Errorf("a nil Reservation's Decision = %+v; want that of an error", d)
	}
	for name, r := range map[string]*leaselimit.Reservation{"nil": nil, "zero": new(leaselimit.Reservation)} {
		if err := r.Settle(ctx, 1); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("a %s Reservation's Settle = %v; want an error wrapping ErrClosed", name, err)
		}
		if err := r.Cancel(ctx); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("a %s Reservation's Cancel = %v; want an error wrapping ErrClosed", name, err)
		}
	}
	var nilClient *leaselimit.Client
	for name, cl := range map[string]*leaselimit.Client{"nil": nilClient, "zero": new(leaselimit.Client)} {
		if err := cl.Check(ctx); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("a %s Client's Check = %v; want an error wrapping ErrClosed", name, err)
		}
		if _, err := cl.Limiter(policy.PerSecond(1).WithName("z")).Allow(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("a %s Client's Limiter: Allow = %v; want an error wrapping ErrClosed", name, err)
		}
		if err := cl.Close(); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("a %s Client's Close = %v; want an error wrapping ErrClosed", name, err)
		}
		if st, n := cl.BreakerState(), cl.LocalKeys(); st != breaker.Open || n != 0 {
			t.Errorf("a %s Client's BreakerState, LocalKeys = %v, %d; want open, 0", name, st, n)
		}
	}
	cl, err := leaselimit.NewClient(c)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.Check(nilCtx); !errors.Is(err, leaselimit.ErrNilContext) {
		t.Errorf("Client.Check(nil ctx) = %v; want ErrNilContext", err)
	}
}

// TestLongestLeaseTTL: a lease of MaxLeaseTTL lives, and one longer is
// refused. A TTL near math.MaxInt64 overflowed the lease's expiry, and
// every lease expired as it was granted, silently: each decision went to
// Redis and leases took tokens they never spent.
func TestLongestLeaseTTL(t *testing.T) {
	_, c := newMini(t)
	calls := countCalls(c)
	ctx := context.Background()
	longest := policy.Lease{TTL: policy.MaxLeaseTTL, IdleTTL: policy.MaxLeaseTTL}
	lim := mustNew(t, c, policy.PerHour(1000).WithName("longttl"), leaselimit.WithLease(longest))
	before := calls.n.Load()
	admitted := 0
	for range 2000 {
		d, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed {
			admitted++
		}
	}
	// 1000/hour: at most a token more refills during the loop.
	if admitted < 999 || admitted > 1001 {
		t.Errorf("admitted %d of 2000 on a bucket of 1000; want about 1000", admitted)
	}
	// Leases that live serve most decisions locally: an expired lease
	// would send every one to Redis (a script call each, and more).
	if n := calls.n.Load() - before; n > 400 {
		t.Errorf("%d Redis commands for 2000 decisions: leases of MaxLeaseTTL do not live", n)
	}
	tooLong := policy.Lease{TTL: policy.MaxLeaseTTL + time.Nanosecond, IdleTTL: math.MaxInt64}
	if _, err := leaselimit.New(c, policy.PerHour(1000).WithName("toolong"), leaselimit.WithLease(tooLong)); !errors.Is(err, policy.ErrInvalidLimit) {
		t.Errorf("New with a lease TTL above MaxLeaseTTL = %v; want ErrInvalidLimit", err)
	}
}

func TestOddKeys(t *testing.T) {
	_, c := newMini(t)
	ctx := context.Background()
	for i, mode := range []leaselimit.Option{leaselimit.WithoutLease(), nil} {
		lim := mustNew(t, c, policy.PerMinute(2).WithName(fmt.Sprint("mode", i)), mode)
		keys := []string{"{}", "{a}", "a}{b", "\x00\x01\n\r", "\xff\xfe invalid utf8", strings.Repeat("k", leaselimit.MaxKeyLen), "日本語"}
		for _, k := range keys {
			for i := 0; i < 3; i++ {
				d, err := lim.Allow(ctx, k)
				if err != nil {
					t.Fatalf("Allow(%.12q) #%d: %v", k, i, err)
				}
				if d.Allowed != (i < 2) {
					t.Errorf("Allow(%.12q) #%d allowed=%v; want %v (%+v)", k, i, d.Allowed, i < 2, d)
				}
			}
		}
	}
}

func TestClosed(t *testing.T) {
	_, c := newMini(t)
	lim, err := leaselimit.New(c, policy.PerSecond(10))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lim.Allow(context.Background(), "k"); err != nil {
		t.Fatal(err)
	}
	if err := lim.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := lim.Allow(context.Background(), "k"); !errors.Is(err, leaselimit.ErrClosed) {
		t.Errorf("Allow after Close = %v; want ErrClosed", err)
	}
	if err := lim.Wait(context.Background(), "k"); !errors.Is(err, leaselimit.ErrClosed) {
		t.Errorf("Wait after Close = %v; want ErrClosed", err)
	}
	if err := lim.Close(); !errors.Is(err, leaselimit.ErrClosed) {
		t.Errorf("second Close = %v; want ErrClosed", err)
	}
}

func TestWaitFailsFast(t *testing.T) {
	_, c := newMini(t)
	lim := mustNew(t, c, policy.PerMinute(1), leaselimit.WithoutLease())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := lim.Wait(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err := lim.Wait(ctx, "k")
	if !errors.Is(err, leaselimit.ErrWouldExceedDeadline) {
		t.Fatalf("Wait = %v; want ErrWouldExceedDeadline", err)
	}
	if el := time.Since(start); el > 4*time.Second {
		t.Errorf("Wait took %v; it should fail without waiting", el)
	}
}

// TestWaitEndsOnClose: a WaitN asleep until tokens are due returns
// ErrClosed when the Client (or a Limiter of its own) is closed, not when
// its sleep ends: a wait can last until a quota's window ends. Regression
// (a review): Wait returned 10s after Close, when its RetryAfter was up.
func TestWaitEndsOnClose(t *testing.T) {
	for _, viaClient := range []bool{true, false} {
		_, c := newMini(t)
		limit := policy.PerMinute(1).WithName("waitclose")
		var lim *leaselimit.Limiter
		var closeIt func() error
		if viaClient {
			client, err := leaselimit.NewClient(c, leaselimit.WithoutLease())
			if err != nil {
				t.Fatal(err)
			}
			lim, closeIt = client.Limiter(limit), client.Close
		} else {
			lim = mustNew(t, c, limit, leaselimit.WithoutLease())
			closeIt = lim.Close
		}
		ctx := context.Background()
		if err := lim.Wait(ctx, "k"); err != nil {
			t.Fatal(err)
		}
		waited := make(chan error, 1)
		go func() { waited <- lim.Wait(ctx, "k") }() // the next token is due in a minute
		select {
		case err := <-waited:
			t.Fatalf("Wait on a spent bucket returned %v at once; want it asleep", err)
		case <-time.After(100 * time.Millisecond):
		}
		start := time.Now()
		if err := closeIt(); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-waited:
			if !errors.Is(err, leaselimit.ErrClosed) {
				t.Errorf("via client %v: Wait after Close = %v; want ErrClosed", viaClient, err)
			}
			t.Logf("via client %v: Wait returned %v after Close", viaClient, time.Since(start).Round(time.Millisecond))
		case <-time.After(20 * time.Second):
			t.Fatalf("via client %v: Wait still asleep 20s after Close (its token due in a minute)", viaClient)
		}
	}
}

func redisClient(t *testing.T, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	return c
}

func redisClientOpts(t *testing.T, o *redis.Options) *redis.Client {
	t.Helper()
	c := redis.NewClient(o)
	t.Cleanup(func() { c.Close() })
	return c
}

// TestErrorDecisionSource: a Decision returned with an error says so
// (SourceNone), so it cannot be mistaken for a lease decision. Regression:
// it carried the zero Source, "lease".
func TestErrorDecisionSource(t *testing.T) {
	_, c := newMini(t)
	ctx := context.Background()
	lim := mustNew(t, c, policy.PerSecond(10).WithName("errsrc"))
	for name, call := range map[string]func() (leaselimit.Decision, error){
		"empty key":   func() (leaselimit.Decision, error) { return lim.Allow(ctx, "") },
		"cost 0":      func() (leaselimit.Decision, error) { return lim.AllowN(ctx, "k", 0) },
		"over burst":  func() (leaselimit.Decision, error) { return lim.AllowN(ctx, "k", 11) },
		"after Close": func() (leaselimit.Decision, error) { _ = lim.Close(); return lim.Allow(ctx, "k") },
	} {
		d, err := call()
		if err == nil {
			t.Errorf("%s: no error", name)
			continue
		}
		if d.Source != leaselimit.SourceNone || d.Source.String() != "none" || d.Allowed {
			t.Errorf("%s: Decision %+v with error %v; want Source none", name, d, err)
		}
	}
}

// TestEmptyPrefixRefused: WithPrefix("") is an error, as its doc says
// (1 to 64 bytes). Regression: it was accepted.
func TestEmptyPrefixRefused(t *testing.T) {
	_, c := newMini(t)
	if _, err := leaselimit.New(c, policy.PerSecond(1), leaselimit.WithPrefix("")); !errors.Is(err, authority.ErrPrefix) {
		t.Errorf("New with WithPrefix(\"\") = %v; want an error wrapping authority.ErrPrefix", err)
	}
}

// fakeClock is a Clock moved by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func (c *fakeClock) Set(t time.Time) {
	c.mu.Lock()
	c.now = t
	c.mu.Unlock()
}

// TestEndedContextMakesNoCall: a decision that needs Redis, asked with a
// ctx that has ended already, returns ctx's error every time and makes no
// call. Regression: the call was made, and its reply raced ctx.Done.
func TestEndedContextMakesNoCall(t *testing.T) {
	m, c := newMini(t)
	calls := countCalls(c)
	lim := mustNew(t, c, policy.PerSecond(1000).WithName("ended"), leaselimit.WithoutLease())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	before := m.TotalConnectionCount()
	for i := range 50 {
		if d, err := lim.Allow(ctx, "k"+strconv.Itoa(i)); !errors.Is(err, context.Canceled) {
			t.Fatalf("Allow #%d with an ended ctx = %+v, %v; want context.Canceled", i, d, err)
		}
	}
	if err := lim.Close(); err != nil { // waits for calls in flight
		t.Fatal(err)
	}
	if got := calls.n.Load(); got != 0 {
		t.Errorf("%d Redis commands for decisions whose ctx had ended; want 0 (connections %d → %d)", got, before, m.TotalConnectionCount())
	}
}

// TestBatchReplyOutlivesResends: a batch's stored reply lives as long as
// go-redis may resend the batch, six budgets and a second. Regression: it
// lived 5s whatever the budget, and with a budget of 1.5s and replies
// slower than go-redis's read timeout, a batch resent 5s after its first
// run took its tokens twice (one AllowN(1) debited 2).
func TestBatchReplyOutlivesResends(t *testing.T) {
	mr, rdb := newMini(t)
	ctx := context.Background()
	for _, c := range []struct {
		budget   time.Duration
		min, max time.Duration
	}{
		{leaselimit.DefaultTimeout, 4 * time.Second, 5 * time.Second},
		{1500 * time.Millisecond, 10 * time.Second, 10 * time.Second},
		{leaselimit.MaxTimeout, 61 * time.Second, 61 * time.Second},
	} {
		prefix := "budget" + strconv.Itoa(int(c.budget.Milliseconds()))
		cl := mustClient(t, rdb, leaselimit.WithTimeout(c.budget), leaselimit.WithPrefix(prefix), leaselimit.WithoutLease())
		if d, err := cl.Limiter(policy.PerMinute(5)).Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("budget %v: Allow = %+v, %v", c.budget, d, err)
		}
		seen := 0
		for _, k := range mr.Keys() {
			if !strings.HasPrefix(k, prefix+":batch:") {
				continue
			}
			seen++
			if ttl := mr.TTL(k); ttl < c.min || ttl > c.max {
				t.Errorf("budget %v: the batch's reply lives %v; want %v to %v", c.budget, ttl, c.min, c.max)
			}
		}
		if seen != 1 {
			t.Errorf("budget %v: %d batch keys; want 1", c.budget, seen)
		}
	}
}

// TestDoneContext: ctx bounds the wait for Redis. A key whose decision
// needs Redis is answered with ctx's error; one decided from its lease is
// decided, as the AllowN documentation says (a new user's trial asked).
func TestDoneContext(t *testing.T) {
	_, c := newMini(t)
	lim := mustNew(t, c, policy.Limit{Name: "done-ctx", Rate: 1000, Period: time.Second, Burst: 1000})
	done, cancel := context.WithCancel(context.Background())
	cancel()
	if d, err := lim.Allow(done, "cold"); !errors.Is(err, context.Canceled) || d.Allowed {
		t.Errorf("a key not seen yet, ctx done: Allow = %+v, %v; want context.Canceled", d, err)
	}
	// A key in use: each call with ctx done is decided from the lease, or,
	// when the lease ran dry just then, answered with ctx's error.
	leased := 0
	for i := 0; i < 200 && leased < 5; i++ {
		if d, err := lim.Allow(context.Background(), "warm"); err != nil || !d.Allowed {
			t.Fatalf("Allow = %+v, %v", d, err)
		}
		d, err := lim.Allow(done, "warm")
		switch {
		case err == nil && d.Allowed && d.Source == leaselimit.SourceLease:
			leased++
		case !errors.Is(err, context.Canceled):
			t.Fatalf("a key in use, ctx done: Allow = %+v, %v; want admitted from the lease, or context.Canceled", d, err)
		}
	}
	if leased < 5 {
		t.Errorf("a key in use, ctx done: %d of 200 decided from the lease; want 5", leased)
	}
}
