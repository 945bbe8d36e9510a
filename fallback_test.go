package leaselimit_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/syncbuf"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
)

// TestFailLocalReportsShare: a FailLocal decision reports the share that
// decided (Limit, Remaining and ResetAfter of this instance's 1/FleetSize).
// Regression: denials computed ResetAfter from the global limit with the
// local remaining count, and every decision reported the global Limit.
func TestFailLocalReportsShare(t *testing.T) {
	mostlyWaits(t)
	m, c := newMini(t)
	clk := newFakeClock()
	ctx := context.Background()
	l := policy.PerMinute(100).WithName("share")
	lim := mustNew(t, c, l, leaselimit.WithClock(clk),
		leaselimit.WithFailureMode(policy.FailLocal), leaselimit.WithFleetSize(4),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}))
	m.Close() // Redis is down: every decision is FailLocal's
	share := policy.Limit{Name: "share", Rate: 25, Period: time.Minute, Burst: 25}
	for i := int64(0); i <= share.Burst; i++ {
		d, err := lim.Allow(ctx, "k")
		if err != nil || d.Source != leaselimit.SourceFallback {
			t.Fatalf("Allow #%d with Redis down = %+v, %v; want a fallback", i+1, d, err)
		}
		if d.Limit != share {
			t.Fatalf("Allow #%d: Limit %v; want the share %v", i+1, d.Limit, share)
		}
		taken := min(i+1, share.Burst)
		if d.Allowed != (i < share.Burst) || d.Remaining != share.Burst-taken || d.ResetAfter != share.Interval(taken) {
			t.Errorf("Allow #%d = %+v; want allowed=%v, remaining %d, ResetAfter %v (the share's)",
				i+1, d, i < share.Burst, share.Burst-taken, share.Interval(taken))
		}
	}
}

// TestFailLocalSeveralLimits: a request admitted by every limit's share
// reports the share with the least room, and each share as a part. It
// reported the last share alone: a daily share's 49 where the per-second
// share, with 1 left, refused the next request.
func TestFailLocalSeveralLimits(t *testing.T) {
	mostlyWaits(t)
	m, c := newMini(t)
	clk := newFakeClock()
	ctx := context.Background()
	perSecond := policy.Limit{Name: "ps", Rate: 10, Period: time.Second, Burst: 10}
	daily := policy.Quota("daily", 100, policy.Day, nil)
	root := mustNew(t, c, perSecond, leaselimit.WithClock(clk), leaselimit.WithTimeout(200*time.Millisecond),
		leaselimit.WithFailureMode(policy.FailLocal), leaselimit.WithFleetSize(2),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor})) // a short budget: Close's last flush waits for it
	both := root.For(perSecond, daily)
	m.Close()
	for i := int64(1); i <= 4; i++ {
		d, err := both.Allow(ctx, "k")
		if err != nil || !d.Allowed || d.Source != leaselimit.SourceFallback {
			t.Fatalf("Allow #%d with Redis down = %+v, %v; want FailLocal's admission", i, d, err)
		}
		if d.Limit.Name != "ps" || d.Remaining != 5-i || len(d.Parts) != 2 || d.Parts[1].Limit.Name != "daily" || d.Parts[1].Remaining != 50-i {
			t.Errorf("Allow #%d = %+v; want the per-second share (%d left) as the decision, and both shares as parts", i, d, 5-i)
		}
		// As Redis's decisions: until every share is full (the daily's).
		if len(d.Parts) == 2 && (d.ResetAfter != max(d.Parts[0].ResetAfter, d.Parts[1].ResetAfter) || d.ResetAfter <= d.Parts[0].ResetAfter) {
			t.Errorf("Allow #%d: ResetAfter %v, parts %v and %v; want the longest, the daily share's", i, d.ResetAfter, d.Parts[0].ResetAfter, d.Parts[1].ResetAfter)
		}
	}
}

