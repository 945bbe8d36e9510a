package leaselimit_test

// Overload is not an outage: a CPU-bound instance, Redis healthy, must never
// hand decisions to the failure policy. Every load here is a flood of
// callers in tight loops with no yield and no sleep, on two processors, and
// every Limiter keeps the default time budget (100ms).

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// twoProcs runs the test on two processors, the machine these loads are
// sized for, whatever the host has. GOMAXPROCS is the process's: no test
// that calls it runs in parallel (see mostlyWaits).
func twoProcs(t *testing.T) {
	old := runtime.GOMAXPROCS(2)
	t.Cleanup(func() { runtime.GOMAXPROCS(old) })
}

// mostlyWaits marks a test whose time goes to waiting, not to the
// processors (an outage's length, a pool the application holds, a
// breaker's OpenFor, a slow proxy): it runs in parallel with other such
// tests. go test starts parallel tests only once every other test of the
// package has run, so the flood tests, which assert what a process that
// has the machine to itself does, still run alone. Measured on a 2-core
// machine (vmstat beside go test -race): these tests took 200 s of the
// package's 460 s with the processors 2-13% busy; CI runs the package
// with -parallel 4. A test that asserts a decision's latency against a
// tight bound, changes process-wide settings (twoProcs, slog's default,
// the environment) or counts the process's goroutines, allocations or
// CPU time does not call it.
func mostlyWaits(t *testing.T) { t.Parallel() }

// tripCounter returns breaker settings (the defaults) that count how often
// the breaker opens.
func tripCounter() (breaker.Settings, *atomic.Int64) {
	var trips atomic.Int64
	return breaker.Settings{OnStateChange: func(_, to breaker.State) {
		if to == breaker.Open {
			trips.Add(1)
		}
	}}, &trips
}

// testLog is an io.Writer onto t.Log.
type testLog struct{ t *testing.T }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// newBudgeted is New with the default time budget (mustNew's is 10s, for
// tests about decisions rather than time). What the Limiter logs (a
// fallback's reason, a saturated call) goes to the test's log, so that a
// failure says why.
func newBudgeted(t *testing.T, c redis.UniversalClient, l policy.Limit, opts ...leaselimit.Option) *leaselimit.Limiter {
	t.Helper()
	opts = append([]leaselimit.Option{leaselimit.WithLogger(slog.New(slog.NewTextHandler(testLog{t}, nil)))}, opts...)
	lim, err := leaselimit.New(c, l, opts...)
	if err != nil {
		t.Fatalf("New(%v) = %v", l, err)
	}
	t.Cleanup(func() { _ = lim.Close() })
	return lim
}

// checkHealthy checks what a flood on a healthy Redis must show: no
// fallback decision, a breaker that never opened, and, if bound > 0, no more
// admitted than Burst + Rate·T = bound.
func (r floodResult) checkHealthy(t *testing.T, trips *atomic.Int64, bound float64) {
	t.Helper()
	if n := r.bySource[leaselimit.SourceFallback]; n > 0 {
		t.Errorf("%d fallback decisions on a healthy Redis", n)
	}
	if n := trips.Load(); n > 0 {
		t.Errorf("the breaker opened %d times on a healthy Redis", n)
	}
	if bound > 0 && float64(r.admitted) > bound {
		t.Errorf("admitted %d > Burst + Rate·T = %.0f", r.admitted, bound)
	}
}

func manyKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("user-%d", i)
	}
	return keys
}

// TestSaturatedManyKeys: 256 callers over 10k keys under a limit nobody
// reaches, FailClosed. Every decision the failure policy made would be a
// denial the bucket did not ask for.
func TestSaturatedManyKeys(t *testing.T) {
	twoProcs(t)
	srv := redistest.Start(t)
	bs, trips := tripCounter()
	lim := newBudgeted(t, srv.Client(t), policy.Limit{Name: "sat-many", Rate: 1e9, Period: time.Second, Burst: 1e9},
		leaselimit.WithFailureMode(policy.FailClosed), leaselimit.WithBreaker(bs))
	keys := manyKeys(10_000)
	r := flood(t, []*leaselimit.Limiter{lim}, 256, 5*time.Second, func(w, i int) string { return keys[(w*7919+i)%len(keys)] })
	t.Logf("256 callers, 10k keys, %v: %d decisions (lease %d, authority %d, cache %d, fallback %d), %d denied, breaker opened %d times, slowest %v",
		r.elapsed.Round(time.Millisecond), total(r.bySource), r.bySource[0], r.bySource[1], r.bySource[2], r.bySource[3],
		r.denied, trips.Load(), r.slowest.Round(time.Millisecond))
	r.checkHealthy(t, trips, 0)
	if r.denied > 0 {
		t.Errorf("%d denials under a limit nobody reaches (FailClosed)", r.denied)
	}
}

