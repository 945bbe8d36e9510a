// Package server is the HTTP service of examples/httpserver, in a package of
// its own so that tests can start exactly what the example serves.
package server

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// Config is what the example server enforces.
type Config struct {
	// Burst is the short limit, checked first; Daily the long quota, checked
	// only for requests Burst admits.
	Burst, Daily policy.Limit
	// TrustedProxies are the prefixes of reverse proxies whose
	// X-Forwarded-For is honoured; none by default.
	TrustedProxies []netip.Prefix
	// LegacyHeaders adds X-RateLimit-Limit/Remaining/Reset.
	LegacyHeaders bool
	// Options for both Limiters, e.g. leaselimit.WithoutLease().
	Options []leaselimit.Option
}

// DefaultConfig is 10 requests per minute per client address (burst), within
// 1000 a day (daily).
func DefaultConfig() Config {
	return Config{
		Burst: policy.PerMinute(10).WithName("burst"),
		Daily: policy.Limit{Name: "daily", Rate: 1000, Period: 24 * time.Hour, Burst: 1000},
	}
}

// Server is the example's handler and the Limiters behind it.
type Server struct {
	burst, daily *leaselimit.Limiter
	handler      http.Handler
}

// New builds the server on rdb. Close it to refund leased tokens.
//
// Routes:
//
//	GET /         "hello, <client address>", rate limited by burst, then daily
//	GET /healthz  "ok", not rate limited
func New(rdb redis.UniversalClient, cfg Config) (*Server, error) {
	burst, err := leaselimit.New(rdb, cfg.Burst, cfg.Options...)
	if err != nil {
		return nil, fmt.Errorf("burst limit: %w", err)
	}
	daily, err := leaselimit.New(rdb, cfg.Daily, cfg.Options...)
	if err != nil {
		burst.Close()
		return nil, fmt.Errorf("daily limit: %w", err)
	}

	key := httplimit.ClientIP(cfg.TrustedProxies...)
	var opts []httplimit.Option
	if cfg.LegacyHeaders {
		opts = append(opts, httplimit.WithLegacyHeaders())
	}
	// The burst limit goes outside: a request it refuses never spends the
	// daily quota. A request it admits and the daily quota refuses has spent
	// a burst token, which comes back within seconds.
	limited := func(h http.Handler) http.Handler {
		return httplimit.Middleware(burst, key, opts...)(httplimit.Middleware(daily, key, opts...)(h))
	}

	mux := http.NewServeMux()
	mux.Handle("GET /{$}", limited(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		client, _ := key(r)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "hello, "+client+"\n")
	})))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "ok\n")
	})
	return &Server{burst: burst, daily: daily, handler: mux}, nil
}

// ServeHTTP serves the example's routes.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// Close closes both Limiters, refunding their unused leased tokens.
func (s *Server) Close() error {
	return errors.Join(s.burst.Close(), s.daily.Close())
}
