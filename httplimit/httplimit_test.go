package httplimit_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/internal/syncbuf"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

func TestMain(m *testing.M) {
	redistest.VerifyTestMain(m)
}

// frozen is the time miniredis reports in tests: with Redis's clock standing
// still, buckets do not refill during a test and every number is exact.
var frozen = time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)

func newRedis(t testing.TB) (*miniredis.Miniredis, *redis.Client) {
	t.Helper()
	mr := miniredis.RunT(t)
	mr.SetTime(frozen)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	return mr, rdb
}

// newClient returns a Client on rdb, closed when the test ends.
func newClient(t testing.TB, rdb redis.UniversalClient, opts ...leaselimit.Option) *leaselimit.Client {
	t.Helper()
	// A generous time budget: a slow miniredis call under -race must not
	// turn into a FailOpen decision. Tests that want a short one pass it.
	opts = append([]leaselimit.Option{leaselimit.WithTimeout(10 * time.Second)}, opts...)
	c, err := leaselimit.NewClient(rdb, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// newLimiter returns the Limiter of l on a Client of its own.
func newLimiter(t testing.TB, rdb redis.UniversalClient, l policy.Limit, opts ...leaselimit.Option) *leaselimit.Limiter {
	t.Helper()
	return newClient(t, rdb, opts...).Limiter(l)
}

// fakeLimiter is a Limiter whose decisions and errors the test chooses.
type fakeLimiter struct {
	limit  policy.Limit
	decide func(key string, n int64) (leaselimit.Decision, error)

	mu    sync.Mutex
	keys  []string
	costs []int64
}

func (f *fakeLimiter) Limit() policy.Limit { return f.limit }

func (f *fakeLimiter) AllowN(_ context.Context, key string, n int64) (leaselimit.Decision, error) {
	f.mu.Lock()
	f.keys = append(f.keys, key)
	f.costs = append(f.costs, n)
	f.mu.Unlock()
	return f.decide(key, n)
}

func (f *fakeLimiter) calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.keys)
}

func allowAll(l policy.Limit) *fakeLimiter {
	return &fakeLimiter{limit: l, decide: func(string, int64) (leaselimit.Decision, error) {
		return leaselimit.Decision{Allowed: true, Limit: l, Remaining: l.Burst - 1, ResetAfter: l.Interval(1)}, nil
	}}
}

// okHandler counts the requests that reach it.
type okHandler struct {
	mu sync.Mutex
	n  int
}

func (h *okHandler) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	h.mu.Lock()
	h.n++
	h.mu.Unlock()
	io.WriteString(w, "ok")
}

func (h *okHandler) count() int { h.mu.Lock(); defer h.mu.Unlock(); return h.n }

func constKey(k string) httplimit.KeyFunc {
	return func(*http.Request) (string, error) { return k, nil }
}

func serve(h http.Handler, r *http.Request) *http.Response {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	return rec.Result()
}

func get(h http.Handler) *http.Response {
	return serve(h, httptest.NewRequest("GET", "/", nil))
}

// list parses the Structured Field List in resp's field name.
func list(t *testing.T, resp *http.Response, name string) []sfItem {
	t.Helper()
	v := resp.Header.Values(name)
	if len(v) == 0 {
		t.Fatalf("%s missing", name)
	}
	if len(v) != 1 {
		t.Errorf("%s in %d field lines, want 1: %q", name, len(v), v)
	}
	items, err := parseSFList(v)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return items
}

type member struct {
	name string
	a, b int64 // q, w for RateLimit-Policy; r, t for RateLimit
}