// TestFailOpenSeveralLimits: FailOpen's admission of a request under
// several limits reports each limit as a part (what Redis last said, else
// a full bucket), the one with the least room as the decision. Regression
// (a review): it reported the first limit alone, and httplimit's and
// grpclimit's fields left the others out during an outage.
func TestFailOpenSeveralLimits(t *testing.T) {
	mostlyWaits(t)
	m, c := newMini(t)
	ctx := context.Background()
	perSecond := policy.Limit{Name: "ps", Rate: 10, Period: time.Second, Burst: 10}
	daily := policy.Quota("daily", 8, policy.Day, nil)
	root := mustNew(t, c, perSecond, leaselimit.WithFailureMode(policy.FailOpen), leaselimit.WithTimeout(200*time.Millisecond),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor})) // a short budget: Close's last flush waits for it
	both := root.For(perSecond, daily)
	m.Close()
	d, err := both.Allow(ctx, "k")
	if err != nil || !d.Allowed || d.Source != leaselimit.SourceFallback {
		t.Fatalf("Allow with Redis down = %+v, %v; want FailOpen's admission", d, err)
	}
	if len(d.Parts) != 2 || d.Parts[0].Limit.Name != "ps" || d.Parts[1].Limit.Name != "daily" ||
		d.Parts[0].Remaining != 10 || d.Parts[1].Remaining != 8 {
		t.Errorf("FailOpen's decision = %+v; want both limits as parts, full", d)
	}
	if d.Limit.Name != "daily" || d.Remaining != 8 {
		t.Errorf("FailOpen's decision names %q with %d left; want the one with the least room, daily with 8", d.Limit.Name, d.Remaining)
	}
	if len(d.Parts) == 2 && d.ResetAfter != max(d.Parts[0].ResetAfter, d.Parts[1].ResetAfter) {
		t.Errorf("FailOpen's ResetAfter %v, parts %v and %v; want the longest, as Redis's decisions", d.ResetAfter, d.Parts[0].ResetAfter, d.Parts[1].ResetAfter)
	}
}

// TestClockForBreakerRetry: under WithClock, a FailClosed denial's
// RetryAfter (until the breaker lets a probe through) is on that clock, and
// the open breaker holds Peek and Reset back too.
// Regression: the breaker's open-until was on the real clock and the
// decision's "now" on the Limiter's, so with a clock set in January the
// retry-after came out as the months in between.
func TestClockForBreakerRetry(t *testing.T) {
	m, c := newMini(t)
	clk := newFakeClock()
	ctx := context.Background()
	lim := mustNew(t, c, policy.PerMinute(10).WithName("clock"), leaselimit.WithClock(clk), leaselimit.WithoutLease(),
		leaselimit.WithFailureMode(policy.FailClosed),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}))
	m.Close()
	if d, err := lim.Allow(ctx, "k"); err != nil || d.Source != leaselimit.SourceFallback {
		t.Fatalf("Allow with Redis down = %+v, %v", d, err)
	}
	// On a loaded machine the waiter may find this process behind and wait
	// out the call past the fallback (reason "saturated"): the breaker then
	// learns the failure when the call itself ends, at most a few budgets
	// later.
	for deadline := time.Now().Add(5 * time.Second); lim.BreakerState() != breaker.Open; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("breaker %v after a failure with Failures 1", lim.BreakerState())
		}
	}
	clk.Add(10 * time.Second)
	d, err := lim.Allow(ctx, "k")
	if err != nil || d.Allowed || d.Source != leaselimit.SourceFallback {
		t.Fatalf("Allow with the breaker open = %+v, %v", d, err)
	}
	want := breaker.MaxOpenFor - 10*time.Second
	if d.RetryAfter != want {
		t.Errorf("RetryAfter %v 10s into a breaker open for %v, on the fake clock; want %v", d.RetryAfter, breaker.MaxOpenFor, want)
	}
	// Peek and Reset are held back as decisions are, on the same clock,
	// and say when calls resume.
	resume := "calls resume in " + want.String()
	if _, err := lim.Peek(ctx, "k"); !errors.Is(err, breaker.ErrOpen) || !strings.Contains(err.Error(), resume) {
		t.Errorf("Peek with the breaker open = %v; want it held back (breaker.ErrOpen), saying %q", err, resume)
	}
	if err := lim.Reset(ctx, "k"); !errors.Is(err, breaker.ErrOpen) || !strings.Contains(err.Error(), resume) {
		t.Errorf("Reset with the breaker open = %v; want it held back (breaker.ErrOpen), saying %q", err, resume)
	}
}

// refusedAddr returns an address where nothing listens: a port listened
// on, then closed.
func refusedAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	return addr
}

