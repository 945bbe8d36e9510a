package leaselimit

import (
	"context"
	"testing"

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
	for range 50 { // a key earns its lease as it repeats
		d, err := l.Allow(ctx, "hot")
		if err != nil {
			t.Fatal(err)
		}
		if leased = d.Source == SourceLease; leased {
			break
		}
	}
	if !leased {
		t.Fatal("no lease decision in 50 requests of one key")
	}
	brk, _ := l.route(l.namer, "hot")
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
