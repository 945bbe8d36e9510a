package leaselimit

import (
	"context"
	"fmt"
	"testing"

	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
)

// TestFallbackServedByLease: a request that reaches the failure policy
// while its key's lease can serve it (a refill landed meanwhile) is a
// lease decision, and ratelimit.fallbacks does not count it; one the
// policy decides is counted. Regression: the fallback was counted (and
// its span given a reason) before the lease was tried, so
// ratelimit.fallbacks ran ahead of the decisions with SourceFallback.
func TestFallbackServedByLease(t *testing.T) {
	_, c := newMini(t, nil)
	l, reader := meteredLimiter(t, c, policy.PerSecond(1000).WithName("served"))
	ctx := context.Background()
	leased := false
	for range 50 { // a key earns its lease as it repeats, and it grows
		d, err := l.Allow(ctx, "hot")
		if err != nil {
			t.Fatal(err)
		}
		if leased = d.Source == SourceLease && l.leases.Outstanding("hot", l.clock.now()) > 0; leased {
			break
		}
	}
	if !leased {
		t.Fatal("no lease decision leaving tokens in the lease in 50 requests of one key")
	}
	brk, _ := l.route(l.names, "hot")
	if d := l.fallback(ctx, brk, "hot", 1, telemetry.ReasonBreakerOpen); d.Source != SourceLease || !d.Allowed {
		t.Fatalf("fallback with a lease in hand = %+v; want allowed by the lease", d)
	}
	if n := counterSum(t, reader, telemetry.MetricFallbacks); n != 0 {
		t.Errorf("%s = %d after a decision the lease made; want 0", telemetry.MetricFallbacks, n)
	}
	if d := l.fallback(ctx, brk, "cold", 1, telemetry.ReasonBreakerOpen); d.Source != SourceFallback {
		t.Fatalf("fallback of a key with no lease = %+v; want the policy's", d)
	}
	if n := counterSum(t, reader, telemetry.MetricFallbacks); n != 1 {
		t.Errorf("%s = %d after one decision of the policy; want 1", telemetry.MetricFallbacks, n)
	}
}

// TestSaturatedCallIsShed: a call abandoned at the hard cap while this
// process, not Redis, was behind is denied whatever the failure policy,
// and owes the bucket nothing. Regression (a review): it went to the
// failure policy, so FailOpen admitted past the fleet's bound while Redis
// answered every call (3,017 of a bucket of 3,000 on a flooded host).
func TestSaturatedCallIsShed(t *testing.T) {
	for _, mode := range []policy.FailureMode{policy.FailOpen, policy.FailClosed, policy.FailLocal} {
		t.Run(mode.String(), func(t *testing.T) {
			_, c := newMini(t, nil)
			opts := []Option{WithFailureMode(mode)}
			if mode == policy.FailLocal {
				opts = append(opts, WithFleetSize(2))
			}
			l, reader := meteredLimiter(t, c, policy.PerSecond(1000).WithName("shed"), opts...)
			ctx := context.Background()
			brk, _ := l.route(l.names, "k")
			late := fmt.Errorf("%w: 512ms", errSaturated)
			for i := range 3 {
				d, err := l.onError(ctx, brk, "k", 1, late)
				if err != nil {
					t.Fatalf("onError(saturated) = %v; want a decision", err)
				}
				if d.Allowed || d.Source != SourceFallback || d.RetryAfter <= 0 {
					t.Fatalf("call %d abandoned while the process was behind = %+v; want a fallback denial with a RetryAfter", i, d)
				}
			}
			if n := counterSum(t, reader, telemetry.MetricFallbacks); n != 3 {
				t.Errorf("%s = %d; want the 3 shed decisions", telemetry.MetricFallbacks, n)
			}
			l.debts.mu.Lock()
			owed := len(l.debts.owed)
			l.debts.mu.Unlock()
			if owed != 0 {
				t.Errorf("%d buckets owe tokens after shed decisions; want none", owed)
			}
			// The failure policy still decides for an outage.
			d, err := l.onError(ctx, brk, "k", 1, circuit.ErrBudget)
			if err != nil {
				t.Fatal(err)
			}
			if want := mode != policy.FailClosed; d.Allowed != want || d.Source != SourceFallback {
				t.Errorf("a call Redis did not answer within the budget, %v = %+v; want Allowed %v", mode, d, want)
			}
		})
	}
}