// silentAddr returns the address of a listener that accepts connections
// and never answers: a hung Redis.
func silentAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			go func() { _, _ = io.Copy(io.Discard, c) }() // reads, never replies
		}
	}()
	t.Cleanup(func() {
		lis.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return lis.Addr().String()
}

// reasonRun is what a Limiter on addr reported for calls made while Redis
// could not answer: its log, its fallbacks by reason (ratelimit.fallbacks)
// and its decision spans' ratelimit.reason.
type reasonRun struct {
	log    string
	metric map[string]int64
	spans  map[string]int
	types  map[string]int // error.type of the Redis calls' spans
}

// fallbackReasons makes calls decisions under FailOpen on a client of addr
// (ContextTimeoutEnabled if direct) with a 100ms budget. Without direct,
// the client's reads time out at 500ms: past the budget, as go-redis's
// default 5s is, but a silent Redis then holds Close (which waits for the
// calls in flight, see docs/operations.md) 1s where the default held it
// 10s or more.
func fallbackReasons(t *testing.T, addr string, direct bool, calls int) reasonRun {
	t.Helper()
	opts := &redis.Options{Addr: addr, ContextTimeoutEnabled: direct}
	if !direct {
		opts.ReadTimeout = 500 * time.Millisecond
	}
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	rig := newTelemetryRig(t)
	var out syncbuf.Buffer
	lim := mustNew(t, c, policy.PerSecond(10).WithName("reasons"), append(rig.opts(), leaselimit.WithoutLease(),
		leaselimit.WithFailureMode(policy.FailOpen), leaselimit.WithTimeout(100*time.Millisecond),
		leaselimit.WithLogger(slog.New(slog.NewTextHandler(&out, nil))))...)
	var run reasonRun
	denied := 0
	for i := range calls {
		d, err := lim.Allow(context.Background(), "k"+strconv.Itoa(i))
		if err != nil || d.Source != leaselimit.SourceFallback {
			t.Fatalf("Allow #%d with Redis unable to answer = %+v, %v; want a fallback", i+1, d, err)
		}
		if !d.Allowed {
			denied++ // this process was behind: denied whatever the policy (checked below)
		}
	}
	_, run.metric = rig.saturatedCalls(t)
	// A loaded machine may leave a call's outcome unread past the hard
	// cap: reason saturated, a denial even under FailOpen (see
	// TestSaturatedByOtherWork). Every other fallback is FailOpen's
	// admission. (Before, such a denial failed the test before its
	// allowance for a loaded machine was reached.)
	if int64(denied) != run.metric[telemetry.ReasonSaturated] {
		t.Errorf("%d of %d fallbacks denied under FailOpen; %d with reason %q: want the same", denied, calls, run.metric[telemetry.ReasonSaturated], telemetry.ReasonSaturated)
	}
	run.spans = map[string]int{}
	for _, s := range spansNamed(rig, telemetry.DecisionSpan) {
		v, _ := attrOf(s, telemetry.AttrReason)
		run.spans[v.AsString()]++
	}
	run.types = map[string]int{}
	for _, s := range spansNamed(rig, telemetry.AuthoritySpan) {
		v, _ := attrOf(s, telemetry.AttrErrorType)
		run.types[v.AsString()]++
	}
	run.log = out.String()
	return run
}

// TestUnreachableReason: calls to an address where nothing listens (a
// wrong address, Redis down) fall back with reason "unreachable" in the
// log, on the decision span and on ratelimit.fallbacks, not "timeout",
// although go-redis's dial retries outlast the budget; a Redis that
// accepts connections but never answers still falls back with "timeout".
// Regression: a wrong address was logged as reason=timeout.
func TestUnreachableReason(t *testing.T) {
	mostlyWaits(t)
	for _, direct := range []bool{false, true} {
		mode := map[bool]string{false: "detached", true: "direct"}[direct]
		t.Run("refused/"+mode, func(t *testing.T) {
			run := fallbackReasons(t, refusedAddr(t), direct, 8)
			t.Logf("fallbacks by reason: metric %v, spans %v; calls by error.type %v\n%s", run.metric, run.spans, run.types, run.log)
			behind := run.metric[telemetry.ReasonSaturated] > 0 // a loaded machine: see TestSaturatedByOtherWork
			if !behind && !strings.Contains(run.log, "reason=unreachable") {
				t.Errorf("log does not say reason=unreachable:\n%s", run.log)
			}
			if !behind && (run.metric[telemetry.ReasonUnreachable] == 0 || run.spans[telemetry.ReasonUnreachable] == 0) {
				t.Errorf("fallbacks by reason: metric %v, spans %v; want %q", run.metric, run.spans, telemetry.ReasonUnreachable)
			}
			// The breaker opens after five failures; every call before it
			// is unreachable.
			for _, r := range []string{telemetry.ReasonTimeout, telemetry.ReasonError} {
				if run.metric[r] > 0 || run.spans[r] > 0 || strings.Contains(run.log, "reason="+r) {
					t.Errorf("a refused connection reported as %q: metric %v, spans %v", r, run.metric, run.spans)
				}
			}
		})
		t.Run("silent/"+mode, func(t *testing.T) {
			run := fallbackReasons(t, silentAddr(t), direct, 8)
			t.Logf("fallbacks by reason: metric %v, spans %v; calls by error.type %v\n%s", run.metric, run.spans, run.types, run.log)
			behind := run.metric[telemetry.ReasonSaturated] > 0
			if !behind && !strings.Contains(run.log, "reason=timeout") {
				t.Errorf("log does not say reason=timeout:\n%s", run.log)
			}
			if !behind && (run.metric[telemetry.ReasonTimeout] == 0 || run.spans[telemetry.ReasonTimeout] == 0) {
				t.Errorf("fallbacks by reason: metric %v, spans %v; want %q", run.metric, run.spans, telemetry.ReasonTimeout)
			}
			if run.metric[telemetry.ReasonUnreachable] > 0 || run.spans[telemetry.ReasonUnreachable] > 0 || strings.Contains(run.log, "reason=unreachable") {
				t.Errorf("a Redis that accepted the connection reported as unreachable: metric %v, spans %v", run.metric, run.spans)
			}
			// Regression (direct): a silent Redis's calls were error.type
			// network, its connections dropped at their deadlines leaving
			// the pool as empty as a refused address leaves it.
			if !behind && run.types["network"] > 0 {
				t.Errorf("Redis calls to a silent Redis by error.type: %v; want no network", run.types)
			}
		})
	}
}

// TestPeekAndResetSayWhy: a Peek or a Reset given up at the budget says
// whether it got no connection (nothing listens: a wrong address, Redis
// down) or no reply (a Redis that accepts connections and never answers),
// as a decision's fallback reason does. Regression: a refused connection
// read "no reply within 100ms", since go-redis dials again until the
// deadline.
func TestPeekAndResetSayWhy(t *testing.T) {
	for _, direct := range []bool{false, true} {
		mode := map[bool]string{false: "detached", true: "direct"}[direct]
		for _, tc := range []struct {
			name, addr, want, not string
		}{
			{"refused", refusedAddr(t), "no connection to Redis", "no reply"},
			{"silent", silentAddr(t), "no reply within", "no connection"},
		} {
			t.Run(tc.name+"/"+mode, func(t *testing.T) {
				opts := &redis.Options{Addr: tc.addr, ContextTimeoutEnabled: direct}
				if !direct {
					opts.ReadTimeout = 500 * time.Millisecond
				}
				c := redis.NewClient(opts)
				t.Cleanup(func() { _ = c.Close() })
				lim := mustNew(t, c, policy.PerSecond(10).WithName("why"), leaselimit.WithTimeout(100*time.Millisecond))
				ctx := context.Background()
				_, peekErr := lim.Peek(ctx, "k")
				resetErr := lim.Reset(ctx, "k")
				for _, call := range []struct {
					name string
					err  error
				}{{"Peek", peekErr}, {"Reset", resetErr}} {
					if !errors.Is(call.err, leaselimit.ErrUnavailable) || !strings.Contains(call.err.Error(), tc.want) || strings.Contains(call.err.Error(), tc.not) {
						t.Errorf("%s = %v; want ErrUnavailable saying %q", call.name, call.err, tc.want)
					}
				}
			})
		}
	}
}

// TestBreakerOpenCancelledCaller: while the breaker is open, a caller whose
// ctx has already ended gets its ctx's error, in both modes: not FailOpen's
// admission, which would be charged to the key's debt. Regression (a
// review): 764 such callers were admitted in one run.
func TestBreakerOpenCancelledCaller(t *testing.T) {
	for _, lease := range []bool{false, true} {
		c := redis.NewClient(&redis.Options{Addr: refusedAddr(t), DialerRetries: 1, MaxRetries: -1})
		t.Cleanup(func() { _ = c.Close() })
		opts := []leaselimit.Option{leaselimit.WithFailureMode(policy.FailOpen), leaselimit.WithTimeout(time.Second),
			leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: time.Minute})}
		if !lease {
			opts = append(opts, leaselimit.WithoutLease())
		}
		lim := mustNew(t, c, policy.PerMinute(10), opts...)
		ctx := context.Background()
		if d, err := lim.Allow(ctx, "k"); err != nil || d.Source != leaselimit.SourceFallback {
			t.Fatalf("lease %v: Allow with Redis refusing = %+v, %v; want the failure policy's", lease, d, err)
		}
		if s := lim.BreakerState(); s != breaker.Open {
			t.Fatalf("lease %v: breaker %v; want open", lease, s)
		}
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		for _, key := range []string{"k", "other"} {
			if d, err := lim.Allow(cancelled, key); !errors.Is(err, context.Canceled) {
				t.Errorf("lease %v: Allow(%s) with a cancelled ctx, breaker open = %+v, %v; want context.Canceled", lease, key, d, err)
			}
		}
		if d, err := lim.Allow(ctx, "k"); err != nil || d.Source != leaselimit.SourceFallback || !d.Allowed {
			t.Errorf("lease %v: Allow, breaker open = %+v, %v; want FailOpen's admission", lease, d, err)
		}
	}
}
