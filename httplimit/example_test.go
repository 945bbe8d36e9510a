package httplimit_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// Two limits on one route: a burst limit of 2 per minute outside a daily
// quota of 100, both per client address.
func Example() {
	mr, _ := miniredis.Run() // an embedded Redis for the example; use your own
	defer mr.Close()
	mr.SetTime(time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)) // a still clock, for stable output
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	c, err := leaselimit.NewClient(rdb)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	burst := c.Limiter(policy.PerMinute(2).WithName("burst"))
	daily := c.Limiter(policy.Limit{Name: "daily", Rate: 100, Period: 24 * time.Hour, Burst: 100})

	app := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hello\n")
	})
	key := httplimit.ClientIP() // r.RemoteAddr; list your proxies to honour X-Forwarded-For
	h := httplimit.Middleware(burst, key)(httplimit.Middleware(daily, key)(app))

	for i := 0; i < 3; i++ {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
		fmt.Println(rec.Code)
		fmt.Println("  RateLimit-Policy:", rec.Header().Get("RateLimit-Policy"))
		fmt.Println("  RateLimit:", rec.Header().Get("RateLimit"))
		if rec.Code == http.StatusTooManyRequests {
			fmt.Println("  Retry-After:", rec.Header().Get("Retry-After"))
			fmt.Print("  ", rec.Body.String())
		}
	}
	// Output:
	// 200
	//   RateLimit-Policy: "burst";q=2;w=60, "daily";q=100;w=86400
	//   RateLimit: "burst";r=1;t=30, "daily";r=99;t=864
	// 200
	//   RateLimit-Policy: "burst";q=2;w=60, "daily";q=100;w=86400
	//   RateLimit: "burst";r=0;t=30, "daily";r=98;t=864
	// 429
	//   RateLimit-Policy: "burst";q=2;w=60
	//   RateLimit: "burst";r=0;t=30
	//   Retry-After: 30
	//   {"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,"detail":"The quota of policy \"burst\" is exhausted; retry after 30 s.","violated-policies":["burst"]}
}

// A login limit that fails closed, while Redis is down: 503 with the time
// until the limiter tries Redis again, not a 429 "quota exceeded".
func Example_outage() {
	mr, _ := miniredis.Run()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	defer rdb.Close()
	c, err := leaselimit.NewClient(rdb)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	login := c.Limiter(policy.PerMinute(10).WithName("login")).With(leaselimit.WithFailureMode(policy.FailClosed))
	mr.Close() // Redis goes away

	app := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "welcome\n")
	})
	h := httplimit.Middleware(login, httplimit.ClientIP())(app)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("POST", "/login", nil))
	fmt.Println(rec.Code)
	fmt.Println("  RateLimit-Policy:", rec.Header().Get("RateLimit-Policy"))
	fmt.Printf("  RateLimit: %q\n", rec.Header().Get("RateLimit"))
	fmt.Println("  Retry-After:", rec.Header().Get("Retry-After"))
	fmt.Print("  ", rec.Body.String())
	// Output:
	// 503
	//   RateLimit-Policy: "login";q=10;w=60
	//   RateLimit: ""
	//   Retry-After: 1
	//   {"type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity","title":"Request cannot be satisfied due to temporary server capacity constraints","status":503,"detail":"Policy \"login\" is running at reduced capacity; retry after 1 s."}
}

// A handler whose cost is known only afterwards reserves an estimate,
// answers its decision as Middleware would (AddFields, Refuse), and
// settles the real cost when the work is done.
func Example_reserve() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	mr.SetTime(time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC))
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	c, err := leaselimit.NewClient(rdb)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	lim := c.Limiter(policy.PerMinute(100).WithName("tokens"))

	const estimate = 60 // the most a response may cost
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		res, err := lim.Reserve(r.Context(), r.Header.Get("X-Tenant"), estimate)
		if err != nil {
			http.Error(w, "rate limit unavailable", http.StatusServiceUnavailable)
			return
		}
		d := res.Decision()
		httplimit.AddFields(w.Header(), lim, d)
		if !d.Allowed {
			httplimit.Refuse(w, d) // 429 (503 during an outage), Retry-After, problem+json
			return
		}
		io.WriteString(w, "generated 25 tokens\n")
		if err := res.Settle(r.Context(), 25); err != nil { // gives back 60-25
			log.Print(err)
		}
	})

	for i := 0; i < 3; i++ {
		req := httptest.NewRequest("POST", "/generate", nil)
		req.Header.Set("X-Tenant", "acme")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Println(rec.Code, "RateLimit:", rec.Header().Get("RateLimit"))
		if rec.Code == http.StatusTooManyRequests {
			fmt.Println("  Retry-After:", rec.Header().Get("Retry-After"))
			fmt.Print("  ", rec.Body.String())
		}
	}
	// Output:
	// 200 RateLimit: "tokens";r=40;t=1
	// 200 RateLimit: "tokens";r=15;t=1
	// 429 RateLimit: "tokens";r=50;t=6
	//   Retry-After: 6
	//   {"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,"detail":"The quota of policy \"tokens\" has 50 left, fewer than the request needs; retry after 6 s.","violated-policies":["tokens"]}
}
