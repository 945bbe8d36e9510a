package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/examples/httpserver/server"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

const usage = `httpserver serves GET / with two rate limits per client address, a short
limit ("burst") and a daily quota ("daily"), and the RateLimit header fields.

Usage:
  go run ./examples/httpserver [flags]

Flags:
`

// command is what the flags chose.
type command struct {
	addr    string         // listen address
	redis   *redis.Options // nil: an embedded Redis (miniredis)
	mode    policy.FailureMode
	fleet   int
	timeout time.Duration
	exact   bool
	cfg     server.Config // without the Options above
}

// options are the Limiters' options the flags chose.
func (c *command) options() []leaselimit.Option {
	opts := []leaselimit.Option{
		leaselimit.WithFailureMode(c.mode),
		leaselimit.WithFleetSize(c.fleet),
		leaselimit.WithTimeout(c.timeout),
	}
	if c.exact {
		opts = append(opts, leaselimit.WithoutLease())
	}
	return opts
}

// parseFlags parses args, writing errors and -h's usage to stderr. It
// returns flag.ErrHelp for -h and another error for anything wrong.
func parseFlags(args []string, stderr io.Writer) (*command, error) {
	def := server.DefaultConfig()
	fs := flag.NewFlagSet("httpserver", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
	}
	c := &command{}
	fs.StringVar(&c.addr, "addr", "127.0.0.1:8080", "listen `address`")
	redisAddr := fs.String("redis", "", "Redis `ADDR` (host:port or redis:// URL); empty starts an embedded Redis (miniredis)")
	rate := fs.Int64("rate", def.Burst.Rate, `the "burst" limit: `+"`N`"+` requests per -period per client address`)
	period := fs.Duration("period", def.Burst.Period, `the "burst" limit's period`)
	burst := fs.Int64("burst", 0, `the "burst" limit's bucket capacity: `+"`N`"+` requests at once (0: -rate)`)
	daily := fs.Int64("daily", def.Daily.Rate, `the "daily" quota: `+"`N`"+` requests a day (from midnight UTC) per client address (0: none)`)
	mode := fs.String("failure-mode", policy.FailOpen.String(), "what decides while Redis is unavailable, `MODE` open (admit), "+
		"closed (deny) or local (each instance enforces 1/-fleet-size of each limit)")
	fs.IntVar(&c.fleet, "fleet-size", 1, "`N` instances sharing the limits behind a load balancer: under -failure-mode local each enforces 1/N")
	fs.DurationVar(&c.timeout, "timeout", leaselimit.DefaultTimeout, "budget of one Redis call; past it the failure mode decides")
	trusted := fs.String("trusted-proxies", "", "comma-separated `CIDRs` or addresses of the load balancers and reverse proxies "+
		"whose X-Forwarded-For is honoured; behind a proxy, without them every client shares the proxy's bucket")
	fs.BoolVar(&c.cfg.LegacyHeaders, "legacy-headers", false, "also send X-RateLimit-Limit, -Remaining and -Reset")
	fs.BoolVar(&c.exact, "exact", false, "exact mode (leaselimit.WithoutLease): one Redis call per decision")
	if err := fs.Parse(args); err != nil {
		return nil, err // printed by fs
	}

	fail := func(format string, a ...any) (*command, error) {
		err := fmt.Errorf(format, a...)
		fmt.Fprintf(stderr, "httpserver: %v\nRun with -h for the flags.\n", err)
		return nil, err
	}
	if fs.NArg() > 0 {
		return fail("unexpected argument %q: flags only", fs.Arg(0))
	}
	if *redisAddr != "" {
		opt, err := redisOptions(*redisAddr)
		if err != nil {
			return fail("-redis %q: %v", *redisAddr, err)
		}
		c.redis = opt
	}

	switch {
	case *rate < 1:
		return fail("-rate %d: must be at least 1", *rate)
	case *period <= 0:
		return fail("-period %v: must be > 0", *period)
	case *burst < 0:
		return fail("-burst %d: must be >= 0 (0: the same as -rate)", *burst)
	case *daily < 0:
		return fail("-daily %d: must be >= 0 (0: no daily quota)", *daily)
	case c.fleet < 1:
		return fail("-fleet-size %d: must be at least 1", c.fleet)
	case c.timeout <= 0:
		return fail("-timeout %v: must be > 0", c.timeout)
	}
	c.cfg.Burst = policy.Limit{Name: def.Burst.Name, Rate: *rate, Period: *period, Burst: *burst}
	if *burst == 0 {
		c.cfg.Burst.Burst = *rate
	}
	if err := c.cfg.Burst.Validate(); err != nil {
		return fail("-rate, -period, -burst: %v", err)
	}
	if *daily > 0 {
		c.cfg.Daily = policy.Quota(def.Daily.Name, *daily, policy.Day, time.UTC)
		if err := c.cfg.Daily.Validate(); err != nil {
			return fail("-daily: %v", err)
		}
	}

	var err error
	if c.mode, err = parseFailureMode(*mode); err != nil {
		return fail("-failure-mode %q: %v", *mode, err)
	}
	if c.cfg.TrustedProxies, err = parsePrefixes(*trusted); err != nil {
		return fail("-trusted-proxies: %v", err)
	}
	return c, nil
}

// parseFailureMode parses the String form of a policy.FailureMode.
func parseFailureMode(s string) (policy.FailureMode, error) {
	for _, m := range []policy.FailureMode{policy.FailOpen, policy.FailClosed, policy.FailLocal} {
		if s == m.String() {
			return m, nil
		}
	}
	return 0, errors.New("want open, closed or local")
}

// parsePrefixes parses a comma-separated list of CIDR prefixes; a bare
// address is the prefix of that address alone.
func parsePrefixes(list string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range strings.Split(list, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil || strings.Contains(s, "/") {
				return nil, fmt.Errorf("%q is neither a CIDR prefix (10.0.0.0/8, fd00::/8) nor an IP address", s)
			}
			p = netip.PrefixFrom(a.WithZone(""), a.BitLen())
		}
		out = append(out, p)
	}
	return out, nil
}

// redisOptions accepts host:port or a redis://, rediss:// or unix:// URL
// (password, database, TLS).
func redisOptions(addr string) (*redis.Options, error) {
	if strings.Contains(addr, "://") {
		return redis.ParseURL(addr)
	}
	return &redis.Options{Addr: addr}, nil
}
