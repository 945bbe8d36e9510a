package leaselimit_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// mustClient returns a Client on c, closed when the test ends, with the
// generous budget of mustNew unless opts say otherwise.
func mustClient(t *testing.T, c redis.UniversalClient, opts ...leaselimit.Option) *leaselimit.Client {
	t.Helper()
	opts = append([]leaselimit.Option{leaselimit.WithTimeout(10 * time.Second)}, opts...)
	cl, err := leaselimit.NewClient(c, opts...)
	if err != nil {
		t.Fatalf("NewClient = %v", err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	return cl
}

// TestViewsFailurePolicies: views on one Client each follow their own
// failure policy during an outage (a login limit fails closed while a
// product limit fails open and a search limit runs its local share), all
// with Source == SourceFallback and no error; the default view of the
// login limit still fails open (NewClient's default), and several limits
// together fail as their view says.
func TestViewsFailurePolicies(t *testing.T) {
	mostlyWaits(t)
	m, rdb := newMini(t)
	c := mustClient(t, rdb, leaselimit.WithTimeout(time.Second), leaselimit.WithFleetSize(2),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}))
	ctx := context.Background()
	loginLimit := policy.PerMinute(5).WithName("login")
	searchLimit := policy.PerMinute(4).WithName("search") // a share of 2 on each of 2 instances
	product := c.Limiter(policy.PerMinute(5).WithName("product"))
	login := c.Limiter(loginLimit).With(leaselimit.WithFailureMode(policy.FailClosed))
	search := c.Limiter(searchLimit).With(leaselimit.WithFailureMode(policy.FailLocal))
	both := c.Limiter(loginLimit, searchLimit).With(leaselimit.WithFailureMode(policy.FailClosed))
	for _, l := range []*leaselimit.Limiter{product, login, search, both} {
		if d, err := l.Allow(ctx, "warm"); err != nil || !d.Allowed || d.Source != leaselimit.SourceAuthority {
			t.Fatalf("%v: Allow with Redis up = %+v, %v", l.Limits(), d, err)
		}
	}
	if c.Limiter(loginLimit) == login {
		t.Fatal("With returned the default view itself")
	}

	m.Close() // the outage; keys not seen before hold no lease
	fallback := func(name string, l *leaselimit.Limiter, key string, allowed bool) leaselimit.Decision {
		t.Helper()
		d, err := l.Allow(ctx, key)
		if err != nil || d.Source != leaselimit.SourceFallback || d.Allowed != allowed {
			t.Fatalf("%s during the outage: Allow(%q) = %+v, %v; want allowed=%v from the fallback", name, key, d, err, allowed)
		}
		return d
	}
	for i := range 8 { // past every limit: the policy, not the bucket, decides
		fallback("product (FailOpen)", product, "u", true)
		if d := fallback("login (FailClosed)", login, "u", false); d.RetryAfter <= 0 {
			t.Fatalf("login's denial #%d has no RetryAfter: %+v", i+1, d)
		}
		fallback("login's default view (FailOpen)", c.Limiter(loginLimit), "u", true)
		fallback("login+search (FailClosed)", both, "u", false)
	}
	for i := range 3 { // FailLocal: this instance's share, 2 of the 4
		fallback("search (FailLocal)", search, "u", i < 2)
	}
	if s := c.BreakerState(); s != breaker.Open {
		t.Errorf("BreakerState during the outage = %v; want open", s)
	}
}

