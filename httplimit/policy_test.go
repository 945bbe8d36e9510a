package httplimit_test

import (
	"fmt"
	"math/big"
	"math/rand/v2"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/internal/clockhook"
	"github.com/leaselimit/leaselimit/policy"
)

// maxSFInt is the largest Structured Field Integer (RFC 9651, 15 digits).
const maxSFInt = 999_999_999_999_999

// withClock is the option that runs a Client on clk, which leaselimit
// keeps out of its API and hands to its own packages' tests.
func withClock(clk clockhook.Clock) leaselimit.Option {
	return clockhook.WithClock(clk).(leaselimit.Option)
}

// stepClock is a clock the test moves by hand, in step with
// miniredis's.
type stepClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *stepClock) Now() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *stepClock) set(t time.Time) { c.mu.Lock(); c.t = t; c.mu.Unlock() }

// advertised reads the one RateLimit-Policy member of resp as a client
// would: q, w and the burst (leaselimit-burst, or q when it is absent).
func advertised(t *testing.T, resp *http.Response) (q, w, burst int64) {
	t.Helper()
	ms := members(t, resp, httplimit.HeaderRateLimitPolicy) // checks the shape
	if len(ms) != 1 {
		t.Fatalf("RateLimit-Policy has %d members, want 1", len(ms))
	}
	q, w, burst = ms[0].a, ms[0].b, ms[0].a
	it := list(t, resp, httplimit.HeaderRateLimitPolicy)[0]
	if _, ok := it.Param("leaselimit-burst"); ok {
		burst, _ = it.Int("leaselimit-burst") // members checked it is an Integer
	}
	if q <= 0 || w <= 0 {
		t.Fatalf("RateLimit-Policy %q: want q and w positive", resp.Header.Get(httplimit.HeaderRateLimitPolicy))
	}
	return q, w, burst
}

// policyOf is the RateLimit-Policy field Middleware sends for l.
func policyOf(l policy.Limit) string {
	resp := get(httplimit.Middleware(allowAll(l), constKey("k"))(&okHandler{}))
	return resp.Header.Get(httplimit.HeaderRateLimitPolicy)
}

// TestPolicyField: RateLimit-Policy's q/w is the sustained rate, Rate per
// Period, in the shortest whole-second window, and leaselimit-burst the
// bucket's capacity when it is not q.
func TestPolicyField(t *testing.T) {
	tokyo, err := time.LoadLocation("Asia/Tokyo")
	if err != nil {
		t.Skip(err)
	}
	for _, tc := range []struct {
		limit policy.Limit
		want  string
	}{
		{policy.PerSecond(100).WithBurst(200).WithName("api"), `"api";q=100;w=1;leaselimit-burst=200`},
		{policy.PerSecond(100).WithBurst(10).WithName("api"), `"api";q=100;w=1;leaselimit-burst=10`},
		{policy.PerMinute(60).WithName("burst"), `"burst";q=60;w=60`},
		{policy.PerMinute(100).WithBurst(50).WithName("pro"), `"pro";q=100;w=60;leaselimit-burst=50`},
		{policy.PerDay(1000).WithName("daily"), `"daily";q=1000;w=86400`},
		{policy.Limit{Name: "fast", Rate: 5, Period: 100 * time.Millisecond, Burst: 7}, `"fast";q=50;w=1;leaselimit-burst=7`},
		{policy.Limit{Name: "odd", Rate: 7, Period: 1500 * time.Millisecond, Burst: 3}, `"odd";q=14;w=3;leaselimit-burst=3`},
		{policy.Limit{Name: "odd", Rate: 2, Period: 1500 * time.Millisecond, Burst: 4}, `"odd";q=4;w=3`},
		{policy.Limit{Name: "us", Rate: 1, Period: time.Microsecond, Burst: 1}, `"us";q=1000000;w=1;leaselimit-burst=1`},
		// Calendar quotas: their tokens per window's usual length.
		{policy.Quota("daily", 10_000, policy.Day, tokyo), `"daily";q=10000;w=86400`},
		{policy.Quota("monthly", 500, policy.Month, nil), `"monthly";q=500;w=2592000`},
		// Too many tokens for 15 digits: rounded down, never up.
		{policy.Limit{Name: "huge", Rate: policy.MaxRate, Period: time.Microsecond, Burst: policy.MaxRate}, `"huge";q=999999999999999;w=1`},
		// An invalid limit (its requests get the error handler's 500) still
		// gets a valid field.
		{policy.Limit{Name: "bad"}, `"bad";q=0;w=1`},
	} {
		if got := policyOf(tc.limit); got != tc.want {
			t.Errorf("%v: RateLimit-Policy %s; want %s", tc.limit, got, tc.want)
		}
	}
}

