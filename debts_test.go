package leaselimit_test

import (
	"context"
	"log/slog"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/clockhook"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/internal/syncbuf"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

// debtLimit is a bucket that does not refill during a test.
func debtLimit(name string, burst int64) policy.Limit {
	return policy.Limit{Name: name, Rate: 1, Period: 24 * time.Hour, Burst: burst}
}

// level returns the whole tokens key's bucket holds under limit, negative
// in debt, read by a Limiter of its own (see bucketLevel).
func level(t *testing.T, c redis.UniversalClient, limit policy.Limit, key string) int64 {
	t.Helper()
	lim, err := leaselimit.New(c, limit, leaselimit.WithoutLease(), leaselimit.WithTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer lim.Close()
	d, err := lim.Peek(context.Background(), key)
	if err != nil {
		t.Fatalf("Peek(%s): %v", key, err)
	}
	return bucketLevel(d, limit)
}

// proxied returns a proxy to srv and a client through it that dials once
// (a refused connection fails at once).
func proxied(t *testing.T, srv *redistest.Server) (*redistest.Proxy, *redis.Client) {
	t.Helper()
	proxy := redistest.NewProxy(t, srv.Addr)
	c := redis.NewClient(&redis.Options{Addr: proxy.Addr, DialerRetries: 1})
	t.Cleanup(func() { _ = c.Close() })
	return proxy, c
}

// admissions counts the admissions of key "k" by where their tokens came
// from: the bucket (taken), or the failure policy (owed: charged to the
// bucket once Redis answers).
type admissions struct{ taken, owed int64 }

// allow makes one Allow of "k" through lim, in phase (for the message).
func (a *admissions) allow(t *testing.T, lim *leaselimit.Limiter, phase string) {
	t.Helper()
	d, err := lim.Allow(context.Background(), "k")
	switch {
	case err != nil:
		t.Fatalf("Allow (%s): %v", phase, err)
	case d.Allowed && d.Source == leaselimit.SourceFallback:
		a.owed++
	case d.Allowed:
		a.taken++
	}
}

// TestFallbackAdmissionsAreCharged: what the failure policy admits while
// Redis cannot be reached (FailOpen's admissions, FailLocal's share; one
// limit and a multi-limit; exact and lease mode) is charged to the bucket
// once Redis answers again, so the bucket ends exactly as if Redis had
// granted those tokens; and a charge past one Burst leaves the bucket one
// Burst in debt, no more.
func TestFallbackAdmissionsAreCharged(t *testing.T) {
	mostlyWaits(t)
	srv := redistest.Start(t)
	direct := srv.Client(t)
	cases := []struct {
		name  string
		mode  policy.FailureMode
		lease bool
		multi bool
		down  int64 // admissions tried while Redis is down
		reset bool  // the key is Reset first: its mark must not forgive the debt
	}{
		{"open-exact", policy.FailOpen, false, false, 25, false},
		{"open-lease", policy.FailOpen, true, false, 25, false},
		{"local-exact", policy.FailLocal, false, false, 25, false},
		{"open-multi", policy.FailOpen, false, true, 25, false},
		{"open-past-burst", policy.FailOpen, false, false, 130, false},
		{"open-after-reset", policy.FailOpen, false, false, 25, true},
		{"local-lease-after-reset", policy.FailLocal, true, false, 25, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			proxy, c := proxied(t, srv)
			a, b := debtLimit("debt-a-"+tc.name, 60), debtLimit("debt-b-"+tc.name, 50)
			opts := []leaselimit.Option{leaselimit.WithFailureMode(tc.mode), leaselimit.WithTimeout(200 * time.Millisecond),
				leaselimit.WithBreaker(breaker.Settings{OpenFor: 20 * time.Millisecond})}
			if !tc.lease {
				opts = append(opts, leaselimit.WithoutLease())
			}
			lim := mustNew(t, c, a, opts...)
			view := lim
			if tc.multi {
				view = lim.For(a, b)
			}
			ctx := context.Background()
			if tc.reset {
				if err := mustNew(t, direct, a, leaselimit.WithoutLease()).Reset(ctx, "k"); err != nil {
					t.Fatal(err)
				}
			}
			var got admissions
			allow := func(phase string) { got.allow(t, view, phase) }
			for range 10 {
				allow("Redis up")
			}
			proxy.Refuse(true)
			for range tc.down {
				allow("Redis down")
			}
			if got.owed == 0 {
				t.Fatalf("no admission of the failure policy in %d tries with Redis down", tc.down)
			}
			proxy.Refuse(false)
			// Close returns the lease's unused tokens and sends what is
			// still owed, whatever the breaker says.
			waitReachable(t, c, "the client")
			if err := lim.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			limits := []policy.Limit{a}
			if tc.multi {
				limits = append(limits, b)
			}
			for _, l := range limits {
				want := l.Burst - got.taken - got.owed
				if want < -l.Burst {
					want = -l.Burst // a debt past one Burst is forgiven
				}
				if held := level(t, direct, l, "k"); held != want {
					t.Errorf("%s: the bucket holds %d; want %d (Burst %d, %d taken from it, %d admitted by the policy)",
						l.Name, held, want, l.Burst, got.taken, got.owed)
				}
			}
		})
	}
}

// TestFallbackReservationSettled: a reservation the failure policy granted
// is charged its estimate once Redis answers, and its Settle adds an
// excess to that charge (a surplus is not given back). Regression: Settle
// did nothing, and Reserve(10) then Settle(90) left 90 tokens in a bucket
// of 100 (found by an adversarial review).
func TestFallbackReservationSettled(t *testing.T) {
	srv := redistest.Start(t)
	direct := srv.Client(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name         string
		actual, want int64 // the settled cost; the bucket after Close
		before       int   // the policy's admissions of the key before the Reserve
	}{
		{"excess", 90, 10, 0},
		{"surplus", 3, 90, 0},
		{"past-burst", 250, -100, 0}, // a debt past one Burst is forgiven
		// Owed already, a huge excess overflowed the debt's sum, which went
		// out as a refund of a whole Burst.
		{"huge", math.MaxInt64, -100, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			proxy, c := proxied(t, srv)
			l := debtLimit("debt-settle-"+tc.name, 100)
			lim := mustNew(t, c, l, leaselimit.WithFailureMode(policy.FailOpen), leaselimit.WithTimeout(200*time.Millisecond),
				leaselimit.WithBreaker(breaker.Settings{OpenFor: 20 * time.Millisecond}), leaselimit.WithoutLease())
			proxy.Refuse(true)
			for range tc.before {
				if d, err := lim.Allow(ctx, "k"); err != nil || d.Source != leaselimit.SourceFallback {
					t.Fatalf("Allow with Redis down = %+v, %v; want the failure policy's decision", d, err)
				}
			}
			r, err := lim.Reserve(ctx, "k", 10)
			if err != nil || !r.Decision().Allowed || r.Decision().Source != leaselimit.SourceFallback {
				t.Fatalf("Reserve with Redis down = %+v, %v; want admitted by the failure policy", r.Decision(), err)
			}
			if err := r.Settle(ctx, tc.actual); err != nil {
				t.Fatalf("Settle(%d): %v", tc.actual, err)
			}
			proxy.Refuse(false)
			waitReachable(t, c, "the client")
			if err := lim.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if got := level(t, direct, l, "k"); got != tc.want {
				t.Errorf("the bucket holds %d after Reserve(10) by the policy and Settle(%d); want %d", got, tc.actual, tc.want)
			}
		})
	}
}

