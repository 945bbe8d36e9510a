package leaselimit_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// TestClientCloseClosesEveryView: Close of the Client closes every
// Limiter it made (one limit, several, views from With, and Limiters asked
// for after Close): each call returns ErrClosed, and so do Check and a
// second Close; the Client's goroutines are gone. Before that, the
// deprecated Close of a view refuses and closes nothing.
func TestClientCloseClosesEveryView(t *testing.T) {
	leaks := goleak.IgnoreCurrent()
	m, err := miniredis.Run()
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	ctx := context.Background()
	c, err := leaselimit.NewClient(rdb, leaselimit.WithTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Check(ctx); err != nil {
		t.Fatalf("Check = %v", err)
	}
	a := policy.PerMinute(100).WithName("a")
	b := policy.PerHour(1000).WithName("b")
	views := []*leaselimit.Limiter{
		c.Limiter(a),
		c.Limiter(a, b),
		c.Limiter(b).With(leaselimit.WithFailureMode(policy.FailClosed)),
		c.Limiter(a).With(leaselimit.WithShadow()),
	}
	for _, v := range views {
		if d, err := v.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("%v: Allow = %+v, %v", v.Limits(), d, err)
		}
		if err := v.Close(); err == nil || errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("%v: Close of a view = %v; want an error saying to close the Client", v.Limits(), err)
		}
	}
	if n := c.LocalKeys(); n == 0 {
		t.Error("LocalKeys = 0 after decisions")
	}
	if s := c.BreakerState(); s != breaker.Closed {
		t.Errorf("BreakerState = %v; want closed", s)
	}

	if err := c.Close(); err != nil {
		t.Fatalf("Close = %v", err)
	}
	for _, v := range append(views, c.Limiter(a), c.Limiter(policy.PerSecond(7).WithName("after"))) {
		if _, err := v.Allow(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("%v: Allow after Close = %v; want ErrClosed", v.Limits(), err)
		}
		if err := v.Wait(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("%v: Wait after Close = %v; want ErrClosed", v.Limits(), err)
		}
		if _, err := v.Peek(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("%v: Peek after Close = %v; want ErrClosed", v.Limits(), err)
		}
		if err := v.Reset(ctx, "k"); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("%v: Reset after Close = %v; want ErrClosed", v.Limits(), err)
		}
		if _, err := v.Reserve(ctx, "k", 1); !errors.Is(err, leaselimit.ErrClosed) {
			t.Errorf("%v: Reserve after Close = %v; want ErrClosed", v.Limits(), err)
		}
	}
	if err := c.Check(ctx); !errors.Is(err, leaselimit.ErrClosed) {
		t.Errorf("Check after Close = %v; want ErrClosed", err)
	}
	if s := c.BreakerState(); s != breaker.Open {
		t.Errorf("BreakerState after Close = %v; want open: no call reaches Redis", s)
	}
	if s := views[0].BreakerState(); s != breaker.Open {
		t.Errorf("a Limiter's BreakerState after Close = %v; want open", s)
	}
	if err := c.Close(); !errors.Is(err, leaselimit.ErrClosed) {
		t.Errorf("second Close = %v; want ErrClosed", err)
	}
	rdb.Close()
	m.Close()
	goleak.VerifyNone(t, leaks)
}

