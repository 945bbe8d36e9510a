// Command leaselimit-demo shows, in under a minute and with no set-up, why
// leaselimit exists and that it works.
//
// It simulates a fleet of service instances behind a load balancer, each with
// its own Redis client and limiter, and sends the same traffic (one hot key, a
// long tail of keys, one abusive client far over its limit) through three
// designs, one after another:
//
//	(a) a token bucket in every instance (golang.org/x/time/rate, one limiter
//	    per key per instance): no Redis, but the fleet admits N× the limit;
//	(b) one Redis round trip per request: leaselimit with WithoutLease(), which
//	    is exactly the classic per-request Lua token bucket;
//	(c) leaselimit with its default leases.
//
// Then Redis goes down for a few seconds and comes back, and leaselimit runs
// through the outage under each failure policy (FailOpen, FailClosed,
// FailLocal).
//
// By default it starts an embedded Redis (miniredis); -redis ADDR or
// -redis-cluster ADDR1,ADDR2,... use a real one. -chart FILE.svg writes a chart
// of the hot key's admitted requests per second over the whole run.
//
// Decisions are traced with OpenTelemetry. -otlp ENDPOINT, or the standard
// OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, exports the
// spans of every Limiter over OTLP/HTTP, sampling -trace-ratio of the
// decisions (default 1%). Their resource names the service (leaselimit-demo),
// its version (leaselimit.Version) and the process (service.instance.id, a
// random UUID per run); OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
// override them. Without an endpoint, one instance of design (c) and
// one of the outage act record every decision in memory, and a few of those
// spans are printed at the end.
//
//	go run ./cmd/leaselimit-demo
//	go run ./cmd/leaselimit-demo -chart demo.svg
//	go run ./cmd/leaselimit-demo -otlp http://localhost:4318 -trace-ratio 0.1
//	go run ./cmd/leaselimit-demo -redis localhost:6379 -instances 16
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/leaselimit/leaselimit"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Exit codes of run.
const (
	exitOK     = 0
	exitFailed = 1 // the demo could not run, or leaselimit broke a stated guarantee
	exitUsage  = 2 // bad flags
)

// config is the parsed command line.
type config struct {
	redisAddr string   // -redis
	cluster   []string // -redis-cluster
	instances int
	workers   int // per instance
	duration  time.Duration
	outage    time.Duration
	chart     string
	seed      uint64
	limit     int64   // tokens per second, and the burst
	load      float64 // offered decisions per second across the fleet
	tailKeys  int
	timeout   time.Duration // act 1; 0: automatic
	// Lengths of the outage act before Redis stops and after it is back.
	warmup, recovery time.Duration
	otlp             string  // -otlp: base URL of an OTLP/HTTP collector
	traceRatio       float64 // -trace-ratio
}

const usageText = `leaselimit-demo: a simulated fleet of service instances behind a load balancer,
rate limited per key three ways, then a Redis outage.

The same traffic (one hot key, a long tail of keys, one abusive client far over
its limit) runs through three designs, one after another:
  (a) per-instance token buckets (golang.org/x/time/rate in every instance)
  (b) one Redis round trip per request (leaselimit.WithoutLease(): the classic
      per-request Lua token bucket)
  (c) leaselimit with leases (the default)
and the tables compare what each admitted against the ideal Burst + Rate·T,
its decisions per second, Redis commands per decision and latency.
Then Redis stops for -outage and comes back while leaselimit runs under each
failure policy (FailOpen, FailClosed, FailLocal) side by side.
Decisions are traced with OpenTelemetry: -otlp ENDPOINT (or the standard
OTEL_EXPORTER_OTLP_ENDPOINT) exports them over OTLP/HTTP; without an endpoint a
few sample decision spans are printed at the end.

Usage:
  go run ./cmd/leaselimit-demo [flags]

Flags:
`