// TestSaturatedFleet: 8 Limiters, each with its own client, × 16 callers on
// one key, 2000/s burst 200, FailOpen: the fleet bound holds from both
// sides.
func TestSaturatedFleet(t *testing.T) {
	twoProcs(t)
	srv := redistest.Start(t)
	l := policy.Limit{Name: "sat-fleet", Rate: 2000, Period: time.Second, Burst: 200}
	bs, trips := tripCounter()
	var lims []*leaselimit.Limiter
	for range 8 {
		lims = append(lims, newBudgeted(t, srv.Client(t), l, leaselimit.WithBreaker(bs)))
	}
	r := flood(t, lims, 16, 5*time.Second, func(int, int) string { return "one" })
	bound := float64(l.Burst) + float64(l.Rate)*r.elapsed.Seconds()
	t.Logf("8 Limiters × 16 callers, one key, %v: %d decisions (lease %d, authority %d, cache %d, fallback %d), admitted %d of %.0f (%.3f), breaker opened %d times, slowest %v",
		r.elapsed.Round(time.Millisecond), total(r.bySource), r.bySource[0], r.bySource[1], r.bySource[2], r.bySource[3],
		r.admitted, bound, float64(r.admitted)/bound, trips.Load(), r.slowest.Round(time.Millisecond))
	r.checkHealthy(t, trips, bound)
	// From below, over the window in which callers asked: the wait for
	// the calls in flight at the stop adds to the whole run's bound
	// tokens no caller was left to take. Regression (a flake): a run of
	// 5.069 s for callers that asked for 5 s admitted 0.968 of the whole
	// run's bound, 0.981 of a 5 s one.
	if low := float64(l.Burst) + float64(l.Rate)*r.demand.Seconds(); float64(r.admitted) < 0.97*low {
		t.Errorf("admitted %d < 97%% of Burst + Rate·T = %.0f over the %v callers asked", r.admitted, low, r.demand.Round(time.Millisecond))
	}
}

// TestSaturatedOverLimit: 64 callers on a key far over its limit: admitted
// within the bound, at most 0.01 Redis commands per decision, no fallback.
func TestSaturatedOverLimit(t *testing.T) {
	twoProcs(t)
	srv := redistest.Start(t)
	l := policy.Limit{Name: "sat-over", Rate: 200, Period: time.Second, Burst: 20}
	bs, trips := tripCounter()
	lim := newBudgeted(t, srv.Client(t), l, leaselimit.WithBreaker(bs))
	before := srv.Stats(t)
	r := flood(t, []*leaselimit.Limiter{lim}, 64, 3*time.Second, func(int, int) string { return "abuser" })
	cmds := srv.Stats(t).Sub(before).TotalCommands
	n := total(r.bySource)
	bound := float64(l.Burst) + float64(l.Rate)*r.elapsed.Seconds()
	per := float64(cmds) / float64(n)
	t.Logf("64 callers, one key: %d decisions (%.0fx its limit; lease %d, authority %d, cache %d, fallback %d), admitted %d of %.0f, %d Redis commands (%.5f per decision), breaker opened %d times",
		n, float64(n)/bound, r.bySource[0], r.bySource[1], r.bySource[2], r.bySource[3], r.admitted, bound, cmds, per, trips.Load())
	r.checkHealthy(t, trips, bound)
	if float64(n) < 100*bound {
		t.Fatalf("only %.0fx over the limit; the bound is for 100x", float64(n)/bound)
	}
	if per > 0.01 {
		t.Errorf("%.4f Redis commands per decision for a key 100x over its limit; want <= 0.01", per)
	}
}

// burn keeps n goroutines busy on the CPU without ever blocking or calling
// the Limiter, as CPU-bound request handlers would, until the test ends.
func burn(t *testing.T, n int) {
	var stop atomic.Bool
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x := 0
			for !stop.Load() {
				x++
			}
			_ = x
		}()
	}
	t.Cleanup(func() { stop.Store(true); wg.Wait() })
}

// saturatedCalls sums ratelimit.saturated by outcome and
// ratelimit.fallbacks by reason.
func (r *telemetryRig) saturatedCalls(t *testing.T) (byOutcome, fallbacks map[string]int64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	byOutcome, fallbacks = map[string]int64{}, map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			var into map[string]int64
			var key = telemetry.AttrOutcome
			switch m.Name {
			case telemetry.MetricSaturated:
				into = byOutcome
			case telemetry.MetricFallbacks:
				into, key = fallbacks, telemetry.AttrReason
			default:
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				v, _ := dp.Attributes.Value(key)
				into[v.AsString()] += dp.Value
			}
		}
	}
	return byOutcome, fallbacks
}

