package httplimit_test

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/policy"
)

// downLimiter is a real Limiter for l under mode, with 2 instances in the
// fleet, whose Redis has gone away.
func downLimiter(t *testing.T, l policy.Limit, mode policy.FailureMode, opts ...leaselimit.Option) *leaselimit.Limiter {
	t.Helper()
	return downClient(t, mode, opts...).Limiter(l)
}

// downClient is the Client of downLimiter: its Limiters' failure policy
// is mode, FleetSize 2, and Redis is down.
func downClient(t *testing.T, mode policy.FailureMode, opts ...leaselimit.Option) *leaselimit.Client {
	t.Helper()
	mr, rdb := newRedis(t)
	opts = append([]leaselimit.Option{leaselimit.WithFailureMode(mode), leaselimit.WithFleetSize(2),
		leaselimit.WithTimeout(200 * time.Millisecond)}, opts...)
	c := newClient(t, rdb, opts...)
	mr.Close()
	return c
}

// wantOutage checks resp is the default outage response: 503 with a
// temporary-reduced-capacity problem naming the policy, Retry-After,
// RateLimit-Policy, and neither a RateLimit member nor a legacy field.
func wantOutage(t *testing.T, resp *http.Response, policyField string, retryAfter int64) {
	t.Helper()
	p, _ := readProblem(t, resp, http.StatusServiceUnavailable)
	if p.Type != httplimit.ProblemTypeTemporaryReducedCapacity {
		t.Errorf("problem type %q, want %q", p.Type, httplimit.ProblemTypeTemporaryReducedCapacity)
	}
	if len(p.Violated) != 0 {
		t.Errorf("violated-policies %q during an outage; no quota was exceeded", p.Violated)
	}
	if ra := intHeader(t, resp, "Retry-After"); ra != retryAfter {
		t.Errorf("Retry-After %d, want %d", ra, retryAfter)
	}
	if !strings.Contains(p.Detail, strconv.Itoa(int(retryAfter))+" s") {
		t.Errorf("detail %q does not say when to retry", p.Detail)
	}
	if got := resp.Header.Get(httplimit.HeaderRateLimitPolicy); got != policyField {
		t.Errorf("RateLimit-Policy %q, want %q", got, policyField)
	}
	members(t, resp, httplimit.HeaderRateLimitPolicy)
	for _, f := range []string{httplimit.HeaderRateLimit, "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"} {
		if v := resp.Header.Values(f); len(v) != 0 {
			t.Errorf("%s %q on an outage response: nothing is known of the key's bucket", f, v)
		}
	}
}

// TestOutage: with Redis down, FailClosed's denials get 503 with
// Retry-After, FailLocal's denials (above this instance's share) too,
// FailOpen admits with the headers it always had.
func TestOutage(t *testing.T) {
	l := policy.PerMinute(4).WithName("api")
	const policyField = `"api";q=4;w=60`

	t.Run("closed", func(t *testing.T) {
		lim := downLimiter(t, l, policy.FailClosed)
		next := &okHandler{}
		h := httplimit.Middleware(lim, constKey("k"), httplimit.WithLegacyHeaders())(next)
		for i := 0; i < 3; i++ {
			// RetryAfter is until the breaker's probe (250 ms open), at
			// least the 200 ms budget: 1 s.
			wantOutage(t, get(h), policyField, 1)
		}
		if next.count() != 0 {
			t.Errorf("handler ran %d times with FailClosed and Redis down", next.count())
		}
	})

	t.Run("local", func(t *testing.T) {
		clk := &stepClock{t: frozen}
		lim := downLimiter(t, l, policy.FailLocal, withClock(clk))
		next := &okHandler{}
		h := httplimit.Middleware(lim, constKey("k"))(next)
		// FleetSize 2: this instance admits half the limit, 2 per minute.
		for i, rem := range []int64{1, 0} {
			resp := get(h)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("request %d: status %d", i, resp.StatusCode)
			}
			if rl := members(t, resp, httplimit.HeaderRateLimit); rl[0].a != rem {
				t.Errorf("request %d: RateLimit %v, want r=%d (the share's)", i, rl, rem)
			}
		}
		// The share's next token is 30 s away.
		wantOutage(t, get(h), policyField, 30)
		clk.set(frozen.Add(30 * time.Second))
		if resp := get(h); resp.StatusCode != http.StatusOK {
			t.Errorf("after Retry-After: status %d, want 200", resp.StatusCode)
		}
		if next.count() != 3 {
			t.Errorf("handler ran %d times, want 3", next.count())
		}
	})

	t.Run("open", func(t *testing.T) {
		lim := downLimiter(t, l, policy.FailOpen)
		h := httplimit.Middleware(lim, constKey("k"))(&okHandler{})
		for i := 0; i < 6; i++ {
			resp := get(h)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("request %d: status %d", i, resp.StatusCode)
			}
			// A key Redis never reported on: a full bucket.
			wantMembers(t, resp, httplimit.HeaderRateLimit, member{"api", 4, 0})
		}
	})
}

