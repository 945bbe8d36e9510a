//lint:file-ignore SA4006 the API screen lists each call with its results, as the README shows them, rather than handling each error

package leaselimit_test

// The README's snippets, compiled and run here (TestREADMEExamplesRun);
// TestREADMESnippetsCompile checks that the README shows them as they are.
// Each function holds one snippet between its first line and its trailing
// uses of otherwise unused names.

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
	_ "time/tzdata" // the quota snippet's zone, on any machine

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// apiInOneScreen is the README's "API in one screen".
func apiInOneScreen(ctx context.Context, rdb redis.UniversalClient, key string, n, estimate, actual int64, opts ...leaselimit.Option) error {
	client, err := leaselimit.NewClient(rdb, opts...) // the engine: one per process and Redis
	if err != nil {
		return err
	}
	defer client.Close()    // gives leased tokens back, stops background work, closes every Limiter
	err = client.Check(ctx) // Redis reachable, scripts loaded, ACL allows: for start-up and readiness

	api := client.Limiter(policy.Limit{Name: "api", Rate: 100, Period: time.Second, Burst: 200})
	d, err := api.Allow(ctx, key)               // AllowN(ctx, key, 1)
	d, err = api.AllowN(ctx, key, n)            // 1 <= n <= Burst, all or nothing
	err = api.Wait(ctx, key)                    // WaitN too: blocks until admitted; fails fast if ctx's deadline cannot be met
	d, err = api.Peek(ctx, key)                 // what is left, taking nothing
	res, err := api.Reserve(ctx, key, estimate) // take an estimate now...
	err = res.Settle(ctx, actual)               // ...and settle the actual cost later (or res.Cancel(ctx))
	err = api.Reset(ctx, key)                   // the bucket is full again, fleet-wide

	pro := client.Limiter(policy.PerMinute(1000).WithName("pro"))    // another limit, same Client: cheap per request once seen (limits are kept for the Client's life: plans and overrides, not one per request)
	login := api.With(leaselimit.WithFailureMode(policy.FailClosed)) // a view with its own failure policy
	trial := pro.With(leaselimit.WithShadow())                       // decided, counted, traced; not enforced
	// several limits at once: all or nothing
	both := client.Limiter(policy.PerSecond(10).WithName("burst"), policy.PerDay(10_000).WithName("daily"))

	// d.Allowed; d.Remaining; d.RetryAfter (denied: until this instance would admit n; with leases, a batch of them);
	// d.ResetAfter (until the bucket is full; with several limits, every one); d.Limit (the limit that decided);
	// d.Source (lease, authority, cache, or fallback while Redis cannot answer);
	// d.Parts (each limit's state, for several limits)
	_, _, _, _ = d, both, login, trial
	return err
}

// plans is the README's "Plans and tiers".
func plans(ctx context.Context, client *leaselimit.Client, user struct{ ID, Plan string }) (leaselimit.Decision, error) {
	var plans = map[string]policy.Limit{
		"free": policy.PerMinute(10).WithName("free"),
		"pro":  policy.PerMinute(1000).WithName("pro"),
	}
	d, err := client.Limiter(plans[user.Plan]).Allow(ctx, user.ID)
	return d, err
}

// severalLimits is the README's "Several limits at once".
func severalLimits(ctx context.Context, client *leaselimit.Client, userID string) (leaselimit.Decision, error) {
	perSecond := policy.PerSecond(5).WithName("burst")
	perDay := policy.PerDay(2_000).WithName("daily")
	d, err := client.Limiter(perSecond, perDay).Allow(ctx, userID)
	if err == nil && !d.Allowed {
		// d.Limit is the limit that denied; d.Parts each limit's state.
	}
	return d, err
}

// quota is the README's "Calendar quotas".
func quota(ctx context.Context, client *leaselimit.Client, tenant string) (leaselimit.Decision, error) {
	tokyo, err := time.LoadLocation("Asia/Tokyo")
	if err != nil {
		return leaselimit.Decision{}, err
	}
	daily := client.Limiter(policy.Quota("daily", 10_000, policy.Day, tokyo)) // resets at midnight in Tokyo
	d, err := daily.Allow(ctx, tenant)
	return d, err
}

