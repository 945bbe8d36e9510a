package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/policy"
	"golang.org/x/time/rate"
)

// binWidth is the resolution of the chart's admitted-per-second series.
const binWidth = 250 * time.Millisecond

// embeddedTimeout is act 1's budget for one Redis call on the embedded
// Redis. miniredis builds a Lua state for every script call; on a busy
// 2-core machine its queue can pass leaselimit's default 100ms, and then the
// failure policy (FailOpen) decides instead of the bucket. Act 1 is about the
// bucket; act 2 shows the failure policies.
const embeddedTimeout = time.Second

// breakerOpenFor is the breaker's open interval in the outage act: short, so
// the recovery is visible.
const breakerOpenFor = 500 * time.Millisecond

// demo is one run of the program.
type demo struct {
	cfg      *config
	out      io.Writer
	errOut   io.Writer
	progress *progress
	tel      *tracing

	be      *backend
	tr      *traffic
	limit   policy.Limit
	prefix  string
	timeout time.Duration // leaselimit's budget for one Redis call in act 1

	designs []*designResult
	outage  *outageResult

	violations []string
}

// designResult is the outcome of one design in act 1.
type designResult struct {
	id, label, how string
	usesRedis      bool
	s              *series
	elapsed        time.Duration
	calls          int64 // commands sent by the fleet's clients
	cmds           int64 // commands the server processed
	cmdsOK         bool
	closeErrs      []string
}

// outageResult is the outcome of act 2.
type outageResult struct {
	series             []*series
	modes              []policy.FailureMode
	tr                 *traffic // each fleet's share of the traffic
	elapsed            time.Duration
	downAt, upAt       time.Duration
	restartErr         error
	closeErrs          [][]string
	skipped            string
	warmup, down, back time.Duration
}

func (d *demo) run(ctx context.Context) error {
	cfg := d.cfg
	d.limit = policy.Limit{Name: "demo", Rate: cfg.limit, Period: time.Second, Burst: cfg.limit}
	if err := d.limit.Validate(); err != nil {
		return err
	}
	be, err := startBackend(ctx, cfg)
	if err != nil {
		return err
	}
	defer be.close()
	d.be = be
	d.timeout = cfg.timeout
	if d.timeout == 0 {
		d.timeout = leaselimit.DefaultTimeout
		if be.embedded() {
			d.timeout = embeddedTimeout
		}
	}
	d.tr = newTraffic(cfg)
	d.tel = newTracing(ctx, cfg)
	d.tel.outageAct = cfg.outage > 0 && be.embedded() // see act2
	defer d.tel.close()
	// Every run and design gets buckets of its own, also on a shared Redis.
	d.prefix = fmt.Sprintf("lldemo-%x", time.Now().UnixNano())

	d.header()
	if err := d.act1(ctx); err != nil {
		return err
	}
	d.reportAct1()
	if cfg.outage > 0 {
		if err := d.act2(ctx); err != nil {
			return err
		}
		d.reportAct2()
	} else {
		fmt.Fprintf(d.out, "\nAct 2 (the outage) skipped: -outage 0.\n")
	}
	if cfg.chart != "" {
		if err := writeChart(cfg.chart, d); err != nil {
			return fmt.Errorf("write the chart: %w", err)
		}
		fmt.Fprintf(d.out, "\nChart of the hot key's admitted requests per second written to %s\n", cfg.chart)
	}
	d.tel.report(d.out, d.errOut)
	d.verdict()
	return nil
}