// members reads a RateLimit (params "r","t") or RateLimit-Policy ("q","w")
// field and checks every member's shape: a String with exactly those two
// Integer parameters, both non-negative (and, in RateLimit-Policy, perhaps
// a positive Integer leaselimit-burst; see advertised).
func members(t *testing.T, resp *http.Response, field string) []member {
	t.Helper()
	pa, pb := "r", "t"
	if field == httplimit.HeaderRateLimitPolicy {
		pa, pb = "q", "w"
	}
	var out []member
	for _, it := range list(t, resp, field) {
		name, ok := it.Value.(string)
		if !ok {
			t.Fatalf("%s member %#v is not a String", field, it.Value)
		}
		params := len(it.Params)
		if _, ok := it.Param("leaselimit-burst"); ok && field == httplimit.HeaderRateLimitPolicy {
			if b, err := it.Int("leaselimit-burst"); err != nil || b <= 0 {
				t.Errorf("%s %q: leaselimit-burst %d (%v), want a positive Integer", field, name, b, err)
			}
			params--
		}
		if params != 2 {
			t.Errorf("%s member %q has params %v, want exactly %s and %s", field, name, it.Params, pa, pb)
		}
		a, err := it.Int(pa)
		if err != nil {
			t.Fatalf("%s %q: %v", field, name, err)
		}
		b, err := it.Int(pb)
		if err != nil {
			t.Fatalf("%s %q: %v", field, name, err)
		}
		if a < 0 || b < 0 {
			t.Errorf("%s %q: negative %s=%d %s=%d", field, name, pa, a, pb, b)
		}
		out = append(out, member{name, a, b})
	}
	return out
}

func wantMembers(t *testing.T, resp *http.Response, field string, want ...member) {
	t.Helper()
	got := members(t, resp, field)
	if len(got) != len(want) {
		t.Fatalf("%s = %v, want %v", field, got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("%s = %v, want %v", field, got, want)
			return
		}
	}
}

func intHeader(t *testing.T, resp *http.Response, name string) int64 {
	t.Helper()
	v := resp.Header.Values(name)
	if len(v) != 1 {
		t.Fatalf("%s = %q, want one value", name, v)
	}
	n, err := strconv.ParseInt(v[0], 10, 64)
	if err != nil || n < 0 {
		t.Fatalf("%s = %q, want a non-negative integer", name, v[0])
	}
	return n
}

type problemBody struct {
	Type     string   `json:"type"`
	Title    string   `json:"title"`
	Status   int      `json:"status"`
	Detail   string   `json:"detail"`
	Violated []string `json:"violated-policies"`
}

// readProblem checks resp is an RFC 9457 problem+json response with the
// given status and returns it and its raw body.
func readProblem(t *testing.T, resp *http.Response, status int) (problemBody, string) {
	t.Helper()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d; body %s", resp.StatusCode, status, body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("Content-Type %q, want application/problem+json", ct)
	}
	var p problemBody
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		t.Fatalf("problem body %s: %v", body, err)
	}
	if p.Status != status || p.Type == "" || p.Title == "" {
		t.Errorf("problem %+v: want status %d and a type and title", p, status)
	}
	return p, string(body)
}