// costsAfterwards is the README's "Costs known afterwards": an HTTP handler
// that reserves an estimate, streams the work and settles its real cost.
func costsAfterwards(llm *leaselimit.Limiter, tenantOf func(*http.Request) string, maxTokens int64, generate func(http.ResponseWriter) int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		res, err := llm.Reserve(r.Context(), tenantOf(r), maxTokens) // takes maxTokens now
		if err != nil {
			http.Error(w, "internal error", http.StatusInternalServerError) // an invalid key or estimate, ctx done: not a denial
			return
		}
		d := res.Decision()
		httplimit.AddFields(w.Header(), llm, d) // RateLimit-Policy and RateLimit, as the middleware sends
		if !d.Allowed {
			httplimit.Refuse(w, d) // 429 with Retry-After and problem+json (503 during an outage)
			return
		}
		used := generate(w)
		if err := res.Settle(r.Context(), used); err != nil { // gives back maxTokens-used, or charges the excess
			slog.WarnContext(r.Context(), "settle", "error", err) // Redis unreachable: queued, applied once when it answers
		}
	}
}

// middleware is the README's "HTTP".
func middleware(client *leaselimit.Client, mux *http.ServeMux) http.Handler {
	perIP := client.Limiter(policy.PerSecond(20).WithName("ip"))
	limit := httplimit.Middleware(perIP, httplimit.ClientIP()) // or your KeyFunc: an API key, a user ID
	return limit(mux)
}

// TestREADMEExamplesRun runs each README snippet once on an embedded Redis:
// they compile, and they do what the README says.
func TestREADMEExamplesRun(t *testing.T) {
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	if err := apiInOneScreen(ctx, rdb, "user:1", 2, 10, 4); err != nil {
		t.Fatalf("API in one screen: %v", err)
	}
	client, err := leaselimit.NewClient(rdb)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if d, err := plans(ctx, client, struct{ ID, Plan string }{"u1", "pro"}); err != nil || !d.Allowed || d.Limit.Name != "pro" {
		t.Errorf("plans: %+v, %v; want allowed by pro", d, err)
	}
	for i := 0; i < 6; i++ {
		d, err := severalLimits(ctx, client, "u2")
		if err != nil || d.Allowed != (i < 5) || len(d.Parts) != 2 {
			t.Fatalf("several limits, request %d: %+v, %v; want the first 5 allowed, two parts", i, d, err)
		}
		if i == 5 && d.Limit.Name != "burst" {
			t.Errorf("several limits: denied by %q; want burst", d.Limit.Name)
		}
	}
	if d, err := quota(ctx, client, "t1"); err != nil || !d.Allowed || d.ResetAfter <= 0 || d.ResetAfter > 24*time.Hour {
		t.Errorf("quota: %+v, %v; want allowed, reset within a day", d, err)
	}

	llm := client.Limiter(policy.PerMinute(100).WithName("llm"))
	// 60 reserved of 100, 50 used: 50 left, and the next estimate of 60 is
	// denied with the 10 given back counted.
	h := costsAfterwards(llm, func(*http.Request) string { return "tenant" }, 60, func(http.ResponseWriter) int64 { return 50 })
	for i, want := range []int{200, 429} {
		rec := httptest.NewRecorder()
		h(rec, httptest.NewRequest("POST", "/v1/complete", nil))
		if rec.Code != want || rec.Header().Get("RateLimit") == "" {
			t.Fatalf("costs afterwards, request %d: %d %v; want %d with RateLimit fields", i, rec.Code, rec.Header(), want)
		}
		if got := rec.Header().Get("RateLimit"); i == 1 && !strings.Contains(got, "r=50") {
			t.Errorf("costs afterwards: RateLimit %q after a settlement of 50 for 60; want r=50", got)
		}
	}

	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {})
	rec := httptest.NewRecorder()
	middleware(client, mux).ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
	if rec.Code != 200 || rec.Header().Get("RateLimit-Policy") == "" {
		t.Errorf("middleware: %d %v; want 200 with RateLimit-Policy", rec.Code, rec.Header())
	}
}