func (d *demo) header() {
	cfg := d.cfg
	w := d.out
	fmt.Fprintf(w, "leaselimit demo: a fleet of %d instances behind a load balancer, on %s\n", cfg.instances, d.be.describe())
	fmt.Fprintf(w, "limit per key: %s (policy.Limit{Rate: %d, Period: time.Second, Burst: %d})\n", d.limit, cfg.limit, cfg.limit)
	fmt.Fprintf(w, "traffic: %s requests/s offered across the fleet, %d workers per instance, seed %d:\n", num(cfg.load), cfg.workers, cfg.seed)
	fmt.Fprintf(w, "  hot key    %-20s %6s/s  (%s× its limit)\n", hotKey, num(d.tr.demand(classHot)), ratio(d.tr.demand(classHot)/float64(cfg.limit)))
	fmt.Fprintf(w, "  abusive    %-20s %6s/s  (%s× its limit)\n", abusiveKey, num(d.tr.demand(classAbusive)), ratio(d.tr.demand(classAbusive)/float64(cfg.limit)))
	fmt.Fprintf(w, "  long tail  %-20s %6s/s  (%d keys, ~%s/s each)\n", "tenant:00000…", num(d.tr.demand(classTail)), cfg.tailKeys,
		strconv.FormatFloat(d.tr.demand(classTail)/float64(cfg.tailKeys), 'g', 2, 64))
	fmt.Fprintf(w, "%s\n", d.tel.describe())
	fmt.Fprintf(w, "\nAct 1: the same traffic through three designs, one after another, %v each.\n", cfg.duration)
	if d.be.embedded() {
		fmt.Fprintf(w, "miniredis runs Lua scripts far slower than redis-server (use -redis ADDR for real-server numbers),\n")
		fmt.Fprintf(w, "so act 1 gives leaselimit WithTimeout(%v) instead of its default %v: slowness must not look like an outage.\n",
			d.timeout, leaselimit.DefaultTimeout)
	} else {
		fmt.Fprintf(w, "leaselimit runs WithTimeout(%v).\n", d.timeout)
	}
}

// act1 runs the three designs one after another.
func (d *demo) act1(ctx context.Context) error {
	cfg := d.cfg
	designs := []*designResult{
		{id: "a", label: "(a) per-instance x/time/rate",
			how: fmt.Sprintf("golang.org/x/time/rate in each of the %d instances, one limiter per key; no Redis", cfg.instances)},
		{id: "b", label: "(b) per-request Redis", usesRedis: true,
			how: "leaselimit.WithoutLease(): every decision is one call of the token-bucket Lua script (the classic design)"},
		{id: "c", label: "(c) leaselimit (leases)", usesRedis: true,
			how: "leaselimit.NewClient(rdb) and its Limiter(limit) with the default leases, one Client per instance"},
	}
	for _, ds := range designs {
		if err := d.runDesign(ctx, ds); err != nil {
			return err
		}
		d.designs = append(d.designs, ds)
	}
	return nil
}