// TestOutageRetryAfterIsTheBreakers: a FailClosed 503's Retry-After is the
// time until the breaker lets a probe through, on the Limiter's clock.
func TestOutageRetryAfterIsTheBreakers(t *testing.T) {
	clk := &stepClock{t: frozen}
	c := downClient(t, policy.FailClosed, withClock(clk),
		leaselimit.WithoutLease(), leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}))
	h := httplimit.Middleware(c.Limiter(policy.PerMinute(10).WithName("login")), constKey("k"))(&okHandler{})
	readProblem(t, get(h), http.StatusServiceUnavailable)
	// The breaker may hear of the failed call only when the call ends.
	for deadline := time.Now().Add(5 * time.Second); c.BreakerState() != breaker.Open; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("breaker %v after a failure with Failures 1", c.BreakerState())
		}
	}
	clk.set(frozen.Add(10*time.Second + 500*time.Millisecond))
	// 49.5 s until the probe (the breaker opens for MaxOpenFor, a
	// minute), rounded up.
	wantOutage(t, get(h), `"login";q=10;w=60`, 50)
}

// TestOutageAsDenial: WithOutageAsDenial answers an outage's denials as
// before: 429 quota-exceeded through the denied handler, with RateLimit.
func TestOutageAsDenial(t *testing.T) {
	lim := downLimiter(t, policy.PerMinute(4).WithName("api"), policy.FailClosed)
	h := httplimit.Middleware(lim, constKey("k"), httplimit.WithOutageAsDenial(), httplimit.WithLegacyHeaders())(&okHandler{})
	resp := get(h)
	p, _ := readProblem(t, resp, http.StatusTooManyRequests)
	if p.Type != httplimit.ProblemTypeQuotaExceeded || len(p.Violated) != 1 || p.Violated[0] != "api" {
		t.Errorf("problem %+v, want quota-exceeded for api", p)
	}
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"api", 0, 1})
	if ra := intHeader(t, resp, "Retry-After"); ra != 1 {
		t.Errorf("Retry-After %d, want 1", ra)
	}
	if r := intHeader(t, resp, "X-RateLimit-Remaining"); r != 0 {
		t.Errorf("X-RateLimit-Remaining %d, want 0", r)
	}
}

