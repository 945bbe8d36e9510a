package server_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/examples/httpserver/server"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

func TestMain(m *testing.M) {
	redistest.VerifyTestMain(m)
}

// member matches one RateLimit list member as the server writes it.
var member = regexp.MustCompile(`^"([a-z]+)";r=(\d+);t=(\d+)$`)

type result struct {
	status  int
	members [][]string // name, r, t
	retry   string
	body    string
}

// TestLoad drives the example server, on a loopback listener, with a real
// HTTP client: 300 requests from one client address, 8 at a time, against
// its burst limit of 50 per minute. Exactly 50 are admitted and 250 refused.
//
// Why exactly: miniredis's clock (the one the bucket runs on) is frozen, so
// nothing refills during the run — in real time a 50/minute bucket gains a
// token every 1.2 s, and a slow run would see one more admission. In exact
// mode every decision is one atomic script call, so the bucket grants
// exactly its 50 tokens. With leases (the default) tokens are debited from
// the bucket when a lease is granted, so the fleet — here one instance —
// never admits more than 50; and because the one client keeps asking until
// all 300 requests are done, no leased token is left unused at the end, so
// it never admits fewer.
//
// The time budget of a Redis call is raised from 100ms to 10s: under -race
// on a loaded machine a miniredis script call can take longer than 100ms,
// and the default failure policy (FailOpen) would then admit the request.
// That is the designed behaviour during an outage, but not what this test
// counts.
func TestLoad(t *testing.T) {
	for _, mode := range []struct {
		name string
		opts []leaselimit.Option
	}{
		{"exact", []leaselimit.Option{leaselimit.WithoutLease()}},
		{"leases", nil},
	} {
		t.Run(mode.name, func(t *testing.T) {
			mr := miniredis.RunT(t)
			mr.SetTime(time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC))
			rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
			defer rdb.Close()

			cfg := server.DefaultConfig()
			cfg.Burst = policy.PerMinute(50).WithName("burst")
			cfg.Options = append(mode.opts, leaselimit.WithTimeout(10*time.Second))
			s, err := server.New(rdb, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			ts := httptest.NewServer(s)
			defer ts.Close()
			client := &http.Client{Timeout: 10 * time.Second}
			defer client.CloseIdleConnections()

			const requests, workers = 300, 8
			results := make([]result, requests)
			jobs := make(chan int)
			var wg sync.WaitGroup
			start := time.Now()
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range jobs {
						results[i] = fetch(t, client, ts.URL+"/")
					}
				}()
			}
			for i := 0; i < requests; i++ {
				jobs <- i
			}
			close(jobs)
			wg.Wait()
			elapsed := time.Since(start)

			codes := map[int]int{}
			burstLeft := map[int64]int{}
			minDaily := int64(1 << 62)
			for i, r := range results {
				codes[r.status]++
				switch r.status {
				case http.StatusOK:
					if len(r.members) != 2 || r.members[0][0] != "burst" || r.members[1][0] != "daily" {
						t.Fatalf("request %d: RateLimit members %q, want burst then daily", i, r.members)
					}
					rem, _ := strconv.ParseInt(r.members[0][1], 10, 64)
					burstLeft[rem]++
					d, _ := strconv.ParseInt(r.members[1][1], 10, 64)
					minDaily = min(minDaily, d)
				case http.StatusTooManyRequests:
					// Both limits, the daily quota untouched by a refused request.
					if len(r.members) != 2 || r.members[0][0] != "burst" || r.members[0][1] != "0" || r.members[1][0] != "daily" {
						t.Fatalf("request %d: RateLimit members %q, want burst with r=0, then daily", i, r.members)
					}
					d, _ := strconv.ParseInt(r.members[1][1], 10, 64)
					minDaily = min(minDaily, d)
					if r.retry == "" || r.retry != r.members[0][2] {
						t.Fatalf("request %d: Retry-After %q, t %q", i, r.retry, r.members[0][2])
					}
					var p struct {
						Violated []string `json:"violated-policies"`
					}
					if err := json.Unmarshal([]byte(r.body), &p); err != nil || len(p.Violated) != 1 || p.Violated[0] != "burst" {
						t.Fatalf("request %d: body %s", i, r.body)
					}
				default:
					t.Fatalf("request %d: status %d, body %s", i, r.status, r.body)
				}
			}
			t.Logf("%s: %d requests in %v: %v", mode.name, requests, elapsed.Round(time.Millisecond), codes)
			if codes[http.StatusOK] != 50 || codes[http.StatusTooManyRequests] != requests-50 {
				t.Errorf("status counts %v, want 50 × 200 and %d × 429", codes, requests-50)
			}
			// The daily quota was spent by the admitted requests only.
			if minDaily != 1000-50 {
				t.Errorf("daily remaining %d after 50 admitted requests, want 950", minDaily)
			}
			if mode.name == "exact" {
				// One atomic decision each: every remaining count 49..0 once.
				for r := int64(0); r < 50; r++ {
					if burstLeft[r] != 1 {
						t.Errorf("burst r=%d seen %d times, want once (%v)", r, burstLeft[r], burstLeft)
						break
					}
				}
			}
		})
	}
}

func fetch(t *testing.T, c *http.Client, url string) result {
	resp, err := c.Get(url)
	if err != nil {
		t.Error(err)
		return result{}
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	r := result{status: resp.StatusCode, retry: resp.Header.Get("Retry-After"), body: string(body)}
	for _, v := range splitList(resp.Header.Get("RateLimit")) {
		m := member.FindStringSubmatch(v)
		if m == nil {
			t.Errorf("RateLimit member %q", v)
			continue
		}
		r.members = append(r.members, m[1:])
	}
	return r
}

func splitList(s string) []string {
	var out []string
	for _, p := range regexp.MustCompile(`,\s*`).Split(s, -1) {
		if p != "" {
			out = append(out, p)
		}
	}
	return out
}

func TestHealthzNotLimited(t *testing.T) {
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	cfg := server.DefaultConfig()
	cfg.Burst = policy.PerMinute(1).WithName("burst")
	s, err := server.New(rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := 0; i < 3; i++ {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil))
		if rec.Code != 200 || rec.Header().Get("RateLimit") != "" {
			t.Fatalf("healthz %d: %d %v", i, rec.Code, rec.Header())
		}
	}
}