func (d *demo) runDesign(ctx context.Context, ds *designResult) error {
	cfg := d.cfg
	s := &series{label: ds.label}
	var limiters []*leaselimit.Client
	for i := 0; i < cfg.instances; i++ {
		if !ds.usesRedis {
			s.insts = append(s.insts, newLocalBuckets(d.limit).decide)
			continue
		}
		opts := []leaselimit.Option{leaselimit.WithPrefix(d.prefix + "-" + ds.id), leaselimit.WithTimeout(d.timeout)}
		if ds.id == "b" {
			opts = append(opts, leaselimit.WithoutLease())
		}
		opts = append(opts, d.tel.options(ds.id == "c" && i == 0)...)
		opts = append(opts, instanceLog(i))
		c, err := leaselimit.NewClient(d.be.newClient(), opts...)
		if err != nil {
			closeAll(limiters)
			d.be.closeClients()
			return fmt.Errorf("design %s: %w", ds.label, err)
		}
		limiters = append(limiters, c)
		s.insts = append(s.insts, limiterDecide(c.Limiter(d.limit)))
	}
	ds.s = s

	if err := warmUp(ctx, s.insts, cfg.workers); err != nil {
		closeAll(limiters)
		d.be.closeClients()
		return fmt.Errorf("design %s: %w", ds.label, err)
	}
	cmds0, err0 := d.be.serverCommands(ctx)
	calls0 := d.be.calls.Load()
	var last snapshot
	lastCmds := cmds0
	tick := func(el time.Duration, _ int) {
		cur := snap(s.stats)
		line := fmt.Sprintf("act 1 %s  %4.1fs/%v  %s decisions/s  hot admitted %s/s  abusive admitted %s/s  (limit %d/s)",
			ds.label, el.Seconds(), cfg.duration, num(float64(cur.total-last.total)), num(float64(cur.hot-last.hot)),
			num(float64(cur.abusive-last.abusive)), cfg.limit)
		if ds.usesRedis {
			if c, err := d.be.serverCommands(ctx); err == nil && err0 == nil {
				line += fmt.Sprintf("  Redis %s cmds/s", num(float64(c-lastCmds)))
				lastCmds = c
			}
		}
		if e := cur.errors - last.errors; e > 0 {
			line += fmt.Sprintf("  ERRORS %d", e)
		}
		last = cur
		d.progress.line(line)
	}
	d.tel.record(true)
	ds.elapsed = runFleet(ctx, d.tr, []*series{s}, cfg.duration, binWidth, tick, nil)
	d.tel.record(false)
	end := snap(s.stats)
	d.progress.line(fmt.Sprintf("act 1 %s  done in %.2fs: %s decisions, hot key admitted %s (ideal %s), errors %d",
		ds.label, ds.elapsed.Seconds(), num(float64(end.total)), num(float64(end.hot)), num(d.ideal(ds.elapsed)), end.errors))
	// Close refunds unused leased tokens: their commands are part of the cost.
	ds.closeErrs = closeAll(limiters)
	ds.calls = d.be.calls.Load() - calls0
	if cmds1, err1 := d.be.serverCommands(ctx); err0 == nil && err1 == nil {
		ds.cmds, ds.cmdsOK = cmds1-cmds0, true
	}
	d.be.closeClients()
	d.progress.done()
	return ctx.Err()
}

// snapshot is a live reading of a series' counters for the progress line.
type snapshot struct{ total, hot, abusive, errors, fallback int64 }

func snap(s *seriesStats) snapshot {
	if s == nil {
		return snapshot{}
	}
	var e int64
	for w := range s.errors {
		e += s.errors[w].Load()
	}
	return snapshot{
		total:    s.sum(nil, nil, nil, false),
		hot:      s.sum(nil, []int{classHot}, nil, true),
		abusive:  s.sum(nil, []int{classAbusive}, nil, true),
		errors:   e,
		fallback: s.sum(nil, nil, []leaselimit.Source{leaselimit.SourceFallback}, false),
	}
}