// TestSaturatedByOtherWork: goroutines that never call the Limiter keep
// the CPU busy, so a Redis reply waits in the run queue however the
// Limiter's own callers behave. A call past the budget is waited for and
// counted as the process's delay (metric and span attribute); past the
// hard cap the call is denied with reason "saturated", even under
// FailOpen. Either way the breaker does not open: Redis answered every
// call. Regression: a call given up at the cap went to the failure
// policy, and FailOpen admitted it past the fleet's bound.
func TestSaturatedByOtherWork(t *testing.T) {
	twoProcs(t)
	srv := redistest.Start(t)
	ctx := context.Background()
	// A client that sets ctx's deadline on its reads (the Limiter then
	// calls Redis on the caller's goroutine) and one that does not.
	// Regression: on the first, a read the budget cut was a bare i/o
	// timeout, and counted against Redis without the checks below.
	clients := map[string]*redis.Client{
		"":        srv.Client(t),
		"-direct": redisClientOpts(t, &redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true}),
	}
	const budget = leaselimit.DefaultTimeout
	// 32 busy goroutines keep a ready goroutine waiting about a budget or
	// two; 256, longer than the hard cap.
	for _, run := range []struct {
		busy   int
		client string
	}{{32, ""}, {256, ""}, {32, "-direct"}, {256, "-direct"}} {
		busy, c := run.busy, clients[run.client]
		if err := c.Ping(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		t.Run(fmt.Sprint(busy, "-busy", run.client), func(t *testing.T) {
			rig := newTelemetryRig(t)
			bs, trips := tripCounter()
			lim := newBudgeted(t, c, policy.PerSecond(1000).WithName(fmt.Sprint("sat-busy-", busy, run.client)),
				append(rig.opts(), leaselimit.WithoutLease(), leaselimit.WithFailureMode(policy.FailOpen), leaselimit.WithBreaker(bs))...)
			burn(t, busy)
			var fallbacks int
			var worst time.Duration
			var outcomes, reasons map[string]int64
			var long, marked int
			var saturated int64
			// Rounds of 10 calls until one of them waited past the budget:
			// on an idle machine all 10 were often answered in time (a
			// review: 12 of 32 subtests in 8 runs), and the subtest then
			// tested only the breaker.
			for round := range 3 {
				time.Sleep(50 * time.Millisecond) // let them take the processors
				// More calls than the breaker's 5 failures.
				for i := range 10 {
					start := time.Now()
					d, err := lim.Allow(ctx, fmt.Sprint("k", round, "-", i))
					worst = max(worst, time.Since(start))
					switch {
					case err != nil:
						t.Fatalf("Allow = %v", err)
					case d.Source == leaselimit.SourceFallback:
						if d.Allowed {
							t.Errorf("Allow %d admitted by the failure policy (%+v) while Redis answered every call", i, d)
						}
						fallbacks++
					case d.Source != leaselimit.SourceAuthority || !d.Allowed:
						t.Fatalf("Allow = %+v; want an authority grant or a fallback", d)
					}
				}
				outcomes, reasons = rig.saturatedCalls(t)
				// Redis calls that took longer than the budget (their span
				// runs from the request to the reply being read) and the
				// decisions marked as saturated.
				long, marked = 0, 0
				for _, s := range rig.spans.Ended() {
					switch s.Name() {
					case telemetry.AuthoritySpan:
						if s.EndTime().Sub(s.StartTime()) > budget {
							long++
						}
					case telemetry.DecisionSpan:
						if v, ok := attrMap(s.Attributes())[telemetry.AttrSaturated]; ok && v.AsBool() {
							marked++
						}
					}
				}
				saturated = outcomes[telemetry.SaturatedAnswered] + outcomes[telemetry.SaturatedAbandoned]
				t.Logf("round %d, %d busy goroutines, 10 calls a round: %d Redis calls longer than the budget, %d fallbacks %v; ratelimit.saturated %v; %d spans marked; slowest %v; breaker opened %d times",
					round+1, busy, long, fallbacks, reasons, outcomes, marked, worst.Round(time.Millisecond), trips.Load())
				if long+fallbacks > 0 || saturated > 0 {
					break
				}
			}
			// Whether or not a call was late, Redis answered every call.
			if n := trips.Load(); n > 0 {
				t.Errorf("the breaker opened %d times although Redis answered every call", n)
			}
			if long+fallbacks == 0 && saturated == 0 {
				t.Skipf("every call of 3 rounds was answered within the budget: this machine kept up with %d busy goroutines", busy)
			}
			if int(reasons[telemetry.ReasonSaturated]) != fallbacks || len(reasons) > 1 {
				t.Errorf("fallbacks by reason %v; want all %d with reason %q", reasons, fallbacks, telemetry.ReasonSaturated)
			}
			if int(outcomes[telemetry.SaturatedAbandoned]) != fallbacks {
				t.Errorf("ratelimit.saturated{outcome=abandoned} = %d; want the %d fallbacks", outcomes[telemetry.SaturatedAbandoned], fallbacks)
			}
			if saturated < int64(long) {
				t.Errorf("ratelimit.saturated counts %d calls; %d Redis calls took longer than the budget", saturated, long)
			}
			if int64(marked) != saturated {
				t.Errorf("%d decision spans carry %s=true; want one per saturated call (%d)", marked, telemetry.AttrSaturated, saturated)
			}
			// No bound on the slowest decision here: on a processor shared
			// with 256 goroutines that never block, the caller's own
			// goroutine, preempted anywhere in Allow, waits its turn
			// behind them all (over a second) before it can return.
			// TestHungWhileSaturated holds decisions to the cap.
		})
	}
}