// TestOutageHandler: WithOutageHandler gets the failure policy's denials,
// and only those, with Retry-After and RateLimit-Policy already set and no
// RateLimit member; the denied handler gets the others.
func TestOutageHandler(t *testing.T) {
	l := policy.PerMinute(5).WithName("p")
	decision := leaselimit.Decision{Limit: l, RetryAfter: 2500 * time.Millisecond, Source: leaselimit.SourceFallback}
	f := &fakeLimiter{limit: l, decide: func(string, int64) (leaselimit.Decision, error) { return decision, nil }}
	var outages, denials int
	var got leaselimit.Decision
	h := httplimit.Middleware(f, constKey("k"),
		httplimit.WithOutageHandler(func(w http.ResponseWriter, r *http.Request, d leaselimit.Decision) {
			outages++
			got = d
			hd := w.Header()
			if hd.Get("Retry-After") != "3" || hd.Get(httplimit.HeaderRateLimitPolicy) != `"p";q=5;w=60` || len(hd.Values(httplimit.HeaderRateLimit)) != 0 {
				t.Errorf("outage handler runs with header %v; want Retry-After 3, RateLimit-Policy, no RateLimit", hd)
			}
			w.WriteHeader(http.StatusTeapot)
		}),
		httplimit.WithDeniedHandler(func(w http.ResponseWriter, r *http.Request, d leaselimit.Decision) {
			denials++
			w.WriteHeader(http.StatusTooManyRequests)
		}))(&okHandler{})
	if resp := get(h); resp.StatusCode != http.StatusTeapot || outages != 1 || denials != 0 || got.Source != leaselimit.SourceFallback {
		t.Errorf("outage: status %d, %d outage and %d denied handler calls, decision %+v", resp.StatusCode, outages, denials, got)
	}
	for _, src := range []leaselimit.Source{leaselimit.SourceAuthority, leaselimit.SourceCache, leaselimit.SourceLease} {
		decision.Source = src
		if resp := get(h); resp.StatusCode != http.StatusTooManyRequests {
			t.Errorf("a %v denial: status %d, want the denied handler's 429", src, resp.StatusCode)
		}
	}
	if outages != 1 || denials != 3 {
		t.Errorf("%d outage and %d denied handler calls; want 1 and 3", outages, denials)
	}
}

// TestOutageComposed: an inner Middleware's outage keeps the outer one's
// fields, which describe a real decision, and adds none of its own but its
// policy.
func TestOutageComposed(t *testing.T) {
	outer := allowAll(policy.PerMinute(10).WithName("burst"))
	inner := downLimiter(t, policy.PerDay(1000).WithName("daily"), policy.FailClosed)
	next := &okHandler{}
	h := httplimit.Middleware(outer, constKey("k"), httplimit.WithLegacyHeaders())(
		httplimit.Middleware(inner, constKey("k"), httplimit.WithLegacyHeaders())(next))
	resp := get(h)
	readProblem(t, resp, http.StatusServiceUnavailable)
	wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{"burst", 10, 60}, member{"daily", 1000, 86400})
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"burst", 9, 6})
	if r := intHeader(t, resp, "X-RateLimit-Remaining"); r != 9 {
		t.Errorf("X-RateLimit-Remaining %d, want the outer decision's 9", r)
	}
	if next.count() != 0 {
		t.Error("handler ran")
	}
}

// TestOutageShadow: a shadow limit never refuses, during an outage either,
// and with WithShadowHeaders sends its policy but no RateLimit member for
// a would-be outage denial.
func TestOutageShadow(t *testing.T) {
	lim := downLimiter(t, policy.PerMinute(4).WithName("trial"), policy.FailClosed, leaselimit.WithShadow())
	next := &okHandler{}
	quiet := httplimit.Middleware(lim, constKey("k"))(next)
	loud := httplimit.Middleware(lim, constKey("k"), httplimit.WithShadowHeaders(), httplimit.WithLegacyHeaders())(next)
	for i := 0; i < 2; i++ {
		resp := get(quiet)
		if resp.StatusCode != http.StatusOK || resp.Header.Get(httplimit.HeaderRateLimitPolicy) != "" || resp.Header.Get(httplimit.HeaderRateLimit) != "" {
			t.Errorf("shadow, quiet: status %d, header %v; want 200 and no field", resp.StatusCode, resp.Header)
		}
		resp = get(loud)
		if resp.StatusCode != http.StatusOK {
			t.Errorf("shadow: status %d, want 200", resp.StatusCode)
		}
		wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{"trial", 4, 60})
		for _, f := range []string{httplimit.HeaderRateLimit, "Retry-After", "X-RateLimit-Remaining"} {
			if v := resp.Header.Values(f); len(v) != 0 {
				t.Errorf("shadow during an outage: %s %q", f, v)
			}
		}
	}
	if next.count() != 4 {
		t.Errorf("handler ran %d times, want 4", next.count())
	}
}