// TestAllowedAndDeniedHeaders checks every header of allowed and denied
// responses against a real Limiter (exact mode) on miniredis with Redis's
// clock frozen, so each value is known exactly.
func TestAllowedAndDeniedHeaders(t *testing.T) {
	for _, lease := range []bool{false, true} {
		t.Run("lease="+strconv.FormatBool(lease), func(t *testing.T) {
			_, rdb := newRedis(t)
			var opts []leaselimit.Option
			if !lease {
				opts = append(opts, leaselimit.WithoutLease())
			}
			// 3 per minute: one token every 20 s.
			lim := newLimiter(t, rdb, policy.PerMinute(3).WithName("api"), opts...)
			next := &okHandler{}
			h := httplimit.Middleware(lim, constKey("k"), httplimit.WithLegacyHeaders())(next)

			for i, rem := range []int64{2, 1, 0} {
				resp := get(h)
				if resp.StatusCode != 200 {
					t.Fatalf("request %d: status %d", i, resp.StatusCode)
				}
				wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{"api", 3, 60})
				// t: the next token arrives 20 s after the last one taken.
				wantMembers(t, resp, httplimit.HeaderRateLimit, member{"api", rem, 20})
				if v := resp.Header.Values(httplimit.HeaderRetryAfter); len(v) != 0 {
					t.Errorf("Retry-After %q on an allowed response", v)
				}
				if got := intHeader(t, resp, "X-RateLimit-Limit"); got != 3 {
					t.Errorf("X-RateLimit-Limit %d, want 3", got)
				}
				if got := intHeader(t, resp, "X-RateLimit-Remaining"); got != rem {
					t.Errorf("X-RateLimit-Remaining %d, want %d", got, rem)
				}
				if got, want := intHeader(t, resp, "X-RateLimit-Reset"), 20*(3-rem); got != want {
					t.Errorf("X-RateLimit-Reset %d, want %d (until full)", got, want)
				}
			}
			if next.count() != 3 {
				t.Fatalf("handler ran %d times, want 3", next.count())
			}

			resp := get(h)
			p, _ := readProblem(t, resp, http.StatusTooManyRequests)
			if next.count() != 3 {
				t.Error("handler ran for a denied request")
			}
			wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{"api", 3, 60})
			wantMembers(t, resp, httplimit.HeaderRateLimit, member{"api", 0, 20})
			if got := intHeader(t, resp, "Retry-After"); got != 20 {
				t.Errorf("Retry-After %d, want 20", got)
			}
			if got := intHeader(t, resp, "X-RateLimit-Remaining"); got != 0 {
				t.Errorf("X-RateLimit-Remaining %d, want 0", got)
			}
			if got := intHeader(t, resp, "X-RateLimit-Reset"); got != 60 {
				t.Errorf("X-RateLimit-Reset %d, want 60", got)
			}
			if p.Type != "https://iana.org/assignments/http-problem-types#quota-exceeded" {
				t.Errorf("problem type %q", p.Type)
			}
			if len(p.Violated) != 1 || p.Violated[0] != "api" {
				t.Errorf("violated-policies %q, want [api]", p.Violated)
			}
			if p.Detail == "" {
				t.Error("no detail")
			}
		})
	}
}

func TestNoLegacyHeadersByDefault(t *testing.T) {
	h := httplimit.Middleware(allowAll(policy.PerSecond(10)), constKey("k"))(&okHandler{})
	resp := get(h)
	for _, f := range []string{"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"} {
		if v := resp.Header.Values(f); len(v) != 0 {
			t.Errorf("%s = %q without WithLegacyHeaders", f, v)
		}
	}
	wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{"default", 10, 1})
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"default", 9, 1})
}

// TestRetryAfterRounding: Retry-After is whole seconds, rounded up, at least
// 1, and never earlier than t.
func TestRetryAfterRounding(t *testing.T) {
	for _, tc := range []struct {
		retry time.Duration
		want  int64
	}{
		{0, 1}, {time.Microsecond, 1}, {time.Second, 1}, {time.Second + time.Nanosecond, 2},
		{1500 * time.Millisecond, 2}, {59*time.Second + 999*time.Millisecond, 60}, {24 * time.Hour, 86400},
	} {
		l := policy.PerMinute(5).WithName("p")
		f := &fakeLimiter{limit: l, decide: func(string, int64) (leaselimit.Decision, error) {
			return leaselimit.Decision{Limit: l, Remaining: 0, RetryAfter: tc.retry, ResetAfter: tc.retry}, nil
		}}
		resp := get(httplimit.Middleware(f, constKey("k"), httplimit.WithLegacyHeaders())(&okHandler{}))
		readProblem(t, resp, 429)
		ra := intHeader(t, resp, "Retry-After")
		rl := members(t, resp, httplimit.HeaderRateLimit)
		if ra != tc.want || rl[0].b != tc.want {
			t.Errorf("RetryAfter %v: Retry-After %d, t %d; want %d", tc.retry, ra, rl[0].b, tc.want)
		}
		if reset := intHeader(t, resp, "X-RateLimit-Reset"); reset < ra {
			t.Errorf("RetryAfter %v: X-RateLimit-Reset %d before Retry-After %d", tc.retry, reset, ra)
		}
	}
}

