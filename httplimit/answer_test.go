package httplimit_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/policy"
)

// answered is a response: status, header fields and body.
type answered struct {
	code   int
	header http.Header
	body   string
}

func record(h http.Handler) answered {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
	return answered{rec.Code, rec.Header(), rec.Body.String()}
}

// app is the protected handler of both sides.
func app(w http.ResponseWriter) { io.WriteString(w, "ok\n") }

// selfAnswering is a handler that decides with decide and answers with
// AddFields and Refuse, as a handler that calls the Limiter itself does;
// the decision it made goes to *d.
func selfAnswering(t *testing.T, lim httplimit.Limiter, d *leaselimit.Decision, decide func(context.Context) (leaselimit.Decision, error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var err error
		if *d, err = decide(r.Context()); err != nil {
			t.Errorf("decide: %v", err)
			return
		}
		httplimit.AddFields(w.Header(), lim, *d)
		if !d.Allowed {
			httplimit.Refuse(w, *d)
			return
		}
		app(w)
	})
}

// TestAnswerLikeMiddleware: a handler that decides itself (AllowN,
// Reserve) and answers with AddFields and Refuse sends byte for byte what
// Middleware sends for the same decisions: two Limiters on two Redis
// servers in the same state, one behind Middleware, one asked by the
// handler, step by step.
func TestAnswerLikeMiddleware(t *testing.T) {
	api := policy.PerMinute(4).WithName("api")
	burst := policy.Limit{Name: "burst", Rate: 10, Period: time.Minute, Burst: 10}
	daily := policy.Limit{Name: "daily", Rate: 2, Period: 24 * time.Hour, Burst: 2}
	live := func(t *testing.T, l policy.Limit, opts ...leaselimit.Option) *leaselimit.Limiter {
		_, rdb := newRedis(t)
		return newLimiter(t, rdb, l, opts...)
	}
	for _, c := range []struct {
		name string
		lim  func(t *testing.T) *leaselimit.Limiter
		cost int64
		// want is each step's status and what its decision must have
		// been, so that every case is exercised.
		want []int
		of   func(d leaselimit.Decision) bool
	}{
		{"allowed and denied", func(t *testing.T) *leaselimit.Limiter { return live(t, api) }, 1,
			[]int{200, 200, 200, 200, 429, 429}, nil},
		{"cost 3", func(t *testing.T) *leaselimit.Limiter { return live(t, api) }, 3,
			[]int{200, 429}, nil},
		{"without lease", func(t *testing.T) *leaselimit.Limiter { return live(t, api, leaselimit.WithoutLease()) }, 1,
			[]int{200, 200, 200, 200, 429}, nil},
		{"quota", func(t *testing.T) *leaselimit.Limiter {
			return live(t, policy.Quota("monthly", 2, policy.Month, time.UTC))
		}, 1, []int{200, 200, 429}, nil},
		{"multi-limit", func(t *testing.T) *leaselimit.Limiter {
			_, rdb := newRedis(t)
			return newClient(t, rdb).Limiter(burst, daily)
		}, 1,
			[]int{200, 200, 429, 429}, func(d leaselimit.Decision) bool { return len(d.Parts) == 2 }},
		{"outage, FailClosed", func(t *testing.T) *leaselimit.Limiter { return downLimiter(t, api, policy.FailClosed) }, 1,
			[]int{503, 503}, func(d leaselimit.Decision) bool { return d.Source == leaselimit.SourceFallback }},
		{"outage, FailLocal", func(t *testing.T) *leaselimit.Limiter {
			return downLimiter(t, api, policy.FailLocal, withClock(&stepClock{t: frozen}))
		}, 1, []int{200, 200, 503}, func(d leaselimit.Decision) bool { return d.Source == leaselimit.SourceFallback }},
		{"multi-limit, outage", func(t *testing.T) *leaselimit.Limiter {
			return downClient(t, policy.FailClosed).Limiter(burst, daily)
		}, 1, []int{503}, func(d leaselimit.Decision) bool { return d.Source == leaselimit.SourceFallback }},
		{"outage, FailOpen", func(t *testing.T) *leaselimit.Limiter { return downLimiter(t, api, policy.FailOpen) }, 1,
			[]int{200, 200}, func(d leaselimit.Decision) bool { return d.Source == leaselimit.SourceFallback }},
		{"shadow", func(t *testing.T) *leaselimit.Limiter { return live(t, api, leaselimit.WithShadow()) }, 2,
			[]int{200, 200, 200}, func(d leaselimit.Decision) bool { return d.Shadow }},
		{"outage, shadow", func(t *testing.T) *leaselimit.Limiter {
			return downLimiter(t, api, policy.FailClosed, leaselimit.WithShadow())
		}, 1, []int{200}, func(d leaselimit.Decision) bool { return d.ShadowDenied }},
	} {
		t.Run(c.name, func(t *testing.T) {
			cost := func(*http.Request) int64 { return c.cost }
			viaMiddleware := httplimit.Middleware(c.lim(t), constKey("k"), httplimit.WithCost(cost))(
				http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { app(w) }))
			var d leaselimit.Decision
			own := c.lim(t)
			byAllowN := selfAnswering(t, own, &d, func(ctx context.Context) (leaselimit.Decision, error) {
				return own.AllowN(ctx, "k", c.cost)
			})
			for i, code := range c.want {
				want, got := record(viaMiddleware), record(byAllowN)
				if got.code != code || want.code != code {
					t.Errorf("step %d: handler %d, Middleware %d; want %d", i, got.code, want.code, code)
				}
				if c.of != nil && !c.of(d) {
					t.Errorf("step %d: decision %+v is not the case's", i, d)
				}
				if !reflect.DeepEqual(got, want) {
					t.Errorf("step %d: handler answered\n%v\nMiddleware\n%v", i, got, want)
				}
			}
		})
	}

	// Reserve and Settle inside the handler answer as AllowN behind
	// Middleware does.
	t.Run("reserve", func(t *testing.T) {
		viaMiddleware := httplimit.Middleware(live(t, api), constKey("k"),
			httplimit.WithCost(func(*http.Request) int64 { return 2 }))(
			http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { app(w) }))
		own := live(t, api)
		var settle []*leaselimit.Reservation
		var d leaselimit.Decision
		byReserve := selfAnswering(t, own, &d, func(ctx context.Context) (leaselimit.Decision, error) {
			res, err := own.Reserve(ctx, "k", 2)
			if err != nil {
				return leaselimit.Decision{}, err
			}
			settle = append(settle, res)
			return res.Decision(), nil
		})
		for i, code := range []int{200, 200, 429} {
			want, got := record(viaMiddleware), record(byReserve)
			if got.code != code || !reflect.DeepEqual(got, want) {
				t.Errorf("step %d: Reserve answered\n%v\nMiddleware (want %d)\n%v", i, got, code, want)
			}
		}
		for _, res := range settle {
			if err := res.Settle(context.Background(), 2); err != nil {
				t.Errorf("Settle: %v", err)
			}
		}
	})
}

