// Command fleet deploys examples/httpserver as users deploy it and breaks
// its Redis: it starts one redis-server and N instances of the example
// server (real processes, built once from the root module), puts them
// behind a load balancer (nginx or HAProxy when installed, an in-process Go
// reverse proxy otherwise), drives them with vegeta at a fixed rate above
// the limit over many client keys, and runs phases: no fault, short stalls
// of Redis (SIGSTOP), a longer stop, a kill and restart. For each phase it
// prints admitted requests against the bound, 429s, 503s, other errors and
// latency percentiles, and how fast decisions were while Redis could not
// answer.
//
//	go run ./cmd/fleet [-short] [-instances 4] [-failure-mode open] [-timeout 100ms] [-phases baseline,stalls,outage,kill] ...
//
// Every process it starts is stopped when it exits, on an error and on
// Ctrl-C too. See README.md for the flags and the columns.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
)

// config is what the flags chose.
type config struct {
	instances  int
	mode       string // open, closed or local
	timeout    time.Duration
	exact      bool
	limit      policy.Limit // per client key
	rate       int          // requests/s sent, over all keys
	keys       int
	duration   time.Duration // of each phase
	phases     []string
	stalls     int
	stall      time.Duration
	outage     time.Duration
	settle     time.Duration
	lb         string
	serverSrc  string
	serverBin  string
	reqTimeout time.Duration
	keep       bool
}

// phaseNames are the phases -phases may name, in their default order.
var phaseNames = []string{"baseline", "stalls", "outage", "kill"}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-proxy-listen" {
		// fleet runs itself as its Go reverse proxy (see startGoProxy).
		ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer cancel()
		fs := flag.NewFlagSet("fleet proxy", flag.ExitOnError)
		listen := fs.String("proxy-listen", "", "address to serve the proxy on")
		backends := fs.String("proxy-backends", "", "comma-separated addresses to send requests to, in turn")
		fs.Parse(os.Args[1:])
		if err := serveProxy(ctx, *listen, strings.Split(*backends, ",")); err != nil {
			fmt.Fprintln(os.Stderr, "fleet proxy:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "fleet:", err)
		os.Exit(1)
	}
}