// TestPolicyNameEscaping: the policy name is an sf-string, so '"' and '\'
// are escaped; 5 per 100 ms is 50 per second.
func TestPolicyNameEscaping(t *testing.T) {
	name := `we"ird\name`
	l := policy.Limit{Name: name, Rate: 5, Period: 100 * time.Millisecond, Burst: 7}
	resp := get(httplimit.Middleware(allowAll(l), constKey("k"))(&okHandler{}))
	if got := resp.Header.Get(httplimit.HeaderRateLimitPolicy); got != `"we\"ird\\name";q=50;w=1;leaselimit-burst=7` {
		t.Errorf("RateLimit-Policy %s", got)
	}
	wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{name, 50, 1})
	rl := members(t, resp, httplimit.HeaderRateLimit)
	if rl[0].name != name || rl[0].a != 6 || rl[0].b != 1 {
		t.Errorf("RateLimit %v", rl)
	}
}

// TestTUntilNextToken: on an allowed response t is until one more token, not
// until the bucket is full; 0 when it is full.
func TestTUntilNextToken(t *testing.T) {
	l := policy.Limit{Name: "daily", Rate: 1000, Period: 24 * time.Hour, Burst: 1000} // 86.4 s per token
	for _, tc := range []struct {
		d    leaselimit.Decision
		want int64
	}{
		{leaselimit.Decision{Allowed: true, Remaining: 1000}, 0},
		{leaselimit.Decision{Allowed: true, Remaining: 999, ResetAfter: l.Interval(1)}, 87},
		{leaselimit.Decision{Allowed: true, Remaining: 990, ResetAfter: l.Interval(10)}, 87},
		// 9.5 tokens short of full: the next one is half an interval away.
		{leaselimit.Decision{Allowed: true, Remaining: 990, ResetAfter: l.Interval(10) - 43200*time.Millisecond}, 44},
		// Inconsistent with the limit (a FailLocal share): at most one interval.
		{leaselimit.Decision{Allowed: true, Remaining: 10, ResetAfter: time.Second}, 1},
		{leaselimit.Decision{Allowed: true, Remaining: 10, ResetAfter: time.Hour}, 87},
	} {
		f := &fakeLimiter{limit: l, decide: func(string, int64) (leaselimit.Decision, error) { return tc.d, nil }}
		resp := get(httplimit.Middleware(f, constKey("k"))(&okHandler{}))
		rl := members(t, resp, httplimit.HeaderRateLimit)
		if rl[0].b != tc.want || rl[0].a != tc.d.Remaining {
			t.Errorf("%+v: RateLimit %v, want r=%d t=%d", tc.d, rl, tc.d.Remaining, tc.want)
		}
	}
}

