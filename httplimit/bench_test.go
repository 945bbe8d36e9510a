package httplimit_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// nopWriter is a ResponseWriter that keeps one header map, cleared between
// requests, so the benchmark measures the middleware and not a recorder.
type nopWriter struct{ h http.Header }

func (w *nopWriter) Header() http.Header         { return w.h }
func (w *nopWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *nopWriter) WriteHeader(int)             {}

// alwaysAllow is a Limiter that admits everything without locking or
// recording, so the benchmark measures the middleware alone.
type alwaysAllow struct{ d leaselimit.Decision }

func (a alwaysAllow) Limit() policy.Limit { return a.d.Limit }
func (a alwaysAllow) AllowN(context.Context, string, int64) (leaselimit.Decision, error) {
	return a.d, nil
}

// BenchmarkMiddleware is the per-request overhead of Middleware over the bare
// handler: a no-op handler behind a Limiter that always admits.
func BenchmarkMiddleware(b *testing.B) {
	l := policy.PerSecond(1000).WithName("api")
	lim := alwaysAllow{leaselimit.Decision{Allowed: true, Limit: l, Remaining: 900, ResetAfter: l.Interval(100)}}
	nop := http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})
	key := func(*http.Request) (string, error) { return "client-1", nil }
	run := func(b *testing.B, h http.Handler) {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = "203.0.113.7:4711"
		w := &nopWriter{h: http.Header{}}
		b.ReportAllocs()
		for b.Loop() {
			clear(w.h)
			h.ServeHTTP(w, r)
		}
	}
	b.Run("bare", func(b *testing.B) { run(b, nop) })
	b.Run("middleware", func(b *testing.B) { run(b, httplimit.Middleware(lim, key)(nop)) })
	b.Run("middleware+legacy", func(b *testing.B) {
		run(b, httplimit.Middleware(lim, key, httplimit.WithLegacyHeaders())(nop))
	})
	b.Run("middleware+ClientIP", func(b *testing.B) { run(b, httplimit.Middleware(lim, httplimit.ClientIP())(nop)) })
	b.Run("two-middlewares", func(b *testing.B) {
		l2 := policy.Limit{Name: "daily", Rate: 10000, Period: 86400e9, Burst: 10000}
		lim2 := alwaysAllow{leaselimit.Decision{Allowed: true, Limit: l2, Remaining: 9000, ResetAfter: l2.Interval(1000)}}
		run(b, httplimit.Middleware(lim, key)(httplimit.Middleware(lim2, key)(nop)))
	})
	b.Run("denied", func(b *testing.B) {
		deny := alwaysAllow{leaselimit.Decision{Limit: l, RetryAfter: 1500000, ResetAfter: 1e9}}
		run(b, httplimit.Middleware(deny, key)(nop))
	})
	// With a real Limiter on miniredis, one hot key: the lease fast path.
	b.Run("leaselimit-lease-hit", func(b *testing.B) {
		mr := miniredis.RunT(b) // real time: the bucket refills as the benchmark runs
		rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
		defer rdb.Close()
		real := newLimiter(b, rdb, policy.Limit{Name: "api", Rate: 1 << 40, Period: 1e9, Burst: 1 << 20})
		run(b, httplimit.Middleware(real, key)(nop))
	})
}