// TestPolicyFieldRate: for limits across the whole range, RateLimit-Policy
// is a valid Structured Field whose q/w never exceeds Rate/Period, equals
// it whenever the window's tokens fit in 15 digits, and is within 1e-9 of
// it otherwise.
func TestPolicyFieldRate(t *testing.T) {
	rng := rand.New(rand.NewPCG(26, 4))
	logUniform := func(hi int64) int64 { // 1..hi, every order of magnitude alike
		return max(1, min(hi, int64(float64(hi)/float64(uint64(1)<<rng.IntN(63)))+rng.Int64N(3)))
	}
	for i := 0; i < 2000; i++ {
		l := policy.Limit{Name: "p", Rate: logUniform(policy.MaxRate), Burst: logUniform(policy.MaxRate),
			Period: time.Duration(logUniform(int64(policy.MaxPeriod/time.Microsecond))) * time.Microsecond}
		if l.Validate() != nil {
			continue
		}
		resp := get(httplimit.Middleware(allowAll(l), constKey("k"))(&okHandler{}))
		q, w, burst := advertised(t, resp)
		// q/w against Rate/Period, as q·Period (µs) against Rate·w·10^6.
		adv := new(big.Int).Mul(big.NewInt(q), big.NewInt(l.PeriodMicros()))
		real := new(big.Int).Mul(big.NewInt(l.Rate), new(big.Int).Mul(big.NewInt(w), big.NewInt(1e6)))
		exact := new(big.Int).Mul(big.NewInt(l.Rate), new(big.Int).Div(lcm(l.PeriodMicros(), 1e6), big.NewInt(l.PeriodMicros())))
		switch c := adv.Cmp(real); {
		case c > 0:
			t.Fatalf("%v: %s advertises more than the sustained rate", l, resp.Header.Get(httplimit.HeaderRateLimitPolicy))
		case c < 0 && exact.Cmp(big.NewInt(maxSFInt)) <= 0:
			t.Fatalf("%v: %s rounds a rate whose window's tokens (%v) fit", l, resp.Header.Get(httplimit.HeaderRateLimitPolicy), exact)
		case c < 0:
			gap := new(big.Float).Quo(new(big.Float).SetInt(new(big.Int).Sub(real, adv)), new(big.Float).SetInt(real))
			if f, _ := gap.Float64(); f > 1e-9 && q < maxSFInt {
				t.Errorf("%v: %s is %.3g below the sustained rate", l, resp.Header.Get(httplimit.HeaderRateLimitPolicy), f)
			}
		}
		if want := min(l.Burst, maxSFInt); burst != want {
			t.Errorf("%v: %s: burst %d, want %d", l, resp.Header.Get(httplimit.HeaderRateLimitPolicy), burst, want)
		}
	}
}

func lcm(a, b int64) *big.Int {
	x, y := big.NewInt(a), big.NewInt(b)
	g := new(big.Int).GCD(nil, nil, x, y)
	return new(big.Int).Mul(x, new(big.Int).Div(y, g))
}

// TestPolicyFieldRate100Burst200: the fields of a limit of 100/s with a
// burst of 200, request by request, against a real Limiter (exact mode) on
// miniredis. RateLimit-Policy used to say q=200;w=1, and a client pacing
// to it got half its requests refused.
func TestPolicyFieldRate100Burst200(t *testing.T) {
	mr, rdb := newRedis(t)
	lim := newLimiter(t, rdb, policy.PerSecond(100).WithBurst(200).WithName("api"), leaselimit.WithoutLease())
	h := httplimit.Middleware(lim, constKey("k"))(&okHandler{})
	const policyField = `"api";q=100;w=1;leaselimit-burst=200`
	check := func(step string, resp *http.Response, code int, rateLimit, retryAfter string) {
		t.Helper()
		if resp.StatusCode != code || resp.Header.Get(httplimit.HeaderRateLimitPolicy) != policyField ||
			resp.Header.Get(httplimit.HeaderRateLimit) != rateLimit || resp.Header.Get("Retry-After") != retryAfter {
			t.Errorf("%s: %d, RateLimit-Policy %s, RateLimit %s, Retry-After %q; want %d, %s, %s, %q", step, resp.StatusCode,
				resp.Header.Get(httplimit.HeaderRateLimitPolicy), resp.Header.Get(httplimit.HeaderRateLimit),
				resp.Header.Get("Retry-After"), code, policyField, rateLimit, retryAfter)
		}
		advertised(t, resp) // a valid Structured Field
		members(t, resp, httplimit.HeaderRateLimit)
	}
	check("request 1", get(h), 200, `"api";r=199;t=1`, "") // the next token in 10 ms
	for i := 2; i < 200; i++ {
		get(h)
	}
	check("request 200", get(h), 200, `"api";r=0;t=1`, "")
	check("request 201", get(h), 429, `"api";r=0;t=1`, "1")
	mr.SetTime(frozen.Add(10 * time.Millisecond))
	check("10 ms later", get(h), 200, `"api";r=0;t=1`, "")
	mr.SetTime(frozen.Add(510 * time.Millisecond))
	check("500 ms later", get(h), 200, `"api";r=49;t=1`, "")
	mr.SetTime(frozen.Add(time.Hour))
	check("an hour later", get(h), 200, `"api";r=199;t=1`, "")
}