// act2 stops Redis for cfg.outage while leaselimit runs under each failure
// policy, side by side on the same traffic, and brings it back.
func (d *demo) act2(ctx context.Context) error {
	cfg := d.cfg
	o := &outageResult{warmup: cfg.warmup, down: cfg.outage, back: cfg.recovery}
	d.outage = o
	w := d.out
	if !d.be.embedded() {
		o.skipped = "the outage act needs the embedded Redis (it stops and restarts it); skipped with -redis/-redis-cluster"
		fmt.Fprintf(w, "\nAct 2: %s.\n", o.skipped)
		return nil
	}
	fmt.Fprintf(w, "\nAct 2: Redis stops for %v and comes back, while leaselimit (with leases) runs under each failure policy.\n", cfg.outage)
	o.modes = []policy.FailureMode{policy.FailOpen, policy.FailClosed, policy.FailLocal}
	// Three fleets share the Redis, each with a third of the traffic, so
	// Redis carries about the load of act 1.
	tr := *d.tr
	tr.load /= float64(len(o.modes))
	o.tr = &tr
	fmt.Fprintf(w, "Three fleets of %d instances run side by side on the same Redis, one per policy, each with a third\n", cfg.instances)
	fmt.Fprintf(w, "of the traffic above (hot key %s/s, abusive %s/s, long tail %s/s).\n",
		num(tr.demand(classHot)), num(tr.demand(classAbusive)), num(tr.demand(classTail)))

	names := map[policy.FailureMode]string{policy.FailOpen: "FailOpen", policy.FailClosed: "FailClosed", policy.FailLocal: "FailLocal"}
	limiters := make([][]*leaselimit.Client, len(o.modes))
	for k, m := range o.modes {
		s := &series{label: names[m]}
		for i := 0; i < cfg.instances; i++ {
			opts := []leaselimit.Option{
				leaselimit.WithPrefix(fmt.Sprintf("%s-outage-%s", d.prefix, m)),
				leaselimit.WithFailureMode(m),
				leaselimit.WithFleetSize(cfg.instances),
				leaselimit.WithBreaker(breaker.Settings{OpenFor: breakerOpenFor}),
			}
			opts = append(opts, d.tel.options(m == policy.FailLocal && i == 0)...)
			opts = append(opts, instanceLog(i))
			c, err := leaselimit.NewClient(d.be.newClient(), opts...)
			if err != nil {
				for _, ls := range limiters {
					closeAll(ls)
				}
				d.be.closeClients()
				return fmt.Errorf("act 2 %s: %w", names[m], err)
			}
			limiters[k] = append(limiters[k], c)
			s.insts = append(s.insts, limiterDecide(c.Limiter(d.limit)))
		}
		o.series = append(o.series, s)
	}

	logs.quiet.Store(true)
	defer logs.quiet.Store(false)
	var restartMu sync.Mutex
	ctl := func(ctx context.Context, st *runState) {
		if !sleepCtx(ctx, o.warmup) {
			return
		}
		d.be.stop()
		o.downAt = time.Since(st.start)
		st.window.Store(winDown)
		sleepCtx(ctx, o.down) // restart even when interrupted
		err := d.be.restart()
		restartMu.Lock()
		o.restartErr = err
		restartMu.Unlock()
		o.upAt = time.Since(st.start)
		st.window.Store(winAfter)
	}
	last := make([]snapshot, len(o.series))
	for _, s := range o.series {
		if err := warmUp(ctx, s.insts, cfg.workers); err != nil {
			for _, ls := range limiters {
				closeAll(ls)
			}
			d.be.closeClients()
			return fmt.Errorf("act 2 %s: %w", s.label, err)
		}
	}
	lastWin := winBefore
	tick := func(el time.Duration, win int) {
		state := [numWindows]string{"Redis up", "Redis DOWN", "Redis back"}[win]
		if win != lastWin {
			state = [numWindows]string{"", "Redis stopped", "Redis restarted"}[win]
			lastWin = win
		}
		line := fmt.Sprintf("act 2 %4.1fs  %-15s  hot admitted/s:", el.Seconds(), state)
		for k, s := range o.series {
			cur := snap(s.stats)
			line += fmt.Sprintf("  %s %s", s.label, num(float64(cur.hot-last[k].hot)))
			if f := cur.fallback - last[k].fallback; f > 0 {
				line += fmt.Sprintf(" (%s fallback)", num(float64(f)))
			}
			if e := cur.errors - last[k].errors; e > 0 {
				line += fmt.Sprintf(" ERRORS %d", e)
			}
			last[k] = cur
		}
		line += fmt.Sprintf("  (limit %d/s)", cfg.limit)
		d.progress.line(line)
	}
	total := o.warmup + o.down + o.back
	d.tel.record(true)
	o.elapsed = runFleet(ctx, o.tr, o.series, total, binWidth, tick, ctl)
	d.tel.record(false)
	line := fmt.Sprintf("act 2  done in %.2fs: errors", o.elapsed.Seconds())
	for _, s := range o.series {
		line += fmt.Sprintf(" %s %d", s.label, snap(s.stats).errors)
	}
	d.progress.line(line)
	for _, ls := range limiters {
		o.closeErrs = append(o.closeErrs, closeAll(ls))
	}
	d.be.closeClients()
	d.progress.done()
	restartMu.Lock()
	err := o.restartErr
	restartMu.Unlock()
	if err != nil {
		return err
	}
	return ctx.Err()
}

