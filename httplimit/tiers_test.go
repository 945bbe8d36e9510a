package httplimit_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/policy"
)

// callAs serves a request of user on plan (the X-User and X-Plan header
// fields) through h.
func callAs(h http.Handler, user, plan string) *httptest.ResponseRecorder {
	req := httptest.NewRequest("GET", "/", nil)
	req.Header.Set("X-User", user)
	req.Header.Set("X-Plan", plan)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// TestLimitFunc: each request is decided by the limit WithLimitFunc chose
// for it, and its RateLimit-Policy and RateLimit describe that limit.
func TestLimitFunc(t *testing.T) {
	_, rdb := newRedis(t)
	free := policy.Limit{Name: "free", Rate: 2, Period: time.Minute, Burst: 2}
	pro := policy.Limit{Name: "pro", Rate: 100, Period: time.Minute, Burst: 50}
	plans := map[string]policy.Limit{"free": free, "pro": pro}
	lim := newLimiter(t, rdb, free, leaselimit.WithoutLease())
	h := httplimit.Middleware(lim, httplimit.Header("X-User"), httplimit.WithLimitFunc(func(r *http.Request) policy.Limit {
		return plans[r.Header.Get("X-Plan")]
	}))(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {}))
	call := func(user, plan string) *httptest.ResponseRecorder { return callAs(h, user, plan) }
	for i, want := range []struct {
		user, plan    string
		code          int
		policy, limit string
	}{
		{"ann", "free", 200, `"free";q=2;w=60`, `"free";r=1;t=30`},
		{"ann", "free", 200, `"free";q=2;w=60`, `"free";r=0;t=30`},
		{"ann", "free", 429, `"free";q=2;w=60`, `"free";r=0;t=30`},
		{"ann", "pro", 200, `"pro";q=100;w=60;leaselimit-burst=50`, `"pro";r=49;t=1`}, // an upgrade: the pro bucket, full
		{"bob", "pro", 200, `"pro";q=100;w=60;leaselimit-burst=50`, `"pro";r=49;t=1`},
	} {
		rec := call(want.user, want.plan)
		if rec.Code != want.code || rec.Header().Get(httplimit.HeaderRateLimitPolicy) != want.policy ||
			rec.Header().Get(httplimit.HeaderRateLimit) != want.limit {
			t.Errorf("request %d (%s on %s): %d, RateLimit-Policy %q, RateLimit %q; want %d, %q, %q", i, want.user, want.plan,
				rec.Code, rec.Header().Get(httplimit.HeaderRateLimitPolicy), rec.Header().Get(httplimit.HeaderRateLimit),
				want.code, want.policy, want.limit)
		}
	}
	// An unknown plan gives the zero Limit: invalid, so the request fails
	// with the error handler's 500 rather than being let through.
	if rec := call("eve", "gold"); rec.Code != http.StatusInternalServerError {
		t.Errorf("request with an invalid limit: %d; want 500", rec.Code)
	}
}

// TestLimitFuncNeedsFor: WithLimitFunc with a Limiter that cannot enforce
// other limits is a programming error, reported at once.
func TestLimitFuncNeedsFor(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("Middleware with WithLimitFunc and a Limiter without For did not panic")
		}
	}()
	f := &fakeLimiter{limit: policy.PerSecond(1)}
	httplimit.Middleware(f, httplimit.Header("X-User"), httplimit.WithLimitFunc(func(*http.Request) policy.Limit { return policy.PerSecond(2) }))
}

