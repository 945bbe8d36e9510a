// Package server is the HTTP service of examples/httpserver, in a package of
// its own so that tests can start exactly what the example serves.
package server

import (
	"fmt"
	"io"
	"log/slog"
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
	// only for requests Burst admits. The zero Daily turns the quota off.
	Burst, Daily policy.Limit
	// TrustedProxies are the prefixes of reverse proxies whose
	// X-Forwarded-For is honoured; none by default.
	TrustedProxies []netip.Prefix
	// LegacyHeaders adds X-RateLimit-Limit/Remaining/Reset.
	LegacyHeaders bool
	// Options for both Limiters, e.g. leaselimit.WithoutLease() or
	// leaselimit.WithFailureMode(policy.FailLocal).
	Options []leaselimit.Option
	// Logger, if not nil, gets both Limiters' operational lines (breaker
	// transitions, the failure policy taking over; leaselimit.WithLogger)
	// and the middleware's errors (httplimit.WithLogger). Default: the
	// Limiters log nothing and the middleware logs to slog.Default().
	Logger *slog.Logger
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
	limits       *leaselimit.Client
	burst, daily *leaselimit.Limiter // daily nil when turned off
	handler      http.Handler
}

// New builds the server on rdb. Close it to refund leased tokens.
//
// Routes:
//
//	GET /         "hello, <client address>", rate limited by burst, then daily
//	GET /healthz  "ok", not rate limited
func New(rdb redis.UniversalClient, cfg Config) (*Server, error) {
	opts := cfg.Options
	var hopts []httplimit.Option
	if cfg.Logger != nil {
		opts = append(opts[:len(opts):len(opts)], leaselimit.WithLogger(cfg.Logger)) // a copy: cfg.Options stays as given
		hopts = append(hopts, httplimit.WithLogger(cfg.Logger))
	}
	if cfg.LegacyHeaders {
		hopts = append(hopts, httplimit.WithLegacyHeaders())
	}
	if err := cfg.Burst.Validate(); err != nil {
		return nil, fmt.Errorf("burst limit: %w", err)
	}
	if cfg.Daily != (policy.Limit{}) {
		if err := cfg.Daily.Validate(); err != nil {
			return nil, fmt.Errorf("daily limit: %w", err)
		}
	}
	limits, err := leaselimit.NewClient(rdb, opts...)
	if err != nil {
		return nil, err
	}
	s := &Server{limits: limits, burst: limits.Limiter(cfg.Burst)}
	if cfg.Daily != (policy.Limit{}) {
		s.daily = limits.Limiter(cfg.Daily)
	}

	key := httplimit.ClientIP(cfg.TrustedProxies...)
	// The burst limit goes outside: a request it refuses never spends the
	// daily quota. A request it admits and the daily quota refuses has spent
	// a burst token, which comes back within seconds.
	limited := func(h http.Handler) http.Handler {
		if s.daily != nil {
			h = httplimit.Middleware(s.daily, key, hopts...)(h)
		}
		return httplimit.Middleware(s.burst, key, hopts...)(h)
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
	s.handler = mux
	return s, nil
}

// ServeHTTP serves the example's routes.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// Close closes the Limiters' Client, refunding their unused leased tokens.
func (s *Server) Close() error { return s.limits.Close() }