func parseFlags() (*config, error) {
	cfg := &config{}
	flag.IntVar(&cfg.instances, "instances", 4, "`N` instances of examples/httpserver (also their -fleet-size)")
	flag.StringVar(&cfg.mode, "failure-mode", "open", "the instances' failure policy: open, closed or local")
	flag.DurationVar(&cfg.timeout, "timeout", leaselimit.DefaultTimeout, "the instances' budget for one Redis call")
	flag.BoolVar(&cfg.exact, "exact", false, "run the instances in exact mode (no leases)")
	limit := flag.Int64("limit", 5, "`N` requests per -period per client key")
	period := flag.Duration("period", time.Second, "the limit's period")
	burst := flag.Int64("burst", 0, "the limit's burst (0: -limit)")
	flag.IntVar(&cfg.rate, "rate", 0, "requests/s sent over all keys, open loop (0: 1.5× what the limit admits over all keys)")
	flag.IntVar(&cfg.keys, "keys", 200, "client keys (addresses in X-Forwarded-For), each sent an equal share of the requests in turn")
	flag.DurationVar(&cfg.duration, "duration", 20*time.Second, "length of each phase")
	phases := flag.String("phases", strings.Join(phaseNames, ","), "comma-separated phases to run, in order: baseline (no fault), stalls (-stalls SIGSTOPs of -stall), outage (SIGSTOP for -outage), kill (SIGKILL, restart after -outage)")
	flag.IntVar(&cfg.stalls, "stalls", 8, "SIGSTOP stalls of Redis in the stalls phase, spread evenly over it")
	flag.DurationVar(&cfg.stall, "stall", 200*time.Millisecond, "length of one stall")
	flag.DurationVar(&cfg.outage, "outage", 3*time.Second, "how long Redis is stopped in the outage phase, and down in the kill phase")
	flag.DurationVar(&cfg.settle, "settle", 2*time.Second, "pause between phases (breakers close, debts are charged)")
	flag.StringVar(&cfg.lb, "lb", "auto", "load balancer: "+strings.Join(lbKinds, ", ")+" (auto: nginx, else haproxy, else the in-process Go reverse proxy)")
	flag.StringVar(&cfg.serverSrc, "server-src", "", "root module `DIR` whose ./examples/httpserver is built (default: the one the repository's go.work provides)")
	flag.StringVar(&cfg.serverBin, "server-bin", "", "a built examples/httpserver `BINARY` to run instead of building one")
	flag.DurationVar(&cfg.reqTimeout, "request-timeout", 10*time.Second, "vegeta's timeout for one request")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the working directory (configs, every process's log, each phase's requests as CSV) and print its path")
	short := flag.Bool("short", false, "for CI: 5s phases, 100 keys, 1.5s outages, 1s pauses between phases (about 35s in all)")
	flag.Parse()
	if flag.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if *short { // what the flags given do not say
		if !set["duration"] {
			cfg.duration = 5 * time.Second
		}
		if !set["keys"] {
			cfg.keys = 100
		}
		if !set["outage"] {
			cfg.outage = 1500 * time.Millisecond
		}
		if !set["settle"] {
			cfg.settle = time.Second
		}
	}
	if *burst == 0 {
		*burst = *limit
	}
	cfg.limit = policy.Limit{Name: "burst", Rate: *limit, Period: *period, Burst: *burst}
	if err := cfg.limit.Validate(); err != nil {
		return nil, fmt.Errorf("-limit, -period, -burst: %w", err)
	}
	if cfg.rate == 0 {
		cfg.rate = int(1.5*float64(cfg.keys)*float64(*limit)/period.Seconds() + 0.5)
	}
	for _, p := range strings.Split(*phases, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		known := false
		for _, n := range phaseNames {
			known = known || n == p
		}
		if !known {
			return nil, fmt.Errorf("-phases: unknown phase %q (want some of %s)", p, strings.Join(phaseNames, ","))
		}
		cfg.phases = append(cfg.phases, p)
	}
	switch {
	case cfg.instances < 1 || cfg.instances > 64:
		return nil, fmt.Errorf("-instances %d: must be in [1, 64]", cfg.instances)
	case cfg.mode != "open" && cfg.mode != "closed" && cfg.mode != "local":
		return nil, fmt.Errorf("-failure-mode %q: want open, closed or local", cfg.mode)
	case cfg.timeout <= 0:
		return nil, fmt.Errorf("-timeout %v: must be > 0", cfg.timeout)
	case cfg.keys < 1 || (len(cfg.phases)+1)*cfg.keys > maxClients:
		return nil, fmt.Errorf("-keys %d: must be at least 1, and (phases + 1) × keys at most %d", cfg.keys, maxClients)
	case cfg.rate < 1 || cfg.rate > 100_000:
		return nil, fmt.Errorf("-rate %d: must be in [1, 100000]", cfg.rate)
	case cfg.duration < time.Second || cfg.duration > time.Hour:
		return nil, fmt.Errorf("-duration %v: must be in [1s, 1h]", cfg.duration)
	case len(cfg.phases) == 0:
		return nil, errors.New("-phases: none")
	case cfg.stalls < 1 || cfg.stall <= 0 || time.Duration(cfg.stalls)*cfg.stall >= cfg.duration:
		return nil, fmt.Errorf("-stalls %d × -stall %v: need at least one stall, and all of them shorter than -duration %v", cfg.stalls, cfg.stall, cfg.duration)
	case cfg.outage <= 0 || cfg.outage >= cfg.duration*2/3:
		return nil, fmt.Errorf("-outage %v: must be > 0 and shorter than 2/3 of -duration (it starts at 1/3)", cfg.outage)
	case cfg.settle < 0 || cfg.reqTimeout <= 0:
		return nil, errors.New("-settle must be >= 0 and -request-timeout > 0")
	case cfg.serverSrc != "" && cfg.serverBin != "":
		return nil, errors.New("-server-src and -server-bin: give one")
	}
	return cfg, nil
}