// parseFlags parses args. It returns exitOK with a nil config for -h, and
// exitUsage after printing a clear error for bad flags or values.
func parseFlags(args []string, stderr io.Writer) (*config, int) {
	fs := flag.NewFlagSet("leaselimit-demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usageText)
		fs.PrintDefaults()
	}
	cfg := &config{warmup: 2 * time.Second, recovery: 3 * time.Second}
	var cluster string
	fs.StringVar(&cfg.redisAddr, "redis", "", "`ADDR` (host:port or redis:// URL) of a Redis server to use instead of the embedded one (miniredis); the outage act needs the embedded one and is skipped")
	fs.StringVar(&cluster, "redis-cluster", "", "comma-separated `ADDRS` of Redis Cluster nodes to use instead of the embedded Redis")
	fs.IntVar(&cfg.instances, "instances", 8, "`N` service instances in the fleet, each with its own Redis client and limiter")
	fs.IntVar(&cfg.workers, "workers", 4, "concurrent request goroutines per instance")
	fs.DurationVar(&cfg.duration, "duration", 8*time.Second, "how long each of the three designs runs")
	fs.DurationVar(&cfg.outage, "outage", 3*time.Second, "how long Redis is down in the outage act (0 skips the act)")
	fs.StringVar(&cfg.chart, "chart", "", "write an SVG chart of the hot key's admitted requests per second to `FILE.svg`")
	fs.Uint64Var(&cfg.seed, "seed", 1, "seed of the traffic generator (the same seed sends the same keys)")
	fs.Int64Var(&cfg.limit, "limit", 100, "the limit of every key: `N` requests per second, burst N")
	fs.Float64Var(&cfg.load, "load", 2500, "offered requests per second across the fleet: 40% hot key, 52% abusive client, 8% long tail")
	fs.IntVar(&cfg.tailKeys, "tail-keys", 2000, "number of keys in the long tail")
	fs.StringVar(&cfg.otlp, "otlp", "", "export the decision spans of every leaselimit Limiter over OTLP/HTTP to the collector at `ENDPOINT`: "+
		"http://HOST:4318, https://..., or HOST:PORT for plain HTTP; /v1/traces is appended, as for "+envEndpoint+". "+
		"Default: "+envTracesEndpoint+" or "+envEndpoint+" if set; with neither, a few sample decision spans are printed instead. "+
		"An unreachable collector does not fail the demo: export errors are reported at the end")
	fs.Float64Var(&cfg.traceRatio, "trace-ratio", 0.01, "fraction of decisions traced when exporting: `R` between 0 and 1, for ParentBased(TraceIDRatioBased(R))")
	fs.DurationVar(&cfg.timeout, "timeout", 0, "leaselimit's budget for one Redis call in act 1 (leaselimit.WithTimeout). Default 0: "+
		embeddedTimeout.String()+" on the embedded Redis, whose Lua is slow, and leaselimit's default "+leaselimit.DefaultTimeout.String()+
		" on a real one. The outage act always uses leaselimit's default")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, exitOK
		}
		// The flag package has printed the error and the usage.
		return nil, exitUsage
	}
	if cluster != "" {
		for _, a := range strings.Split(cluster, ",") {
			if a = strings.TrimSpace(a); a != "" {
				cfg.cluster = append(cfg.cluster, a)
			}
		}
	}
	if err := cfg.validate(fs.Args()); err != nil {
		fmt.Fprintf(stderr, "leaselimit-demo: %v\nRun with -h for the flags and their defaults.\n", err)
		return nil, exitUsage
	}
	return cfg, exitOK
}

func (c *config) validate(rest []string) error {
	switch {
	case len(rest) > 0:
		return fmt.Errorf("unexpected argument %q: this command takes flags only", rest[0])
	case c.redisAddr != "" && len(c.cluster) > 0:
		return errors.New("-redis and -redis-cluster cannot both be given")
	case c.instances < 1 || c.instances > 1000:
		return fmt.Errorf("-instances must be between 1 and 1000, got %d", c.instances)
	case c.workers < 1 || c.workers > 256:
		return fmt.Errorf("-workers must be between 1 and 256, got %d", c.workers)
	case c.duration < 100*time.Millisecond || c.duration > time.Hour:
		return fmt.Errorf("-duration must be between 100ms and 1h, got %v", c.duration)
	case c.outage < 0 || c.outage > 10*time.Minute:
		return fmt.Errorf("-outage must be between 0 (skip the act) and 10m, got %v", c.outage)
	case c.limit < 1 || c.limit > 1_000_000:
		return fmt.Errorf("-limit must be between 1 and 1000000 requests per second, got %d", c.limit)
	case !(c.load >= 1 && c.load <= 10_000_000): // also rejects NaN
		return fmt.Errorf("-load must be between 1 and 10000000 requests per second, got %v", c.load)
	case c.tailKeys < 1 || c.tailKeys > 10_000_000:
		return fmt.Errorf("-tail-keys must be between 1 and 10000000, got %d", c.tailKeys)
	case c.timeout < 0 || c.timeout > time.Minute:
		return fmt.Errorf("-timeout must be between 0 (automatic) and 1m, got %v", c.timeout)
	case c.chart != "" && !strings.HasSuffix(strings.ToLower(c.chart), ".svg"):
		return fmt.Errorf("-chart %q: the chart is SVG, give a file name ending in .svg", c.chart)
	case !(c.traceRatio >= 0 && c.traceRatio <= 1): // also rejects NaN
		return fmt.Errorf("-trace-ratio must be between 0 and 1, got %v", c.traceRatio)
	}
	if c.otlp != "" {
		if _, err := otlpURL(c.otlp); err != nil {
			return err
		}
	}
	if c.redisAddr != "" {
		if _, err := redisOptions(c.redisAddr); err != nil {
			return err
		}
	}
	return nil
}

// run is the whole program: it parses args, runs the acts, writes the report
// to stdout and progress to stderr, and returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, code := parseFlags(args, stderr)
	if cfg == nil {
		return code
	}
	d := &demo{cfg: cfg, out: stdout, errOut: stderr, progress: newProgress(stderr)}
	logs.mu.Lock()
	logs.p = d.progress
	logs.mu.Unlock()
	defer func() {
		logs.mu.Lock()
		logs.p = nil
		logs.mu.Unlock()
	}()
	if err := d.run(ctx); err != nil {
		d.progress.done()
		if ctx.Err() != nil {
			fmt.Fprintln(stderr, "leaselimit-demo: interrupted")
		} else {
			fmt.Fprintf(stderr, "leaselimit-demo: %v\n", err)
		}
		return exitFailed
	}
	if len(d.violations) > 0 {
		fmt.Fprintf(stdout, "\nFAILED: leaselimit broke a stated guarantee:\n")
		for _, v := range d.violations {
			fmt.Fprintf(stdout, "  - %s\n", v)
		}
		return exitFailed
	}
	return exitOK
}
