package leaselimit_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

// TestCutCallRecovered: on a client that applies context deadlines, an
// acquire call whose reply comes after a deadline cut it, though Redis ran
// it, leaves the bucket as if it had been answered once the Limiter is
// closed, and nothing is counted unknown: a lease refill cut at the budget puts its grant in the lease
// (which Close gives back), an exact call cut at the budget or by its
// caller's deadline gives its grant back, and so does a lease refill
// carried by the lane's senders, cut by their call's own deadline.
// Regression (the fleet ledger): a cut call's grant stayed debited, the
// whole of a lease refill of which the caller's failure-policy decision
// accounted for its own tokens only; 11 tokens of a bucket were lost in a
// round of refused connections.
func TestCutCallRecovered(t *testing.T) {
	srv := redistest.Start(t)
	evalSha := func(b []byte) bool { return bytes.Contains(bytes.ToLower(b), []byte("evalsha")) }
	// The faults: Redis runs the call and its reply comes after a
	// deadline cut it (held by the proxy until the end), or after the
	// client's short ReadTimeout cut it while the witness answers (the
	// proxy slow until the call returns), or never (the connection
	// broken once Redis answered, until the call returns).
	const (
		held = iota
		slow
		broken
	)
	cases := []struct {
		name      string
		limit     string
		fault     int
		deadlines bool // the client applies context deadlines
		lease     bool
		budget    time.Duration
		caller    time.Duration // the caller's own deadline, if any
	}{
		{"lease refill cut at the budget", "cut-refill", held, true, true, 100 * time.Millisecond, 0},
		{"exact call cut at the budget", "cut-budget", held, true, false, 100 * time.Millisecond, 0},
		{"exact call cut by its caller's deadline", "cut-caller", held, true, false, time.Second, 50 * time.Millisecond},
		// A refill whose caller's deadline comes first goes to the lane's
		// senders, whose call its own deadline cuts (see callLife).
		{"lease refill cut on the lane's senders", "cut-senders", held, true, true, 100 * time.Millisecond, 50 * time.Millisecond},
		{"exact call cut by the client's ReadTimeout", "cut-read", slow, true, false, 500 * time.Millisecond, 0},
		{"exact call on the lane's senders cut by the client's ReadTimeout", "cut-read-senders", slow, false, false, 500 * time.Millisecond, 0},
		{"exact call whose connection broke", "cut-broken", broken, true, false, 100 * time.Millisecond, 0},
		{"exact call on the lane's senders whose connection broke", "cut-broken-senders", broken, false, false, 100 * time.Millisecond, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			px := redistest.NewProxy(t, srv.Addr)
			o := &redis.Options{Addr: px.Addr, ContextTimeoutEnabled: tc.deadlines}
			switch tc.fault {
			case slow:
				o.ReadTimeout, o.MaxRetries = 5*time.Millisecond, -1
			case broken:
				o.MaxRetries = -1 // go-redis's own resend would find the reply under its key
			}
			c := redisClientOpts(t, o)
			// No refill within the test: the bucket's level is the ledger.
			l := policy.Limit{Name: tc.limit, Rate: 1, Period: time.Hour, Burst: 1000}
			reader := sdkmetric.NewManualReader()
			opts := []leaselimit.Option{leaselimit.WithTimeout(tc.budget), leaselimit.WithFailureMode(policy.FailClosed),
				leaselimit.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))}
			if !tc.lease {
				opts = append(opts, leaselimit.WithoutLease())
			}
			lim := newBudgeted(t, c, l, opts...)
			ctx := context.Background()
			// A key's first sight is an exact call (in lease mode too); its
			// next miss refills a lease.
			if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
				t.Fatalf("first Allow = %+v, %v", d, err)
			}
			switch tc.fault {
			case held:
				px.HoldReplies(evalSha)
				// Redis runs the call; its reply stays held, on a
				// connection the client has given up, while Close waits
				// for the call.
				defer px.ReleaseReplies()
			case slow:
				px.SetLatency(10 * time.Millisecond)
			case broken:
				px.DropReplies(evalSha)
			}
			actx, cancel := ctx, context.CancelFunc(func() {})
			if tc.caller > 0 {
				actx, cancel = context.WithTimeout(ctx, tc.caller)
			}
			d, err := lim.AllowN(actx, "k", 7)
			cancel()
			px.SetLatency(0)
			px.DropReplies(nil)
			switch {
			case tc.caller > 0 && !errors.Is(err, context.DeadlineExceeded):
				t.Fatalf("AllowN cut by its caller's deadline = %+v, %v; want ctx's error", d, err)
			case tc.caller == 0 && (err != nil || d.Allowed || d.Source != leaselimit.SourceFallback):
				t.Fatalf("AllowN cut = %+v, %v; want a denial without Redis", d, err)
			}
			if err := lim.Close(); err != nil {
				t.Fatalf("Close = %v", err)
			}
			peek := newBudgeted(t, c, l, leaselimit.WithoutLease())
			if p, err := peek.Peek(ctx, "k"); err != nil || p.Remaining != l.Burst-1 {
				t.Errorf("Peek after Close = %d, %v; want %d (one token admitted, the cut call's grant back)", p.Remaining, err, l.Burst-1)
			}
			if n := counterTotal(t, reader, telemetry.MetricUnknown); n != 0 {
				t.Errorf("%s = %d; want 0, the outcome learnt", telemetry.MetricUnknown, n)
			}
		})
	}
}

// TestCutCallUnknownCounted: a call cut at the budget after it was sent
// whose outcome no resend can learn (nothing comes back from Redis, and
// Close has begun) is counted on ratelimit.authority.unknown with the
// tokens it asked for, and Close does not wait for it past one more
// attempt.
func TestCutCallUnknownCounted(t *testing.T) {
	srv := redistest.Start(t)
	px := redistest.NewProxy(t, srv.Addr)
	c := redisClientOpts(t, &redis.Options{Addr: px.Addr, ContextTimeoutEnabled: true})
	l := policy.Limit{Name: "cut-unknown", Rate: 1, Period: time.Hour, Burst: 1000}
	reader := sdkmetric.NewManualReader()
	lim := newBudgeted(t, c, l, leaselimit.WithoutLease(), leaselimit.WithTimeout(100*time.Millisecond),
		leaselimit.WithFailureMode(policy.FailClosed), leaselimit.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))))
	ctx := context.Background()
	if d, err := lim.AllowN(ctx, "k", 1); err != nil || !d.Allowed {
		t.Fatalf("first Allow = %+v, %v", d, err)
	}
	px.Blackhole(true)
	if d, err := lim.AllowN(ctx, "k", 7); err != nil || d.Allowed || d.Source != leaselimit.SourceFallback {
		t.Fatalf("AllowN cut at the budget = %+v, %v; want FailClosed's denial", d, err)
	}
	if err := lim.Close(); err != nil {
		t.Fatalf("Close = %v", err)
	}
	if n := counterTotal(t, reader, telemetry.MetricUnknown); n != 7 {
		t.Errorf("%s = %d; want 7, the tokens the cut call asked for", telemetry.MetricUnknown, n)
	}
}