// saturatedLoad floods lim with 64 callers: 16 on a warm key (leases), 48
// on keys never asked for before (every decision needs Redis).
func saturatedLoad(t *testing.T, lim *leaselimit.Limiter) *phasedLoad {
	return startLoad(t, lim, 64, func(w, i int) (string, int) {
		if w < 16 {
			return "warm", 0
		}
		return fmt.Sprint("cold-", w, "-", i), -1
	}, nil)
}

// TestHungWhileSaturated: Redis SIGSTOPped while the process is saturated
// by its own callers. The process being behind must not hide the outage:
// decisions fall back, none waits past the hard cap (5 budgets), and the
// goroutines of abandoned calls do not pile up.
func TestHungWhileSaturated(t *testing.T) {
	twoProcs(t)
	srv := redistest.Start(t)
	const budget = leaselimit.DefaultTimeout
	const hardCap = 5 * budget
	bs, trips := tripCounter()
	lim := newBudgeted(t, srv.Client(t), hotLimit.WithName("sat-hung"), leaselimit.WithBreaker(bs))
	load := saturatedLoad(t, lim)
	time.Sleep(time.Second)
	base := runtime.NumGoroutine()
	load.setPhase(1)
	srv.Pause(t)
	peak := base
	for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		peak = max(peak, runtime.NumGoroutine())
	}
	load.setPhase(2)
	srv.Resume(t)
	back := time.Now()
	_, ok := waitUntil(recoverWithin, func() bool { return !load.firstAt(2, leaselimit.SourceAuthority).IsZero() })
	load.Stop()
	for ph, name := range []string{"healthy", "hung", "back"} {
		t.Logf("phase %d (%s): %s", ph, name, load.summary(ph))
	}
	t.Logf("goroutines: %d before the hang, at most %d during it; breaker opened %d times; slowest decision while hung %v (cap %v)",
		base, peak, trips.Load(), load.latency(1).Round(time.Millisecond), hardCap)
	if n := load.bySource(1)[leaselimit.SourceFallback]; n == 0 {
		t.Errorf("no fallback decision in 1.5s of a hung Redis under load")
	}
	if trips.Load() == 0 {
		t.Errorf("the breaker never opened on a hung Redis under load")
	}
	// The hard cap, plus a second for a noisy machine (the other hung-Redis
	// tests allow the same).
	if worst := load.latency(1); worst > hardCap+time.Second {
		t.Errorf("slowest decision on a hung Redis under load took %v; cap %v", worst, hardCap)
	}
	// Each caller leaves at most a call or two waiting on the hung
	// connection before the breaker opens, and the breaker lets a probe
	// through per OpenFor: hundreds at most, not one per decision.
	if peak > base+400 {
		t.Errorf("goroutines grew from %d to %d while Redis hung", base, peak)
	}
	if !ok {
		t.Fatalf("no authority decision %v after Redis came back", recoverWithin)
	}
	t.Logf("authority decisions resumed %v after Redis came back", load.firstAt(2, leaselimit.SourceAuthority).Sub(back).Round(time.Millisecond))
}