// TestComposed: two Middlewares on one route, a burst limit outside a daily
// quota.
func TestComposed(t *testing.T) {
	mr, rdb := newRedis(t)
	burst := newLimiter(t, rdb, policy.PerMinute(2).WithName("burst"), leaselimit.WithoutLease())
	daily := newLimiter(t, rdb, policy.Limit{Name: "daily", Rate: 5, Period: 24 * time.Hour, Burst: 5}, leaselimit.WithoutLease())
	next := &okHandler{}
	key := constKey("client")
	h := httplimit.Middleware(burst, key, httplimit.WithLegacyHeaders())(
		httplimit.Middleware(daily, key, httplimit.WithLegacyHeaders())(next))

	pol := []member{{"burst", 2, 60}, {"daily", 5, 86400}}
	resp := get(h)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, pol...)
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"burst", 1, 30}, member{"daily", 4, 17280})
	// Legacy: the most restrictive (fewest remaining) is burst.
	if r := intHeader(t, resp, "X-RateLimit-Remaining"); r != 1 || intHeader(t, resp, "X-RateLimit-Limit") != 2 {
		t.Errorf("legacy headers %v, want burst's", resp.Header)
	}

	resp = get(h)
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"burst", 0, 30}, member{"daily", 3, 17280})

	// Denied by the outer limit: the inner is not consulted and loses nothing.
	resp = get(h)
	p, _ := readProblem(t, resp, 429)
	if len(p.Violated) != 1 || p.Violated[0] != "burst" {
		t.Errorf("violated-policies %q, want [burst]", p.Violated)
	}
	wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{"burst", 2, 60})
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"burst", 0, 30})
	if intHeader(t, resp, "Retry-After") != 30 {
		t.Errorf("Retry-After %q", resp.Header.Get("Retry-After"))
	}
	if next.count() != 2 {
		t.Fatalf("handler ran %d times, want 2", next.count())
	}

	// A minute later the burst bucket is full again; daily still has 3, and
	// its next token is a minute nearer.
	mr.SetTime(frozen.Add(time.Minute))
	resp = get(h)
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"burst", 1, 30}, member{"daily", 2, 17220})
	resp = get(h)
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"burst", 0, 30}, member{"daily", 1, 17220})
	readProblem(t, get(h), 429)

	// Allowed by the outer, denied by the inner: the outer's token is spent.
	mr.SetTime(frozen.Add(3 * time.Minute))
	resp = get(h)
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"burst", 1, 30}, member{"daily", 0, 17100})
	resp = get(h)
	p, _ = readProblem(t, resp, 429)
	if len(p.Violated) != 1 || p.Violated[0] != "daily" {
		t.Errorf("violated-policies %q, want [daily]", p.Violated)
	}
	wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, pol...)
	// burst spent its last token (r=0) on a request daily refused.
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"burst", 0, 30}, member{"daily", 0, 17100})
	if ra := intHeader(t, resp, "Retry-After"); ra != 17100 {
		t.Errorf("Retry-After %d, want daily's 17100", ra)
	}
	if r, l := intHeader(t, resp, "X-RateLimit-Remaining"), intHeader(t, resp, "X-RateLimit-Limit"); r != 0 || l != 5 {
		t.Errorf("legacy remaining %d limit %d, want the denying daily's 0 and 5", r, l)
	}
	if next.count() != 5 {
		t.Errorf("handler ran %d times, want 5", next.count())
	}
}

// TestComposedWithForeignFieldLines: members already in the response in
// several field lines are folded into one list, in order.
func TestComposedWithForeignFieldLines(t *testing.T) {
	outer := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Add("RateLimit-Policy", `"a";q=1;w=1`)
			w.Header().Add("RateLimit-Policy", `"b";q=2;w=2`)
			next.ServeHTTP(w, r)
		})
	}
	h := outer(httplimit.Middleware(allowAll(policy.PerSecond(3).WithName("c")), constKey("k"))(&okHandler{}))
	resp := get(h)
	wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{"a", 1, 1}, member{"b", 2, 2}, member{"c", 3, 1})
}

