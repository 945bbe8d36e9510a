// Command httpserver is an HTTP server with two rate limits on one route, a
// burst limit of 10 requests per minute and a daily quota of 1000, per client
// address, with the RateLimit and RateLimit-Policy response header fields.
//
// By default it runs on an embedded Redis (miniredis), so it needs no set-up:
//
//	go run ./examples/httpserver
//	curl -i http://127.0.0.1:8080/
//
// Flags (-h lists them) choose the Redis (-redis ADDR), the limits (-rate,
// -period, -burst, -daily), what decides while Redis is unavailable
// (-failure-mode open, closed or local, with -fleet-size instances sharing
// the limits) and how long a Redis call may take before it does (-timeout).
// Behind a load balancer, -trusted-proxies 10.0.5.0/24 (its own subnet) honours
// X-Forwarded-For from those peers; without it every client shares the
// proxy's bucket, and the server logs a warning the first time a forwarded
// request arrives. SIGINT or SIGTERM stops it gracefully: requests in
// flight finish, then unused leased tokens go back to Redis.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit/examples/httpserver/server"
	"github.com/redis/go-redis/v9"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run serves until ctx ends, then shuts down gracefully. It returns the exit
// code: 0, 1 when serving failed, 2 for bad flags.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c, err := parseFlags(args, stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case err != nil:
		return 2
	}
	// Logs go to stderr: the Limiters' breaker transitions and fallbacks,
	// the middleware's errors, and, through the default logger,
	// httplimit.ClientIP's warning about untrusted proxies.
	logger := slog.New(slog.NewTextHandler(stderr, nil))
	old := slog.Default()
	slog.SetDefault(logger)
	defer slog.SetDefault(old)
	c.cfg.Logger = logger

	if err := serve(ctx, c, stdout); err != nil {
		fmt.Fprintf(stderr, "httpserver: %v\n", err)
		return 1
	}
	return 0
}

func serve(ctx context.Context, c *command, stdout io.Writer) error {
	opt := c.redis
	if opt == nil {
		mr, err := miniredis.Run()
		if err != nil {
			return fmt.Errorf("start the embedded Redis: %w", err)
		}
		defer mr.Close()
		opt = &redis.Options{Addr: mr.Addr()}
		fmt.Fprintf(stdout, "embedded Redis (miniredis) on %s\n", mr.Addr())
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()

	cfg := c.cfg
	cfg.Options = c.options()
	s, err := server.New(rdb, cfg)
	if err != nil {
		return err
	}
	defer s.Close() // after Shutdown: refunds leased tokens

	ln, err := net.Listen("tcp", c.addr)
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler:           s,
		ReadHeaderTimeout: 5 * time.Second,
		IdleTimeout:       time.Minute,
	}
	fmt.Fprintln(stdout, describe(c))
	fmt.Fprintf(stdout, "listening on http://%s\n", ln.Addr())

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	fmt.Fprintln(stdout, "shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = srv.Shutdown(sctx)
	if serr := <-errc; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}

// describe says in one line what the server enforces.
func describe(c *command) string {
	var b strings.Builder
	fmt.Fprintf(&b, "limits per client address: %s", c.cfg.Burst)
	if c.cfg.Daily.Rate > 0 {
		fmt.Fprintf(&b, "; %s", c.cfg.Daily)
	}
	fmt.Fprintf(&b, "; failure mode %s, fleet size %d, timeout %v; trusted proxies: ", c.mode, c.fleet, c.timeout)
	if len(c.cfg.TrustedProxies) == 0 {
		b.WriteString("none")
	}
	for i, p := range c.cfg.TrustedProxies {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString(p.String())
	}
	return b.String()
}
