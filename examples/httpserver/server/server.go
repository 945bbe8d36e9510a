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
	// Burst is the short limit, Daily the long quota (a calendar quota:
	// policy.Quota), enforced together by one Limiter: a request takes a
	// token from each, or from none. The zero Daily turns the quota off.
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
// 1000 a day, from midnight UTC (daily).
func DefaultConfig() Config {
	return Config{
		Burst: policy.PerMinute(10).WithName("burst"),
		Daily: policy.Quota("daily", 1000, policy.Day, time.UTC),
	}
}

// Server is the example's handler and the Limiters behind it.
type Server struct {
	limits  *leaselimit.Client
	lim     *leaselimit.Limiter // the burst limit and the daily quota, or the burst limit alone
	handler http.Handler
}

// New builds the server on rdb. Close it to refund leased tokens.
//
// Routes:
//
//	GET /         "hello, <client address>", rate limited by burst and daily
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
	s := &Server{limits: limits, lim: limits.Limiter(cfg.Burst)}
	if cfg.Daily != (policy.Limit{}) {
		// Both limits in one Limiter: a request the burst limit refuses
		// takes nothing from the daily quota, and the response carries
		// both in its RateLimit fields.
		s.lim = limits.Limiter(cfg.Burst, cfg.Daily)
	}
	key := httplimit.ClientIP(cfg.TrustedProxies...)
	limited := httplimit.Middleware(s.lim, key, hopts...)
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