func TestCost(t *testing.T) {
	_, rdb := newRedis(t)
	lim := newLimiter(t, rdb, policy.PerMinute(10).WithName("bytes"), leaselimit.WithoutLease())
	cost := func(r *http.Request) int64 {
		n, _ := strconv.ParseInt(r.URL.Query().Get("cost"), 10, 64)
		return n
	}
	next := &okHandler{}
	h := httplimit.Middleware(lim, constKey("k"), httplimit.WithCost(cost),
		httplimit.WithLogger(slog.New(slog.DiscardHandler)))(next)
	req := func(n int) *http.Response {
		return serve(h, httptest.NewRequest("GET", "/?cost="+strconv.Itoa(n), nil))
	}

	resp := req(3)
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"bytes", 7, 6})
	resp = req(7)
	wantMembers(t, resp, httplimit.HeaderRateLimit, member{"bytes", 0, 6})

	// Cost 0: through, uncharged, no RateLimit member (nothing decided).
	resp = req(0)
	if resp.StatusCode != 200 || len(resp.Header.Values(httplimit.HeaderRateLimit)) != 0 {
		t.Errorf("cost 0: status %d, RateLimit %q", resp.StatusCode, resp.Header.Values(httplimit.HeaderRateLimit))
	}
	wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{"bytes", 10, 60})

	// Denied for want of 2 tokens: Retry-After is until 2 tokens (12 s).
	resp = req(2)
	readProblem(t, resp, 429)
	if ra := intHeader(t, resp, "Retry-After"); ra != 12 {
		t.Errorf("Retry-After %d, want 12", ra)
	}

	// Above the burst: never admissible, so refused for good: 429 without
	// Retry-After (waiting does not help), a detail that says why, no
	// tokens taken.
	resp = req(11)
	p, body := readProblem(t, resp, 429)
	if resp.Header.Get("Retry-After") != "" || !strings.Contains(p.Detail, "costs 11 tokens") || !strings.Contains(p.Detail, "at most 10") {
		t.Errorf("cost above the burst: Retry-After %q, body %s; want none, and the cost and the burst in the detail", resp.Header.Get("Retry-After"), body)
	}
	// A negative cost is the cost function's bug: a server error without
	// internals.
	resp = req(-1)
	if _, body := readProblem(t, resp, 500); strings.Contains(body, "leaselimit") || strings.Contains(body, "-1") {
		t.Errorf("500 body leaks the cause: %s", body)
	}
	if next.count() != 3 {
		t.Errorf("handler ran %d times, want 3", next.count())
	}

	// The fake sees the cost it was given.
	f := allowAll(policy.PerSecond(100))
	get(httplimit.Middleware(f, constKey("k"), httplimit.WithCost(func(*http.Request) int64 { return 42 }))(&okHandler{}))
	if len(f.costs) != 1 || f.costs[0] != 42 {
		t.Errorf("costs %v, want [42]", f.costs)
	}
}

func TestKeyErrors(t *testing.T) {
	f := allowAll(policy.PerSecond(10))
	secret := errors.New("db lookup: connection to 10.0.0.9 refused; token=s3cr3t")
	cases := []struct {
		name       string
		key        httplimit.KeyFunc
		req        func() *http.Request
		wantDetail string // substring; "" for the generic one
	}{
		{"internal error", func(*http.Request) (string, error) { return "", secret }, nil, ""},
		{"empty key", constKey(""), nil, "empty"},
		{"huge key", constKey(strings.Repeat("x", leaselimit.MaxKeyLen+1)), nil, "longer than"},
		{"missing header", httplimit.Header("X-Api-Key"), nil, "X-Api-Key"},
		{"empty header", httplimit.Header("x-api-key"), func() *http.Request {
			r := httptest.NewRequest("GET", "/", nil)
			r.Header.Set("X-Api-Key", "  ")
			return r
		}, "X-Api-Key header field is missing or empty"},
		{"repeated header", httplimit.Header("X-Api-Key"), func() *http.Request {
			r := httptest.NewRequest("GET", "/", nil)
			r.Header.Add("X-Api-Key", "a")
			r.Header.Add("X-Api-Key", "b")
			return r
		}, "more than once"},
		{"unix socket peer", httplimit.ClientIP(), func() *http.Request {
			r := httptest.NewRequest("GET", "/", nil)
			r.RemoteAddr = "@"
			return r
		}, "address"},
		{"composite", httplimit.Composite(constKey("a"), httplimit.Header("X-Api-Key")), nil, "X-Api-Key"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			next := &okHandler{}
			before := f.calls()
			r := httptest.NewRequest("GET", "/", nil)
			if tc.req != nil {
				r = tc.req()
			}
			resp := serve(httplimit.Middleware(f, tc.key)(next), r)
			p, body := readProblem(t, resp, 400)
			if next.count() != 0 || f.calls() != before {
				t.Error("a request without a key reached the limiter or the handler")
			}
			if strings.Contains(body, "10.0.0.9") || strings.Contains(body, "s3cr3t") || strings.Contains(body, "db lookup") {
				t.Errorf("key error body leaks the cause: %s", body)
			}
			if tc.wantDetail != "" && !strings.Contains(p.Detail, tc.wantDetail) {
				t.Errorf("detail %q, want it to mention %q", p.Detail, tc.wantDetail)
			}
			wantMembers(t, resp, httplimit.HeaderRateLimitPolicy, member{"default", 10, 1})
			if v := resp.Header.Values(httplimit.HeaderRateLimit); len(v) != 0 {
				t.Errorf("RateLimit %q without a decision", v)
			}
		})
	}

	t.Run("custom handler", func(t *testing.T) {
		var got error
		h := httplimit.Middleware(f, func(*http.Request) (string, error) { return "", secret },
			httplimit.WithKeyErrorHandler(func(w http.ResponseWriter, r *http.Request, err error) {
				got = err
				http.Error(w, "who are you", http.StatusUnauthorized)
			}))(&okHandler{})
		resp := get(h)
		if resp.StatusCode != 401 || !errors.Is(got, secret) {
			t.Errorf("status %d, err %v", resp.StatusCode, got)
		}
	})
}