func run() error {
	cfg, err := parseFlags()
	if err != nil {
		return err
	}
	began := time.Now()
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()

	dir, err := os.MkdirTemp("", "leaselimit-fleet-")
	if err != nil {
		return err
	}
	if cfg.keep {
		defer fmt.Fprintf(os.Stderr, "fleet: configs and logs kept in %s\n", dir)
	} else {
		defer os.RemoveAll(dir)
	}

	bin := cfg.serverBin
	if bin == "" {
		src := cfg.serverSrc
		if src == "" {
			if src, err = rootModuleDir(ctx); err != nil {
				return err
			}
		}
		progress("building examples/httpserver of %s", src)
		if bin, err = buildServer(ctx, src, dir); err != nil {
			return err
		}
	}
	if err := checkServerFlags(ctx, bin); err != nil {
		return err
	}

	f := &fleet{cfg: cfg}
	defer func() {
		if err := f.close(); err != nil {
			fmt.Fprintln(os.Stderr, "fleet: stopping:", err)
		}
	}()
	if f.redis, err = startRedis(ctx, dir); err != nil {
		return err
	}
	backends := make([]string, cfg.instances)
	for i := range cfg.instances {
		in, err := startInstance(ctx, cfg, bin, f.redis.addr, dir, i)
		if err != nil {
			return err
		}
		f.instances = append(f.instances, in)
		backends[i] = in.addr
	}
	if f.lb, err = startBalancer(ctx, cfg.lb, backends, dir); err != nil {
		return err
	}
	mode := map[string]string{"open": "FailOpen", "closed": "FailClosed", "local": "FailLocal"}[cfg.mode]
	leases := "leases"
	if cfg.exact {
		leases = "exact mode"
	}
	progress("redis-server %s, %d instances, %s; %s", f.redis.version, cfg.instances, f.lb.describe(), mode)

	// Warm up connections and scripts on clients of their own.
	if _, err := attack(ctx, load{lb: f.lb.addr(), rate: cfg.rate, d: 2 * time.Second,
		keys: cfg.keys, set: len(cfg.phases), timeout: cfg.reqTimeout}); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}

	var results []*phaseResult
	for i, name := range cfg.phases {
		if err := sleep(ctx, cfg.settle); err != nil {
			return err
		}
		if err := f.alive(); err != nil {
			return err
		}
		progress("phase %d of %d: %s (%v)", i+1, len(cfg.phases), name, cfg.duration)
		ph, err := f.runPhase(ctx, name, i)
		if err != nil {
			return fmt.Errorf("phase %s: %w", name, err)
		}
		results = append(results, ph)
		if cfg.keep {
			if err := writeRecords(filepath.Join(dir, fmt.Sprintf("%d-%s.csv", i+1, name)), ph); err != nil {
				return err
			}
		}
	}
	if err := f.alive(); err != nil {
		return err
	}

	env := fmt.Sprintf("%d × examples/httpserver (%s, fleet size %d, budget %v, %s) behind %s; redis-server %s; "+
		"%d client keys, each %d per %v with burst %d; vegeta at %d requests/s (%.2f× the limits), %v a phase; %s",
		cfg.instances, mode, cfg.instances, cfg.timeout, leases, f.lb.describe(), f.redis.version,
		cfg.keys, cfg.limit.Rate, cfg.limit.Period, cfg.limit.Burst, cfg.rate,
		float64(cfg.rate)/(float64(cfg.keys)*float64(cfg.limit.Rate)/cfg.limit.Period.Seconds()), cfg.duration, machine())
	printReport(os.Stdout, cfg, env, results)

	var wrong int
	for _, ph := range results {
		for _, r := range ph.recs {
			if r.wrong {
				wrong++
			}
		}
	}
	if wrong > 0 {
		return fmt.Errorf("%d admitted requests were answered for another client: the instances do not key requests by X-Forwarded-For", wrong)
	}
	progress("done in %v", time.Since(began).Round(100*time.Millisecond))
	return nil
}

// fleet is what run started; close stops it all.
type fleet struct {
	cfg       *config
	redis     *redisServer
	instances []*instance
	lb        balancer
}

// cpuUse is the CPU time used by each part of the fleet: so far in a
// snapshot, or over a phase.
type cpuUse struct {
	ok                          bool
	instances, redis, lb, fleet time.Duration
	redisPid                    int
}

// cpu takes a snapshot of the CPU time used so far.
func (f *fleet) cpu() cpuUse {
	u := cpuUse{ok: true, redisPid: f.redis.p.cmd.Process.Pid}
	add := func(d *time.Duration, v time.Duration, ok bool) {
		*d += v
		u.ok = u.ok && ok
	}
	for _, in := range f.instances {
		v, ok := groupCPU(in.p.cmd.Process.Pid)
		add(&u.instances, v, ok)
	}
	v, ok := groupCPU(u.redisPid)
	add(&u.redis, v, ok)
	v, ok = groupCPU(f.lb.pid())
	add(&u.lb, v, ok)
	v, ok = selfCPU()
	add(&u.fleet, v, ok)
	return u
}

// sub returns the CPU used from snapshot earlier to u. A Redis restarted
// in between counts from its restart.
func (u cpuUse) sub(earlier cpuUse) cpuUse {
	d := cpuUse{ok: u.ok && earlier.ok, redisPid: u.redisPid,
		instances: u.instances - earlier.instances, redis: u.redis, lb: u.lb - earlier.lb, fleet: u.fleet - earlier.fleet}
	if u.redisPid == earlier.redisPid {
		d.redis -= earlier.redis
	}
	return d
}

// alive checks that every process still runs.
func (f *fleet) alive() error {
	for _, in := range f.instances {
		if in.p.exited() {
			return fmt.Errorf("%s exited; its log:%s", in.p.name, in.p.logTail())
		}
	}
	if f.redis.p.exited() {
		return fmt.Errorf("redis-server exited; its log:%s", f.redis.p.logTail())
	}
	return nil
}