// TestNewClientErrors: NewClient says what is wrong with its input.
func TestNewClientErrors(t *testing.T) {
	_, rdb := newMini(t)
	if _, err := leaselimit.NewClient(nil); err == nil {
		t.Error("NewClient(nil) returned no error")
	}
	// Each error names its option and wraps ErrInvalidOption. Regression:
	// WithFailureMode(9) said "policy: invalid limit: unknown failure
	// mode 9", and a lease TTL above the default IdleTTL blamed an
	// IdleTTL the user never set.
	for _, c := range []struct {
		o    leaselimit.Option
		says []string
	}{
		{leaselimit.WithTimeout(0), []string{"WithTimeout"}},
		// Regression: 1ns was taken, and every decision then went to the
		// failure policy.
		{leaselimit.WithTimeout(time.Millisecond - 1), []string{"WithTimeout", "MinTimeout"}},
		{leaselimit.WithTimeout(leaselimit.MaxTimeout + 1), []string{"WithTimeout", "MaxTimeout"}},
		{leaselimit.WithPrefix("a b"), []string{"WithPrefix"}},
		{leaselimit.WithEnforce(-1), []string{"WithEnforce"}},
		{leaselimit.WithFailureMode(policy.FailureMode(99)), []string{"WithFailureMode", "99"}},
		{leaselimit.WithMaxKeys(0), []string{"WithMaxKeys"}},
		{leaselimit.WithLease(policy.Lease{TTL: time.Minute}), []string{"WithLease", "TTL 1m0s", "default", "set IdleTTL"}},
		{leaselimit.WithLease(policy.Lease{TTL: policy.MaxLeaseTTL + 1, IdleTTL: math.MaxInt64}), []string{"WithLease", "MaxLeaseTTL"}},
		{leaselimit.WithFleetSize(leaselimit.MaxFleetSize + 1), []string{"WithFleetSize", "MaxFleetSize"}},
		{leaselimit.WithFleetSize(math.MaxInt), []string{"WithFleetSize", "MaxFleetSize"}},
		{leaselimit.WithBreaker(breaker.Settings{OpenFor: breaker.MaxOpenFor + 1}), []string{"WithBreaker", "MaxOpenFor"}},
	} {
		cl, err := leaselimit.NewClient(rdb, c.o)
		if err == nil {
			cl.Close()
			t.Errorf("NewClient with an invalid option returned no error (want one saying %q)", c.says)
			continue
		}
		if !errors.Is(err, leaselimit.ErrInvalidOption) {
			t.Errorf("NewClient: %v; want it to wrap ErrInvalidOption", err)
		}
		for _, w := range c.says {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("NewClient: %q; want it to say %q", err, w)
			}
		}
		if strings.Count(err.Error(), "leaselimit:") > 1 {
			t.Errorf("NewClient: %q; want the package named once", err)
		}
	}
	// WithLease and WithoutLease contradict each other, in either order:
	// the later silently undid the earlier (leases after all, or lease
	// settings dropped).
	for _, pair := range [][]leaselimit.Option{
		{leaselimit.WithoutLease(), leaselimit.WithLease(policy.Lease{})},
		{leaselimit.WithLease(policy.Lease{}), leaselimit.WithoutLease()},
	} {
		cl, err := leaselimit.NewClient(rdb, pair...)
		if err == nil {
			cl.Close()
			t.Error("NewClient with WithLease and WithoutLease: no error")
			continue
		}
		if !errors.Is(err, leaselimit.ErrInvalidOption) || !strings.Contains(err.Error(), "WithLease and WithoutLease") {
			t.Errorf("NewClient with WithLease and WithoutLease: %v", err)
		}
	}
}

// TestClientLimiterInvalid: limits that cannot be enforced (invalid, given
// twice, more than MaxLimits) give a Limiter whose calls return
// policy.ErrInvalidLimit and name the limits.
func TestClientLimiterInvalid(t *testing.T) {
	_, rdb := newMini(t)
	c := mustClient(t, rdb)
	ctx := context.Background()
	a := policy.PerMinute(10).WithName("a")
	bad := policy.Limit{Name: "bad", Rate: 0, Period: time.Second, Burst: 1}
	for _, l := range []*leaselimit.Limiter{
		c.Limiter(bad),
		c.Limiter(a, bad),
		c.Limiter(a, a),
		c.Limiter(a, a.WithName("b"), a.WithName("c"), a.WithName("d"), a.WithName("e")),
	} {
		if _, err := l.Allow(ctx, "k"); !errors.Is(err, policy.ErrInvalidLimit) {
			t.Errorf("%v: Allow = %v; want ErrInvalidLimit", l.Limits(), err)
		}
		if _, err := l.Reserve(ctx, "k", 1); !errors.Is(err, policy.ErrInvalidLimit) {
			t.Errorf("%v: Reserve = %v; want ErrInvalidLimit", l.Limits(), err)
		}
		if _, err := l.With(leaselimit.WithShadow()).Peek(ctx, "k"); !errors.Is(err, policy.ErrInvalidLimit) {
			t.Errorf("%v: With(…).Peek = %v; want ErrInvalidLimit", l.Limits(), err)
		}
		if l.Limit() != l.Limits()[0] {
			t.Errorf("Limit() = %v, Limits() = %v", l.Limit(), l.Limits())
		}
	}
}