// TestMultiLimitHeaders: a Limiter with several limits puts every one in
// RateLimit-Policy and RateLimit, and its 429 names the one that denied.
func TestMultiLimitHeaders(t *testing.T) {
	_, rdb := newRedis(t)
	burst := policy.Limit{Name: "burst", Rate: 10, Period: time.Minute, Burst: 10}
	daily := policy.Limit{Name: "daily", Rate: 2, Period: 24 * time.Hour, Burst: 2}
	lim := newClient(t, rdb).Limiter(burst, daily)
	h := httplimit.Middleware(lim, httplimit.Header("X-User"))(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	for i, want := range []struct {
		code  int
		limit string
	}{
		{200, `"burst";r=9;t=6, "daily";r=1;t=43200`},
		{200, `"burst";r=8;t=6, "daily";r=0;t=43200`},
		{429, `"burst";r=8;t=6, "daily";r=0;t=43200`},
	} {
		req := httptest.NewRequest("GET", "/", nil)
		req.Header.Set("X-User", "ann")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if p := rec.Header().Get(httplimit.HeaderRateLimitPolicy); p != `"burst";q=10;w=60, "daily";q=2;w=86400` {
			t.Errorf("request %d: RateLimit-Policy %q", i, p)
		}
		if rec.Code != want.code || rec.Header().Get(httplimit.HeaderRateLimit) != want.limit {
			t.Errorf("request %d: %d, RateLimit %q; want %d, %q", i, rec.Code, rec.Header().Get(httplimit.HeaderRateLimit), want.code, want.limit)
		}
		if rec.Code == 429 && !strings.Contains(rec.Body.String(), `"violated-policies":["daily"]`) {
			t.Errorf("429 body %s does not name the daily quota", rec.Body)
		}
	}
}

// TestShadowLimit: a limit in shadow mode never changes the response: no
// header field of its own (unless WithShadowHeaders), never a 429, and an
// enforced limit around it keeps its own fields whole.
func TestShadowLimit(t *testing.T) {
	_, rdb := newRedis(t)
	enforcedLimit := policy.Limit{Name: "real", Rate: 100, Period: time.Minute, Burst: 100}
	shadowLimit := policy.Limit{Name: "trial", Rate: 1, Period: time.Minute, Burst: 1}
	real := newLimiter(t, rdb, enforcedLimit, leaselimit.WithoutLease())
	trial := newLimiter(t, rdb, shadowLimit, leaselimit.WithoutLease(), leaselimit.WithShadow())
	app := http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})
	key := httplimit.Header("X-User")
	quiet := httplimit.Middleware(real, key)(httplimit.Middleware(trial, key)(app))
	loud := httplimit.Middleware(trial, key, httplimit.WithShadowHeaders())(app)
	for i := 0; i < 3; i++ {
		req := httptest.NewRequest("GET", "/", nil)
		req.Header.Set("X-User", "ann")
		rec := httptest.NewRecorder()
		quiet.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			t.Errorf("request %d: %d; a shadow limit must not deny", i, rec.Code)
		}
		if p := rec.Header().Get(httplimit.HeaderRateLimitPolicy); p != `"real";q=100;w=60` {
			t.Errorf("request %d: RateLimit-Policy %q; want the enforced limit's alone", i, p)
		}
		if got, want := rec.Header().Get(httplimit.HeaderRateLimit), fmt.Sprintf(`"real";r=%d;t=1`, 99-i); got != want {
			t.Errorf("request %d: RateLimit %q; want %q", i, got, want)
		}
		rec = httptest.NewRecorder()
		loud.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK || rec.Header().Get(httplimit.HeaderRateLimit) == "" {
			t.Errorf("request %d WithShadowHeaders: %d, RateLimit %q; want 200 with the shadow limit's fields", i, rec.Code, rec.Header().Get(httplimit.HeaderRateLimit))
		}
	}
}

// dailyReset matches the RateLimit member of the quota named daily.
var dailyReset = regexp.MustCompile(`"daily";r=(\d+);t=\d+`)

// TestLimiterFunc: each request is decided by the Limiter WithLimiterFunc
// chose, of one limit or of several together, with its RateLimit-Policy
// and RateLimit members; a nil Limiter leaves the request to Middleware's.
func TestLimiterFunc(t *testing.T) {
	_, rdb := newRedis(t)
	c := newClient(t, rdb, leaselimit.WithoutLease())
	daily := policy.Quota("daily", 3, policy.Day, nil)
	free := policy.Limit{Name: "free", Rate: 2, Period: time.Minute, Burst: 2}
	pro := policy.Limit{Name: "pro", Rate: 100, Period: time.Minute, Burst: 50}
	plans := map[string]*leaselimit.Limiter{"free": c.Limiter(free, daily), "pro": c.Limiter(pro, daily)}
	fallback := c.Limiter(policy.Limit{Name: "anon", Rate: 1, Period: time.Minute, Burst: 1})
	// As WithLimiterFunc's example: a plan missing from the map is a nil
	// *leaselimit.Limiter in the interface, which panicked on every request.
	h := httplimit.Middleware(fallback, httplimit.Header("X-User"), httplimit.WithLimiterFunc(func(r *http.Request) httplimit.Limiter {
		return plans[r.Header.Get("X-Plan")]
	}))(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {}))
	call := func(user, plan string) *httptest.ResponseRecorder { return callAs(h, user, plan) }
	for i, want := range []struct {
		user, plan    string
		code          int
		policy, limit string
	}{
		{"ann", "free", 200, `"free";q=2;w=60, "daily";q=3;w=86400`, `"free";r=1;t=30, "daily";r=2;t=*`},
		{"ann", "free", 200, `"free";q=2;w=60, "daily";q=3;w=86400`, `"free";r=0;t=30, "daily";r=1;t=*`},
		{"ann", "free", 429, `"free";q=2;w=60, "daily";q=3;w=86400`, `"free";r=0;t=30, "daily";r=1;t=*`},
		{"ann", "pro", 200, `"pro";q=100;w=60;leaselimit-burst=50, "daily";q=3;w=86400`, `"pro";r=49;t=1, "daily";r=0;t=*`},
		{"ann", "pro", 429, `"pro";q=100;w=60;leaselimit-burst=50, "daily";q=3;w=86400`, `"pro";r=49;t=1, "daily";r=0;t=*`},
		{"bob", "", 200, `"anon";q=1;w=60`, `"anon";r=0;t=60`},
	} {
		rec := call(want.user, want.plan)
		// The quota's t is until its window ends: on the wall clock's day,
		// which the frozen miniredis clock does not share.
		limit := dailyReset.ReplaceAllString(rec.Header().Get(httplimit.HeaderRateLimit), `"daily";r=$1;t=*`)
		if rec.Code != want.code || rec.Header().Get(httplimit.HeaderRateLimitPolicy) != want.policy || limit != want.limit {
			t.Errorf("request %d (%s on %q): %d, RateLimit-Policy %q, RateLimit %q; want %d, %q, %q", i, want.user, want.plan,
				rec.Code, rec.Header().Get(httplimit.HeaderRateLimitPolicy), rec.Header().Get(httplimit.HeaderRateLimit),
				want.code, want.policy, want.limit)
		}
	}
}