// TestFallbackChargedWhileRunning: the janitor charges the policy's
// admissions once the breaker is closed again, without waiting for Close.
func TestFallbackChargedWhileRunning(t *testing.T) {
	srv := redistest.Start(t)
	proxy, c := proxied(t, srv)
	l := debtLimit("debt-running", 20)
	lim := mustNew(t, c, l, leaselimit.WithoutLease(), leaselimit.WithTimeout(200*time.Millisecond),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: 20 * time.Millisecond}))
	ctx := context.Background()
	proxy.Refuse(true)
	owed := int64(0)
	for range 15 {
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed || d.Source != leaselimit.SourceFallback {
			t.Fatalf("Allow with Redis down = %+v, %v; want FailOpen's admission", d, err)
		}
		owed++
	}
	proxy.Refuse(false)
	waitReachable(t, c, "the client")
	// Decisions reach Redis again once the breaker's probes pass (the
	// policy admits until then); the bucket is spent in a tight loop.
	admitted := int64(0)
	for deadline := time.Now().Add(10 * time.Second); ; {
		d, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case d.Allowed && d.Source == leaselimit.SourceFallback:
			owed++ // before the breaker closes
		case d.Allowed:
			admitted++
		}
		if !d.Allowed && d.Source != leaselimit.SourceFallback {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still admitting after 10 s: %d admitted by Redis after the outage", admitted)
		}
	}
	// The debt follows while the Limiter runs: the bucket ends as if
	// Redis had granted the outage's admissions too.
	want := max(l.Burst-admitted-owed, -l.Burst)
	got := level(t, srv.Client(t), l, "k")
	for deadline := time.Now().Add(10 * time.Second); got != want && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		got = level(t, srv.Client(t), l, "k")
	}
	if got != want {
		t.Errorf("the bucket holds %d with the Limiter running; want %d (Burst %d, %d admitted by Redis, %d by the policy during the outage)",
			got, want, l.Burst, admitted, owed)
	}
}