func TestLimiterErrors(t *testing.T) {
	internal := errors.New("leaselimit: authority: unexpected reply from 10.1.2.3:6379 (auth=hunter2)")
	f := &fakeLimiter{limit: policy.PerSecond(10).WithName("api"), decide: func(string, int64) (leaselimit.Decision, error) {
		return leaselimit.Decision{}, internal
	}}
	var logs syncbuf.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	next := &okHandler{}
	h := httplimit.Middleware(f, httplimit.Header("X-Api-Key"), httplimit.WithLogger(logger))(next)
	r := httptest.NewRequest("GET", "/private/path", nil)
	r.Header.Set("X-Api-Key", "customer-api-key-123")
	resp := serve(h, r)
	_, body := readProblem(t, resp, 503)
	for _, leak := range []string{"10.1.2.3", "hunter2", "authority", "leaselimit", "reply", "customer-api-key-123"} {
		if strings.Contains(body, leak) {
			t.Errorf("503 body leaks %q: %s", leak, body)
		}
	}
	if intHeader(t, resp, "Retry-After") != 1 {
		t.Errorf("Retry-After %q", resp.Header.Get("Retry-After"))
	}
	if next.count() != 0 {
		t.Error("handler ran after a limiter error")
	}
	if v := resp.Header.Values(httplimit.HeaderRateLimit); len(v) != 0 {
		t.Errorf("RateLimit %q without a decision", v)
	}
	// Logged for the operator, without the key or the path.
	out := logs.String()
	if !strings.Contains(out, "unexpected reply") || !strings.Contains(out, "policy=api") {
		t.Errorf("log %q: want the error and the policy", out)
	}
	if strings.Contains(out, "customer-api-key-123") || strings.Contains(out, "/private/path") {
		t.Errorf("log leaks the key or path: %q", out)
	}

	t.Run("closed limiter", func(t *testing.T) {
		_, rdb := newRedis(t)
		c := newClient(t, rdb)
		lim := c.Limiter(policy.PerSecond(10))
		c.Close()
		resp := get(httplimit.Middleware(lim, constKey("k"), httplimit.WithLogger(slog.New(slog.DiscardHandler)))(&okHandler{}))
		_, body := readProblem(t, resp, 503)
		if strings.Contains(body, "closed") {
			t.Errorf("body leaks: %s", body)
		}
	})

	t.Run("request context ended: not logged", func(t *testing.T) {
		var logs syncbuf.Buffer
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		f := &fakeLimiter{limit: policy.PerSecond(1), decide: func(string, int64) (leaselimit.Decision, error) {
			return leaselimit.Decision{}, context.Canceled
		}}
		h := httplimit.Middleware(f, constKey("k"), httplimit.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))(&okHandler{})
		resp := serve(h, httptest.NewRequest("GET", "/", nil).WithContext(ctx))
		readProblem(t, resp, 503)
		if logs.String() != "" {
			t.Errorf("logged a client's cancellation: %q", logs.String())
		}
	})

	t.Run("invalid key from the limiter is a key error", func(t *testing.T) {
		f := &fakeLimiter{limit: policy.PerSecond(1), decide: func(string, int64) (leaselimit.Decision, error) {
			return leaselimit.Decision{}, leaselimit.ErrInvalidKey
		}}
		readProblem(t, get(httplimit.Middleware(f, constKey("k"))(&okHandler{})), 400)
	})

	t.Run("custom handler", func(t *testing.T) {
		var got error
		h := httplimit.Middleware(f, constKey("k"), httplimit.WithErrorHandler(func(w http.ResponseWriter, r *http.Request, err error) {
			got = err
			w.WriteHeader(http.StatusTeapot)
		}))(&okHandler{})
		if resp := get(h); resp.StatusCode != http.StatusTeapot || !errors.Is(got, internal) {
			t.Errorf("status %d err %v", resp.StatusCode, got)
		}
	})
}