// TestLimitFuncAndLimiterFunc: the two together are a misconfiguration
// Middleware refuses at once.
func TestLimitFuncAndLimiterFunc(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "WithLimiterFunc") {
			t.Errorf("Middleware with both = %v; want a panic naming WithLimiterFunc", r)
		}
	}()
	_, rdb := newRedis(t)
	lim := newLimiter(t, rdb, policy.PerSecond(2))
	httplimit.Middleware(lim, httplimit.Header("X-User"),
		httplimit.WithLimitFunc(func(*http.Request) policy.Limit { return policy.PerSecond(2) }),
		httplimit.WithLimiterFunc(func(*http.Request) httplimit.Limiter { return lim }))
}

// TestNilLimiterRefused: Middleware panics with its own message on a nil
// *leaselimit.Limiter, as on a nil Limiter (it dereferenced it).
func TestNilLimiterRefused(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "nil Limiter") {
			t.Errorf("Middleware((*leaselimit.Limiter)(nil)) = %v; want a panic naming the nil Limiter", r)
		}
	}()
	httplimit.Middleware((*leaselimit.Limiter)(nil), httplimit.Header("X-User"))
}

// TestViewOptionErrorIsNotAnOutage: a view With refused is a mistake in
// the program, answered 500 like an invalid limit, not 503 with a
// Retry-After that asks clients to retry it forever.
func TestViewOptionErrorIsNotAnOutage(t *testing.T) {
	_, rdb := newRedis(t)
	c := newClient(t, rdb)
	bad := c.Limiter(policy.Limit{Name: "bad", Rate: 1, Period: time.Minute, Burst: 1}).With(leaselimit.WithTimeout(time.Second))
	h := httplimit.Middleware(bad, httplimit.Header("X-User"), httplimit.WithLogger(slog.New(slog.DiscardHandler)))(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	rec := callAs(h, "ann", "")
	if rec.Code != http.StatusInternalServerError || rec.Header().Get(httplimit.HeaderRetryAfter) != "" {
		t.Errorf("a view With refused: %d, Retry-After %q; want 500 without Retry-After", rec.Code, rec.Header().Get(httplimit.HeaderRetryAfter))
	}
}

// userLimiter is a Limiter type of the user's.
type userLimiter struct{ lim *leaselimit.Limiter }

func (u *userLimiter) AllowN(ctx context.Context, key string, n int64) (leaselimit.Decision, error) {
	return u.lim.AllowN(ctx, key, n)
}
func (u *userLimiter) Limit() policy.Limit { return u.lim.Limit() }

// TestLimiterFuncNilOfTheUsersType: a nil pointer of the user's own
// Limiter type leaves the request to Middleware's Limiter too (it panicked
// on every request).
func TestLimiterFuncNilOfTheUsersType(t *testing.T) {
	_, rdb := newRedis(t)
	c := newClient(t, rdb, leaselimit.WithoutLease())
	base := c.Limiter(policy.Limit{Name: "base", Rate: 1, Period: time.Minute, Burst: 1})
	var none *userLimiter
	h := httplimit.Middleware(base, httplimit.Header("X-User"), httplimit.WithLimiterFunc(func(*http.Request) httplimit.Limiter { return none }))(
		http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	for i, want := range []int{200, 429} {
		if rec := callAs(h, "ann", ""); rec.Code != want {
			t.Errorf("request %d: %d; want %d (the base Limiter's)", i, rec.Code, want)
		}
	}
}

// TestLimiterErrorNamesThePlan: the default error handler's log line names
// the limit of the Limiter WithLimiterFunc chose, not the Middleware's own.
func TestLimiterErrorNamesThePlan(t *testing.T) {
	_, rdb := newRedis(t)
	c := newClient(t, rdb)
	base := c.Limiter(policy.Limit{Name: "base", Rate: 1, Period: time.Minute, Burst: 1})
	bad := c.Limiter(policy.Limit{Name: "plan-bad", Rate: 1, Period: time.Minute, Burst: 1}).With(leaselimit.WithTimeout(time.Second))
	var out strings.Builder
	h := httplimit.Middleware(base, httplimit.Header("X-User"), httplimit.WithLogger(slog.New(slog.NewTextHandler(&out, nil))),
		httplimit.WithLimiterFunc(func(*http.Request) httplimit.Limiter { return bad }))(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	if rec := callAs(h, "ann", ""); rec.Code != http.StatusInternalServerError {
		t.Fatalf("a plan's view With refused: %d; want 500", rec.Code)
	}
	if !strings.Contains(out.String(), "policy=plan-bad") {
		t.Errorf("the log line does not name the plan's limit:\n%s", out.String())
	}
}