// TestDenialAfterOutageCountsDebt: the first denials after an outage,
// which Redis makes before the failure policy's admissions are charged
// (the breaker's probes are decisions' own calls), say how long the bucket
// will take once charged, and a lease's negative cache keeps that, not the
// wait of the bucket before the charge. Regression: a cached denial said
// 3 s where Redis, charged, then said 32 s (a new user's trial).
func TestDenialAfterOutageCountsDebt(t *testing.T) {
	srv := redistest.Start(t)
	direct := srv.Client(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		lease bool
		multi bool
	}{
		{"exact", false, false},
		{"lease", true, false},
		{"exact-multi", false, true},
		{"lease-multi", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			proxy, c := proxied(t, srv)
			// A token a second: the charge (FailLocal's admissions, the
			// share of one of two instances: about 5) adds about 5 s to a
			// wait of less than one, and leaves the bucket less than one
			// Burst in debt, so that what is charged does not depend on
			// when the charge lands (past one Burst it would: the cap
			// forgives less of a charge made after a refill).
			l := policy.Limit{Name: "debt-wait-" + tc.name, Rate: 60, Period: time.Minute, Burst: 10}
			// The other limit of the multi-limit never denies, however much
			// the policy admitted.
			other := policy.Limit{Name: "debt-wait-other-" + tc.name, Rate: 1_000_000, Period: time.Hour, Burst: 1_000_000}
			// Eight probes: the first seven calls that reach Redis again
			// run while the breaker is half-open, so the janitor has not
			// yet taken the debt to charge it (it does once the breaker
			// closes), and the two denials the test reads are made before
			// the charge even if a refill granted a token first. (The
			// probe that closes the breaker races the janitor, which the
			// closing wakes: see debtBook.charged.)
			opts := []leaselimit.Option{leaselimit.WithFailureMode(policy.FailLocal), leaselimit.WithFleetSize(2),
				leaselimit.WithTimeout(200 * time.Millisecond), leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: 20 * time.Millisecond, Probes: 8})}
			if !tc.lease {
				opts = append(opts, leaselimit.WithoutLease())
			}
			lim := mustNew(t, c, l, opts...)
			view, peeker := lim, mustNew(t, direct, l, leaselimit.WithoutLease())
			if tc.multi {
				// The bucket that denies is the second of two.
				view, peeker = lim.For(other, l), peeker.For(other, l)
			}
			allow := func() leaselimit.Decision {
				t.Helper()
				d, err := view.Allow(ctx, "k")
				if err != nil {
					t.Fatal(err)
				}
				return d
			}
			for d := allow(); d.Allowed; d = allow() {
			}
			proxy.Refuse(true)
			for owed, deadline := 0, time.Now().Add(10*time.Second); owed < 4; {
				// A lease's cached denial first, then FailLocal's admissions.
				if d := allow(); d.Allowed && d.Source == leaselimit.SourceFallback {
					owed++
				}
				if time.Now().After(deadline) {
					t.Fatalf("%d admissions of FailLocal within 10 s of Redis refusing connections; want 4", owed)
				}
			}
			proxy.Refuse(false)
			waitReachable(t, c, "the client")
			type denial struct {
				d  leaselimit.Decision
				at time.Time
			}
			var denials []denial
			for deadline := time.Now().Add(10 * time.Second); len(denials) < 2; {
				if d := allow(); !d.Allowed && d.Source != leaselimit.SourceFallback {
					denials = append(denials, denial{d, time.Now()})
				}
				if time.Now().After(deadline) {
					t.Fatalf("no denial but the policy's within 10 s of the outage's end: %+v", denials)
				}
			}
			// Once the breaker closes the janitor charges the debt: the
			// bucket's own wait then, read without a lease.
			var truth leaselimit.Decision
			later := 0 // admissions after the denials: each a token later
			for deadline := time.Now().Add(10 * time.Second); truth.RetryAfter < 3*time.Second; {
				if d := allow(); d.Allowed {
					later++
				}
				var err error
				if truth, err = peeker.Peek(ctx, "k"); err != nil {
					t.Fatal(err)
				}
				if time.Now().After(deadline) {
					t.Fatalf("the policy's admissions not charged within 10 s of the outage's end: the bucket says %+v", truth)
				}
			}
			read := time.Now()
			for i, dn := range denials {
				// What the bucket said then, charged: its wait now, plus
				// the time since the denial; to a token's time (the
				// bucket's fraction of a token, rounding).
				want := truth.RetryAfter + read.Sub(dn.at) - time.Duration(later)*time.Second
				if diff := dn.d.RetryAfter - want; diff < -time.Second || diff > time.Second {
					t.Errorf("denial %d after the outage (%v) said RetryAfter %v; the bucket, charged, said about %v (%d admitted after it)",
						i+1, dn.d.Source, dn.d.RetryAfter, want, later)
				}
			}
		})
	}
}