// close stops the load balancer, then the instances (gracefully: they give
// their leased tokens back to a Redis continued first if stopped), then
// Redis.
func (f *fleet) close() error {
	var errs []error
	if f.lb != nil {
		errs = append(errs, f.lb.stop())
	}
	if f.redis != nil && !f.redis.p.exited() {
		f.redis.p.mu.Lock()
		if f.redis.p.paused {
			errs = append(errs, resumeProcess(f.redis.p.cmd.Process))
			f.redis.p.paused = false
		}
		f.redis.p.mu.Unlock()
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, in := range f.instances {
		wg.Go(func() {
			err := in.p.stop(10 * time.Second)
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		})
	}
	wg.Wait()
	if f.redis != nil {
		errs = append(errs, f.redis.stop())
	}
	return errors.Join(errs...)
}

// runPhase runs phase name, the i-th, on clients of its own: the attack,
// and beside it the faults the phase injects into Redis.
func (f *fleet) runPhase(ctx context.Context, name string, i int) (*phaseResult, error) {
	cfg := f.cfg
	ph := &phaseResult{name: name, keys: cfg.keys}
	type injected struct {
		windows []window
		err     error
	}
	done := make(chan injected, 1)
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	l := load{lb: f.lb.addr(), rate: cfg.rate, d: cfg.duration, keys: cfg.keys, set: i, timeout: cfg.reqTimeout,
		onStart: func(t0 time.Time) {
			go func() {
				ws, err := f.inject(fctx, name, t0)
				done <- injected{ws, err}
			}()
		}}
	before := f.cpu()
	recs, err := attack(ctx, l)
	ph.cpu = f.cpu().sub(before)
	cancel() // a fault still under way (the attack failed) ends now
	inj := <-done
	if err != nil {
		return nil, err
	}
	if inj.err != nil {
		return nil, inj.err
	}
	ph.recs, ph.windows = recs, inj.windows
	switch name {
	case "baseline":
		ph.faults = "none"
	case "stalls":
		ph.faults = fmt.Sprintf("%d × SIGSTOP %v, evenly spread", cfg.stalls, cfg.stall)
	case "outage":
		ph.faults = fmt.Sprintf("SIGSTOP %v at T/3", cfg.outage)
	case "kill":
		ph.faults = fmt.Sprintf("SIGKILL at T/3, restarted %v later", cfg.outage)
		if len(inj.windows) > 0 {
			w := inj.windows[0]
			ph.faults += fmt.Sprintf(" (answered after %v)", dur(w.to-w.from))
			ph.resets = 1
		}
	}
	return ph, nil
}

// inject does to Redis what phase name does, with times relative to t0,
// and returns the windows during which Redis could not answer.
func (f *fleet) inject(ctx context.Context, name string, t0 time.Time) ([]window, error) {
	cfg := f.cfg
	r := f.redis
	at := func(d time.Duration) error { return sleep(ctx, time.Until(t0.Add(d))) }
	since := func() time.Duration { return time.Since(t0) }
	var ws []window
	switch name {
	case "stalls":
		every := cfg.duration / time.Duration(cfg.stalls)
		for i := range cfg.stalls {
			if err := at(time.Duration(i)*every + every/2 - cfg.stall/2); err != nil {
				return ws, nil // the attack was stopped
			}
			if err := r.p.pause(); err != nil {
				return ws, err
			}
			from := since()
			werr := sleep(ctx, cfg.stall)
			if err := r.p.resume(); err != nil {
				return ws, err
			}
			ws = append(ws, window{from, since()})
			if werr != nil {
				return ws, nil
			}
		}
	case "outage":
		if err := at(cfg.duration / 3); err != nil {
			return ws, nil
		}
		if err := r.p.pause(); err != nil {
			return ws, err
		}
		from := since()
		_ = sleep(ctx, cfg.outage) // cut short if the attack was stopped
		if err := r.p.resume(); err != nil {
			return ws, err
		}
		ws = append(ws, window{from, since()})
	case "kill":
		if err := at(cfg.duration / 3); err != nil {
			return ws, nil
		}
		if err := r.p.kill(); err != nil {
			return ws, err
		}
		from := since()
		_ = sleep(ctx, cfg.outage) // cut short if the attack was stopped
		// Restart even when stopped early: close stops the instances
		// gracefully, and their refunds want a Redis.
		if err := r.restart(context.WithoutCancel(ctx)); err != nil {
			return ws, fmt.Errorf("restart redis-server: %w", err)
		}
		ws = append(ws, window{from, since()})
	}
	return ws, nil
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func progress(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "fleet: "+format+"\n", a...)
}