func TestCustomDeniedHandler(t *testing.T) {
	l := policy.PerMinute(1).WithName("p")
	f := &fakeLimiter{limit: l, decide: func(string, int64) (leaselimit.Decision, error) {
		return leaselimit.Decision{Limit: l, RetryAfter: 3 * time.Second, Source: leaselimit.SourceCache}, nil
	}}
	var got leaselimit.Decision
	h := httplimit.Middleware(f, constKey("k"), httplimit.WithDeniedHandler(func(w http.ResponseWriter, r *http.Request, d leaselimit.Decision) {
		got = d
		if w.Header().Get("Retry-After") != "3" || w.Header().Get(httplimit.HeaderRateLimit) == "" {
			t.Errorf("denied handler runs before the header fields are set: %v", w.Header())
		}
		w.WriteHeader(http.StatusServiceUnavailable)
	}))(&okHandler{})
	resp := get(h)
	if resp.StatusCode != 503 || got.Source != leaselimit.SourceCache || got.Limit.Name != "p" {
		t.Errorf("status %d, decision %+v", resp.StatusCode, got)
	}
}

// TestConcurrent runs the middleware from many goroutines (for -race).
func TestConcurrent(t *testing.T) {
	_, rdb := newRedis(t)
	lim := newLimiter(t, rdb, policy.PerMinute(100))
	next := &okHandler{}
	h := httplimit.Middleware(lim, httplimit.ClientIP())(next)
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				resp := get(h)
				mu.Lock()
				codes[resp.StatusCode]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if codes[200] != 100 || codes[429] != 300 || next.count() != 100 {
		t.Errorf("codes %v, handler %d; want 100 allowed, 300 denied", codes, next.count())
	}
}

func TestMiddlewarePanics(t *testing.T) {
	mustPanic := func(name string, f func()) {
		t.Helper()
		defer func() {
			if recover() == nil {
				t.Errorf("%s did not panic", name)
			}
		}()
		f()
	}
	mustPanic("nil limiter", func() { httplimit.Middleware(nil, constKey("k")) })
	mustPanic("nil key", func() { httplimit.Middleware(allowAll(policy.PerSecond(1)), nil) })
	mustPanic("nil next", func() { httplimit.Middleware(allowAll(policy.PerSecond(1)), constKey("k"))(nil) })
	mustPanic("empty header", func() { httplimit.Header("") })
	mustPanic("empty composite", func() { httplimit.Composite() })
	mustPanic("nil in composite", func() { httplimit.Composite(nil) })
}