// warmUp gets every instance ready the way a long-running service is: its
// connections to Redis open and the script loaded. Each instance makes n
// concurrent decisions on keys of their own, outside the measured traffic.
func warmUp(ctx context.Context, insts []decideFunc, n int) error {
	var wg sync.WaitGroup
	errs := make([]error, len(insts)*n)
	for i, dec := range insts {
		for j := 0; j < n; j++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _, errs[i*n+j] = dec(ctx, fmt.Sprintf("warm-up:%d:%d", i, j))
			}()
		}
	}
	wg.Wait()
	return errors.Join(errs...)
}

// sleepCtx sleeps for d or until ctx ends; it reports whether it slept the
// whole time.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// limiterDecide adapts a Limiter to a decideFunc.
func limiterDecide(l *leaselimit.Limiter) decideFunc {
	return func(ctx context.Context, key string) (bool, leaselimit.Source, error) {
		dec, err := l.Allow(ctx, key)
		return dec.Allowed, dec.Source, err
	}
}

// closeAll closes the instances' Clients and returns the errors of their
// Close.
func closeAll(ls []*leaselimit.Client) []string {
	var errs []string
	for _, l := range ls {
		if err := l.Close(); err != nil && !errors.Is(err, leaselimit.ErrClosed) {
			errs = append(errs, err.Error())
		}
	}
	return errs
}

// localBuckets is design (a): one instance's in-process token buckets, one
// golang.org/x/time/rate limiter per key.
type localBuckets struct {
	limit rate.Limit
	burst int
	mu    sync.Mutex
	m     map[string]*rate.Limiter
}

func newLocalBuckets(l policy.Limit) *localBuckets {
	return &localBuckets{
		limit: rate.Limit(float64(l.Rate) / l.Period.Seconds()),
		burst: int(l.Burst),
		m:     map[string]*rate.Limiter{},
	}
}

func (b *localBuckets) decide(_ context.Context, key string) (bool, leaselimit.Source, error) {
	b.mu.Lock()
	l := b.m[key]
	if l == nil {
		l = rate.NewLimiter(b.limit, b.burst)
		b.m[key] = l
	}
	b.mu.Unlock()
	return l.Allow(), leaselimit.SourceLease, nil
}

// progress writes the live progress line: overwritten in place with \r on a
// terminal, one plain line per update otherwise.
type progress struct {
	w    io.Writer
	tty  bool
	mu   sync.Mutex
	open bool
}

func newProgress(w io.Writer) *progress {
	p := &progress{w: w}
	if f, ok := w.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			p.tty = true
		}
	}
	return p
}

func (p *progress) line(s string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty {
		fmt.Fprintf(p.w, "\r\033[K%s", s)
		p.open = true
		return
	}
	fmt.Fprintln(p.w, s)
}

// message writes a line of its own, keeping the progress line intact.
func (p *progress) message(s string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty && p.open {
		fmt.Fprint(p.w, "\r\033[K")
		p.open = false
	}
	fmt.Fprintln(p.w, s)
}

// done ends the current progress line, leaving its last state visible.
func (p *progress) done() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty && p.open {
		fmt.Fprintln(p.w)
		p.open = false
	}
}

// instanceLog is the logger option of instance i of a fleet: the first
// instance's lines (to slog.Default(), as a Client logs by default) stand
// for the fleet's. In production each instance logs to its own output;
// here the fleets share one terminal, and 24 copies of each line hid the
// demo's table.
func instanceLog(i int) leaselimit.Option {
	if i == 0 {
		return leaselimit.WithLogger(slog.Default())
	}
	return leaselimit.WithLogger(slog.New(slog.DiscardHandler))
}
