// Command httpserver is an HTTP server with two rate limits on one route, a
// burst limit of 10 requests per minute and a daily quota of 1000, per client
// address, with the RateLimit and RateLimit-Policy response header fields.
//
// By default it runs on an embedded Redis (miniredis), so it needs no set-up:
//
//	go run ./examples/httpserver
//	curl -i http://127.0.0.1:8080/
//
// -redis ADDR uses a real Redis; -trusted-proxies 10.0.0.0/8,fd00::/8 honours
// X-Forwarded-For from those peers. SIGINT or SIGTERM stops it gracefully:
// requests in flight finish, then unused leased tokens go back to Redis.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
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
	fs := flag.NewFlagSet("httpserver", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", "127.0.0.1:8080", "listen `address`")
	redisAddr := fs.String("redis", "", "Redis `address`; empty starts an embedded Redis (miniredis)")
	trusted := fs.String("trusted-proxies", "", "comma-separated `prefixes` of proxies whose X-Forwarded-For is honoured")
	legacy := fs.Bool("legacy-headers", false, "also send X-RateLimit-Limit, -Remaining and -Reset")
	exact := fs.Bool("exact", false, "exact mode (leaselimit.WithoutLease): one Redis call per decision")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	cfg := server.DefaultConfig()
	cfg.LegacyHeaders = *legacy
	if *exact {
		cfg.Options = append(cfg.Options, leaselimit.WithoutLease())
	}
	for _, s := range strings.Split(*trusted, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			fmt.Fprintf(stderr, "httpserver: -trusted-proxies: %v\n", err)
			return 2
		}
		cfg.TrustedProxies = append(cfg.TrustedProxies, p)
	}
	if err := serve(ctx, *addr, *redisAddr, cfg, stdout); err != nil {
		fmt.Fprintf(stderr, "httpserver: %v\n", err)
		return 1
	}
	return 0
}

func serve(ctx context.Context, addr, redisAddr string, cfg server.Config, stdout io.Writer) error {
	if redisAddr == "" {
		mr, err := miniredis.Run()
		if err != nil {
			return fmt.Errorf("start the embedded Redis: %w", err)
		}
		defer mr.Close()
		redisAddr = mr.Addr()
		fmt.Fprintf(stdout, "embedded Redis (miniredis) on %s\n", redisAddr)
	}
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr})
	defer rdb.Close()

	s, err := server.New(rdb, cfg)
	if err != nil {
		return err
	}
	defer s.Close() // after Shutdown: refunds leased tokens

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler:           s,
		ReadHeaderTimeout: 5 * time.Second,
		IdleTimeout:       time.Minute,
	}
	fmt.Fprintf(stdout, "listening on http://%s (limits %q and %q per client address)\n",
		ln.Addr(), cfg.Burst.String(), cfg.Daily.String())

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