// TestPacingToPolicy: a client that spends its burst and then paces itself
// to RateLimit-Policy's q per w seconds is never refused, against a real
// Limiter (leases on and off) on miniredis, with Redis's clock and the
// Limiter's local clock stepped together to each request's time. A client
// pacing to the burst instead (what q said before) is refused.
func TestPacingToPolicy(t *testing.T) {
	for _, l := range []policy.Limit{
		policy.PerSecond(100).WithBurst(200).WithName("api"),              // q=100;w=1;leaselimit-burst=200
		policy.PerSecond(100).WithBurst(10).WithName("api"),               // q=100;w=1;leaselimit-burst=10
		{Name: "odd", Rate: 7, Period: 1500 * time.Millisecond, Burst: 3}, // q=14;w=3;leaselimit-burst=3
		policy.PerMinute(120).WithName("minute"),                          // q=120;w=60
	} {
		for _, lease := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/lease=%v", l, lease), func(t *testing.T) {
				mr, rdb := newRedis(t)
				clk := &stepClock{t: frozen}
				opts := []leaselimit.Option{withClock(clk)}
				if !lease {
					opts = append(opts, leaselimit.WithoutLease())
				}
				lim := newLimiter(t, rdb, l, opts...)
				h := httplimit.Middleware(lim, httplimit.Header("X-Client"))(&okHandler{})
				at := func(client string, d time.Duration) *http.Response {
					mr.SetTime(frozen.Add(d))
					clk.set(frozen.Add(d))
					r, _ := http.NewRequest("GET", "/", nil)
					r.Header.Set("X-Client", client)
					return serve(h, r)
				}
				resp := at("a", 0)
				q, w, burst := advertised(t, resp)
				for i := int64(2); i <= burst; i++ {
					if resp = at("a", 0); resp.StatusCode != http.StatusOK {
						t.Fatalf("burst request %d of %d: status %d", i, burst, resp.StatusCode)
					}
				}
				if rl := members(t, resp, httplimit.HeaderRateLimit); rl[0].a != 0 {
					t.Fatalf("after the burst of %d: RateLimit %v; want r=0", burst, rl)
				}

				// q per w seconds, evenly: request k at k·w/q seconds,
				// rounded up to Redis's microsecond.
				const n = 300
				refused := 0
				for k := int64(1); k <= n; k++ {
					if resp := at("a", paced(k, q, w)); resp.StatusCode != http.StatusOK {
						if refused++; refused <= 3 {
							t.Errorf("paced request %d at %v: status %d, RateLimit %q, Retry-After %q", k, paced(k, q, w),
								resp.StatusCode, resp.Header.Get(httplimit.HeaderRateLimit), resp.Header.Get("Retry-After"))
						}
					}
				}
				if refused > 0 {
					t.Errorf("%d of %d requests paced to q=%d;w=%d after the burst were refused; want none", refused, n, q, w)
				}

				// The test can tell: another client pacing to the burst per
				// w seconds, as the field used to advertise, is refused
				// when the burst is larger than q.
				if burst <= q {
					return
				}
				start := paced(n+1, q, w)
				for i := int64(0); i < burst; i++ {
					at("b", start)
				}
				refused = 0
				for k := int64(1); k <= n; k++ {
					if resp := at("b", start+paced(k, burst, w)); resp.StatusCode == http.StatusTooManyRequests {
						refused++
					}
				}
				if refused == 0 {
					t.Errorf("pacing to the burst (%d per %d s), above the rate, was never refused", burst, w)
				}
			})
		}
	}
}

// paced is when request k of a client sending q per w seconds goes out:
// k·w/q seconds, rounded up to a microsecond.
func paced(k, q, w int64) time.Duration {
	us := new(big.Int).Mul(big.NewInt(k), big.NewInt(w*1e6))
	us.Add(us, big.NewInt(q-1))
	us.Quo(us, big.NewInt(q))
	return time.Duration(us.Int64()) * time.Microsecond
}