// TestWithRejectsClientOptions: With takes the view options only; any
// other option (or an invalid view option) gives a Limiter whose every
// call returns an error naming it, without a panic and without touching
// the view it was made from.
func TestWithRejectsClientOptions(t *testing.T) {
	_, rdb := newMini(t)
	c := mustClient(t, rdb)
	ctx := context.Background()
	base := c.Limiter(policy.PerMinute(10).WithName("with"))
	for _, tc := range []struct {
		opt  leaselimit.Option
		name string
	}{
		{leaselimit.WithTimeout(time.Second), "WithTimeout"},
		{leaselimit.WithPrefix("other"), "WithPrefix"},
		{leaselimit.WithoutLease(), "WithoutLease"},
		{leaselimit.WithMaxKeys(10), "WithMaxKeys"},
		{leaselimit.WithFleetSize(3), "WithFleetSize"},
		{leaselimit.WithEnforce(2), "WithEnforce"},
		{leaselimit.WithFailureMode(policy.FailureMode(99)), ""},
	} {
		v := base.With(leaselimit.WithShadow(), tc.opt, nil)
		_, err := v.Allow(ctx, "k")
		if err == nil || errors.Is(err, leaselimit.ErrClosed) || !strings.Contains(err.Error(), tc.name) {
			t.Errorf("With(%s): Allow error = %v; want one naming the option", tc.name, err)
		}
		if _, err2 := v.Peek(ctx, "k"); err2 == nil || err2.Error() != err.Error() {
			t.Errorf("With(%s): Peek error = %v; want %v", tc.name, err2, err)
		}
		if err2 := v.Reset(ctx, "k"); err2 == nil {
			t.Errorf("With(%s): Reset returned no error", tc.name)
		}
		if r, err2 := v.Reserve(ctx, "k", 1); err2 == nil || r != nil {
			t.Errorf("With(%s): Reserve = %v, %v; want the error", tc.name, r, err2)
		}
		if err2 := v.Wait(ctx, "k"); err2 == nil {
			t.Errorf("With(%s): Wait returned no error", tc.name)
		}
		if _, err2 := v.With(leaselimit.WithShadow()).Allow(ctx, "k"); err2 == nil {
			t.Errorf("With(%s).With(WithShadow()) lost the error", tc.name)
		}
	}
	if d, err := base.Allow(ctx, "k"); err != nil || !d.Allowed || d.Shadow {
		t.Errorf("the view With was called on: Allow = %+v, %v; want an enforced admission", d, err)
	}
	if d, err := base.With(leaselimit.WithShadow()).Allow(ctx, "k"); err != nil || !d.Shadow {
		t.Errorf("With(WithShadow()).Allow = %+v, %v; want a shadow decision", d, err)
	}
}

// TestViewAllowDoesNotAllocate: a view's Allow that a lease serves
// allocates nothing, With's view as the default one, and so does looking
// a known limit up with Client.Limiter on the way.
func TestViewAllowDoesNotAllocate(t *testing.T) {
	_, rdb := newMini(t)
	// Long, large leases without prefetch: the measured calls are lease
	// hits, whatever the machine's speed.
	c := mustClient(t, rdb, leaselimit.WithLease(policy.Lease{TTL: time.Hour, IdleTTL: 2 * time.Hour, Horizon: time.Hour, Prefetch: -1}))
	ctx := context.Background()
	limit := policy.PerSecond(1_000_000).WithName("allocs")
	view := c.Limiter(limit).With(leaselimit.WithFailureMode(policy.FailClosed))
	other := c.Limiter(policy.PerSecond(1_000_000).WithName("other"))
	c.Limiter(limit, other.Limit()) // a known set of two
	warm := func(l *leaselimit.Limiter) {
		t.Helper()
		for i := 0; i < 5000; i++ {
			if _, err := l.Allow(ctx, "hot"); err != nil {
				t.Fatal(err)
			}
		}
		if d, err := l.Allow(ctx, "hot"); err != nil || d.Source != leaselimit.SourceLease {
			t.Fatalf("%v after warming: %+v, %v; want a lease hit", l.Limits(), d, err)
		}
	}
	warm(view)
	warm(other)
	var misses int
	for name, f := range map[string]func(){
		"With's view": func() {
			if d, _ := view.Allow(ctx, "hot"); d.Source != leaselimit.SourceLease {
				misses++
			}
		},
		"Client.Limiter(known).Allow": func() {
			c.Limiter(limit, other.Limit())
			if d, _ := c.Limiter(other.Limit()).Allow(ctx, "hot"); d.Source != leaselimit.SourceLease {
				misses++
			}
		},
	} {
		misses = 0
		if n := testing.AllocsPerRun(1000, f); n != 0 {
			t.Errorf("%s: %.1f allocations per lease hit; want 0", name, n)
		}
		if misses > 0 {
			t.Errorf("%s: %d of 1000 calls were not lease hits", name, misses)
		}
	}
}