// TestDebtBookFull: the debt book holds one entry per bucket, bounded by
// WithMaxKeys; an admission that finds it full is not charged, and says
// so on ratelimit.settle.charges.dropped and in the log.
func TestDebtBookFull(t *testing.T) {
	mostlyWaits(t)
	m, c := newMini(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	var logs syncbuf.Buffer // the janitor logs the breaker's state meanwhile
	lim := mustNew(t, c, debtLimit("debt-full", 10), leaselimit.WithoutLease(), leaselimit.WithMaxKeys(8),
		leaselimit.WithMeterProvider(mp), leaselimit.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}))
	m.Close()
	ctx := context.Background()
	for i := range 20 {
		if d, err := lim.AllowN(ctx, "k"+string(rune('a'+i)), 2); err != nil || !d.Allowed || d.Source != leaselimit.SourceFallback {
			t.Fatalf("AllowN with Redis down = %+v, %v", d, err)
		}
	}
	_, charges := droppedTokens(t, reader)
	if charges != 2*(20-8) {
		t.Errorf("ratelimit.settle.charges.dropped = %d; want %d (12 keys past a book of 8, 2 tokens each)", charges, 2*(20-8))
	}
	if !strings.Contains(logs.String(), "will not be charged") {
		t.Errorf("no log line for the uncharged admissions; log:\n%s", logs.String())
	}
}

// TestOnlyTheProbeWaits: while the breaker is half-open, callers of a key
// whose refill is the breaker's probe do not wait for it: the failure
// policy decides for each at once, while the probe's own caller still
// waits for Redis.
// Regression: they joined the probe's refill and waited with it, up to
// the budget, for a call they could not have made themselves.
func TestOnlyTheProbeWaits(t *testing.T) {
	mostlyWaits(t)
	srv := redistest.Start(t)
	proxy := redistest.NewProxy(t, srv.Addr)
	c := redis.NewClient(&redis.Options{Addr: proxy.Addr})
	t.Cleanup(func() { _ = c.Close() })
	lim := mustNew(t, c, policy.PerSecond(1000).WithName("probe-waits"), leaselimit.WithTimeout(2*time.Second),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: 10 * time.Millisecond, Probes: 1}))
	ctx := context.Background()
	if _, err := lim.Allow(ctx, "warm"); err != nil {
		t.Fatal(err)
	}
	proxy.Blackhole(true)
	if d, err := lim.Allow(ctx, "first"); err != nil || d.Source != leaselimit.SourceFallback {
		t.Fatalf("Allow with Redis hung = %+v, %v; want a fallback", d, err)
	}
	for deadline := time.Now().Add(10 * time.Second); lim.BreakerState() != breaker.Open; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("breaker %v after a failure with Failures 1", lim.BreakerState())
		}
	}
	time.Sleep(20 * time.Millisecond) // OpenFor: the next call is the probe
	probed := make(chan struct{})
	go func() {
		defer close(probed)
		_, _ = lim.Allow(ctx, "k") // the probe: waits for the hung Redis
	}()
	for deadline := time.Now().Add(10 * time.Second); lim.BreakerState() != breaker.HalfOpen; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("breaker %v; want the probe in flight (half-open)", lim.BreakerState())
		}
	}
	for i := range 20 {
		d, err := lim.Allow(ctx, "k")
		if err != nil || !d.Allowed || d.Source != leaselimit.SourceFallback {
			t.Fatalf("Allow #%d beside the probe = %+v, %v; want FailOpen's admission", i, d, err)
		}
		select {
		case <-probed:
			t.Fatalf("the probe ended before caller #%d beside it had its decision: it waited for the probe", i)
		default:
		}
	}
	proxy.Blackhole(false)
	<-probed
}