// TestStallUnderLoad: a 0.5s stall (DEBUG SLEEP) while the process is
// saturated. Decisions return to Redis soon after it answers again: the
// breaker closes, and the last fallback decision of a call begun before it
// closed comes, within 0.5s of Redis answering (plus slack for a noisy
// machine). A trip later than a hard cap after that close is another
// episode, made of calls begun on a Redis that answered; it is reported,
// not failed: with other test binaries on the same two cores (go test runs
// packages side by side) Redis itself can answer late. A trip sooner than
// that fails: calls from the stall were blamed on a Redis that answers.
func TestStallUnderLoad(t *testing.T) {
	twoProcs(t)
	srv := redistest.Start(t, "--enable-debug-command", "yes")
	const hardCap = 5 * leaselimit.DefaultTimeout
	var (
		load     *phasedLoad // set before stalling, read by the hook only after
		stalling atomic.Bool
		trips    atomic.Int64 // while stalling or since
		closedAt atomic.Int64 // unix ns of the first close after such a trip
		reopened atomic.Int64 // unix ns of the first trip after that close
	)
	bs := breaker.Settings{OnStateChange: func(_, to breaker.State) {
		// Runs under the breaker's lock: atomics only.
		if !stalling.Load() {
			return
		}
		now := time.Now().UnixNano()
		switch {
		case to == breaker.Open:
			trips.Add(1)
			if closedAt.Load() != 0 {
				reopened.CompareAndSwap(0, now)
			}
		case to == breaker.Closed && trips.Load() > 0:
			if closedAt.CompareAndSwap(0, now) {
				load.setPhase(3) // calls begun from here on are the closed breaker's
			}
		}
	}}
	lim := newBudgeted(t, srv.Client(t), hotLimit.WithName("sat-stall"), leaselimit.WithBreaker(bs))
	load = saturatedLoad(t, lim)
	time.Sleep(time.Second)
	stalling.Store(true)
	load.setPhase(1)
	stalled := time.Now()
	srv.Do(t, "DEBUG", "SLEEP", "0.5") // returns when Redis answers again
	back := time.Now()
	load.advance(1, 2) // unless the breaker closed already
	time.Sleep(1500 * time.Millisecond)
	load.Stop()
	for ph, name := range []string{"healthy", "stall", "after", "closed again"} {
		t.Logf("phase %d (%s): %s", ph, name, load.summary(ph))
	}
	stall := back.Sub(stalled).Round(time.Millisecond)
	last := load.lastAt(1, leaselimit.SourceFallback)
	if l2 := load.lastAt(2, leaselimit.SourceFallback); l2.After(last) {
		last = l2
	}
	if last.IsZero() && trips.Load() == 0 {
		// 48 callers on cold keys need Redis throughout a stall of five
		// budgets: none falling back means the stall went unseen. (This
		// was a log line; a review found it never fired in 11 runs.)
		t.Errorf("stall of %v: no fallback decision at all, the breaker never opened", stall)
		return
	}
	if !last.IsZero() {
		after := last.Sub(back)
		t.Logf("stall of %v: last fallback decision of a call begun before the breaker closed %v after Redis answered again",
			stall, after.Round(time.Millisecond))
		if after > 500*time.Millisecond+500*time.Millisecond {
			t.Errorf("last fallback decision %v after Redis answered again; want within 0.5s (+0.5s slack)", after)
		}
	}
	if trips.Load() > 0 {
		closed := closedAt.Load()
		if closed == 0 {
			t.Fatalf("the breaker opened %d times and had not closed 1.5s after Redis answered again", trips.Load())
		}
		after := time.Unix(0, closed).Sub(back)
		t.Logf("breaker opened %d times; it closed %v after Redis answered again", trips.Load(), after.Round(time.Millisecond))
		if after > 500*time.Millisecond+500*time.Millisecond {
			t.Errorf("the breaker closed %v after Redis answered again; want within 0.5s (+0.5s slack)", after)
		}
		if re := reopened.Load(); re != 0 {
			since := time.Duration(re - closed)
			if since < hardCap {
				t.Errorf("the breaker opened again %v after it closed (within a hard cap, %v): calls from the stall were blamed on a Redis that answers",
					since.Round(time.Millisecond), hardCap)
			} else {
				t.Logf("the breaker opened again %v after it closed: a new episode (see the test's comment), %d fallback decisions since the close",
					since.Round(time.Millisecond), load.bySource(3)[leaselimit.SourceFallback])
			}
		}
	}
	if n := load.bySource(2)[leaselimit.SourceAuthority] + load.bySource(2)[leaselimit.SourceLease] +
		load.bySource(3)[leaselimit.SourceAuthority] + load.bySource(3)[leaselimit.SourceLease]; n == 0 {
		t.Errorf("no lease or authority decision in the 1.5s after the stall")
	}
}