// TestAnswerComposed: a decision made inside a Middleware's handler adds
// its members after the Middleware's, as an inner Middleware's would.
func TestAnswerComposed(t *testing.T) {
	_, rdb := newRedis(t)
	outer := newLimiter(t, rdb, policy.PerMinute(10).WithName("ip"))
	inner := newLimiter(t, rdb, policy.PerMinute(1).WithName("tenant"))
	var d leaselimit.Decision
	h := httplimit.Middleware(outer, constKey("k"))(selfAnswering(t, inner, &d, func(ctx context.Context) (leaselimit.Decision, error) {
		return inner.AllowN(ctx, "k", 1)
	}))
	for i, want := range []answered{
		{200, http.Header{
			"Ratelimit-Policy": {`"ip";q=10;w=60, "tenant";q=1;w=60`},
			"Ratelimit":        {`"ip";r=9;t=6, "tenant";r=0;t=60`},
		}, "ok\n"},
		{429, http.Header{
			"Ratelimit-Policy": {`"ip";q=10;w=60, "tenant";q=1;w=60`},
			"Ratelimit":        {`"ip";r=8;t=6, "tenant";r=0;t=60`},
			"Retry-After":      {"60"},
		}, `{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,"detail":"The quota of policy \"tenant\" is exhausted; retry after 60 s.","violated-policies":["tenant"]}`},
	} {
		got := record(h)
		for _, f := range []string{"Ratelimit-Policy", "Ratelimit", "Retry-After"} {
			if !reflect.DeepEqual(got.header[f], want.header[f]) {
				t.Errorf("step %d: %s %q, want %q", i, f, got.header[f], want.header[f])
			}
		}
		if got.code != want.code || got.body != want.body {
			t.Errorf("step %d: %d %s; want %d %s", i, got.code, got.body, want.code, want.body)
		}
	}
}

// TestAnswerNothing: AddFields adds nothing for a Decision returned with
// an error or a shadow decision, and Refuse writes nothing for an allowed
// one.
func TestAnswerNothing(t *testing.T) {
	l := policy.PerMinute(4).WithName("api")
	for _, d := range []leaselimit.Decision{
		{Source: leaselimit.SourceNone},
		{Allowed: true, Shadow: true, ShadowDenied: true, Limit: l, RetryAfter: time.Second},
	} {
		h := http.Header{}
		httplimit.AddFields(h, allowAll(l), d)
		if len(h) != 0 {
			t.Errorf("AddFields(%+v) added %v", d, h)
		}
	}
	rec := httptest.NewRecorder()
	httplimit.Refuse(rec, leaselimit.Decision{Allowed: true, Limit: l, Remaining: 3})
	if len(rec.Header()) != 0 || rec.Body.Len() != 0 || rec.Code != http.StatusOK {
		t.Errorf("Refuse of an allowed decision wrote %d %v %q", rec.Code, rec.Header(), rec.Body)
	}
}

// TestRefuseWeighted: a request refused for more tokens than are left says
// how many are, not that the quota is exhausted.
func TestRefuseWeighted(t *testing.T) {
	_, rdb := newRedis(t)
	lim := newLimiter(t, rdb, policy.Limit{Name: "llm", Rate: 1000, Period: time.Hour, Burst: 1000})
	ctx := context.Background()
	if d, err := lim.AllowN(ctx, "k", 300); err != nil || !d.Allowed {
		t.Fatalf("AllowN(300) = %+v, %v", d, err)
	}
	d, err := lim.AllowN(ctx, "k", 800)
	if err != nil || d.Allowed || d.Remaining != 700 {
		t.Fatalf("AllowN(800) = %+v, %v; want a denial with 700 left", d, err)
	}
	w := httptest.NewRecorder()
	httplimit.Refuse(w, d)
	if body := w.Body.String(); !strings.Contains(body, `The quota of policy \"llm\" has 700 left, fewer than the request needs; retry after `) {
		t.Errorf("429 body %s; want it to say 700 are left", body)
	}
}