// skewedClock is the system clock with its wall reading off by skew (whole
// seconds) and its monotonic reading true: an instance whose clock is
// wrong, as time.Now reads it there.
type skewedClock struct {
	t    *testing.T
	skew time.Duration
}

func (c skewedClock) Now() time.Time {
	s, ok := clockhook.StepWall(time.Now(), c.skew)
	if !ok {
		c.t.Error("clockhook.StepWall cannot make a skewed reading")
	}
	return s
}

// TestQuotaDebtInRedisWindow: what FailOpen admits during an outage is
// charged to the calendar window Redis's clock was in, not the one the
// instance's clock says: an instance a minute behind, in an outage in the
// first second of an hour (Redis's clock), and one a minute ahead, in the
// last seconds of an hour. Regression: the debt was stamped with the
// window of the instance's clock, and the charge, of another window, was
// dropped: the window admitted 150 of a quota of 100 (found by an
// adversarial review).
func TestQuotaDebtInRedisWindow(t *testing.T) {
	mostlyWaits(t)
	srv := redistest.Start(t)
	direct := srv.Client(t)
	for _, tc := range []struct {
		name  string
		skew  time.Duration // the instance's clock less Redis's
		lease bool
	}{
		{"behind-exact", -time.Minute, false},
		{"behind-lease", -time.Minute, true},
		{"ahead-exact", time.Minute, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const quota, down = 100, 40
			// An hour of a zone whose hours end 7 s from now (Redis's
			// clock is this machine's): the outage falls 0.3 s after
			// the start of one, or 5 s before its end.
			boundary := time.Now().Add(7 * time.Second).Truncate(time.Second)
			zone := time.FixedZone(tc.name, int((3600-boundary.Unix()%3600)%3600))
			limit := policy.Quota("debt-window-"+tc.name, quota, policy.Hour, zone)
			outage := boundary.Add(300 * time.Millisecond)
			if tc.skew > 0 {
				outage = boundary.Add(-5 * time.Second)
			}
			proxy, c := proxied(t, srv)
			opts := []leaselimit.Option{leaselimit.WithClock(skewedClock{t, tc.skew}), leaselimit.WithFailureMode(policy.FailOpen),
				leaselimit.WithTimeout(200 * time.Millisecond), leaselimit.WithBreaker(breaker.Settings{OpenFor: 20 * time.Millisecond})}
			if !tc.lease {
				opts = append(opts, leaselimit.WithoutLease())
			}
			lim := mustNew(t, c, limit, opts...)
			time.Sleep(time.Until(outage))
			var got admissions
			allow := func(phase string) { got.allow(t, lim, phase) }
			allow("Redis up")
			proxy.Refuse(true)
			proxy.CutAll()
			for range down {
				allow("Redis down")
			}
			if got.owed == 0 {
				t.Fatalf("no admission of FailOpen in %d tries with Redis down", down)
			}
			proxy.Refuse(false)
			waitReachable(t, c, "the client")
			if err := lim.Close(); err != nil { // sends what is owed
				t.Fatalf("Close: %v", err)
			}
			if tc.skew > 0 && !time.Now().Before(boundary) {
				t.Fatal("the hour ended before the charge was made: the machine is too slow for this test")
			}
			// A lease's unused tokens went back at Close: the window
			// holds the quota less what Redis granted and what FailOpen
			// admitted.
			if held, want := level(t, direct, limit, "k"), quota-got.taken-got.owed; held != want {
				t.Errorf("the window holds %d; want %d (quota %d, %d taken from it, %d admitted by FailOpen): the charge went to another window",
					held, want, quota, got.taken, got.owed)
			}
		})
	}
}
