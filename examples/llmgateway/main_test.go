package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/redis/go-redis/v9"
)

// TestGatewaySettles: each response is charged the tokens it produced, not
// the max_tokens it reserved, and one that ran past its estimate is charged
// the excess.
func TestGatewaySettles(t *testing.T) {
	mr := miniredis.RunT(t)
	mr.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)) // no refill during the test
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	// A budget of 10 s, not the default 100 ms: under -race on a loaded
	// machine a miniredis script call can take longer, and the failure
	// policy would then decide instead of the embedded Redis.
	c, err := leaselimit.NewClient(rdb, leaselimit.WithoutLease(), leaselimit.WithTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	lim := c.Limiter(tokensPerMinute)
	// A model that always produces 7 tokens more than it was asked for.
	greedy := func(_ context.Context, _ string, maxTokens int64, emit func(string) error) (int64, error) {
		return maxTokens + 7, emit("...")
	}
	for _, tc := range []struct {
		m    model
		url  string
		used int64
	}{
		{echoModel, "/v1/complete?max_tokens=500&prompt=one+two", 6}, // 2 words × 3
		{echoModel, "/v1/complete?max_tokens=4&prompt=a+b+c+d+e", 4}, // capped at max_tokens
		{greedy, "/v1/complete?max_tokens=100&prompt=x", 107},        // past its estimate
	} {
		before := remaining(t, lim)
		req := httptest.NewRequest("GET", tc.url, nil)
		req.Header.Set("X-Tenant", "acme")
		rec := httptest.NewRecorder()
		gateway(lim, tc.m).ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", tc.url, rec.Code, rec.Body)
		}
		if got := before - remaining(t, lim); got != tc.used {
			t.Errorf("%s: the tenant was charged %d tokens; want the %d produced", tc.url, got, tc.used)
		}
	}
}

func remaining(t *testing.T, lim *leaselimit.Limiter) int64 {
	t.Helper()
	d, err := lim.Peek(context.Background(), "acme")
	if err != nil {
		t.Fatal(err)
	}
	return d.Remaining
}
