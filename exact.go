package leaselimit

import (
	"context"

	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/telemetry"
)

// allowExact decides by asking Redis for exactly n tokens (exact mode), of
// every limit's bucket.
func (l *Limiter) allowExact(ctx context.Context, key string, n int64) (Decision, error) {
	brk, rkey := l.route(l.names, key)
	if brk.Rejects(l.clock.wall) {
		return l.breakerOpen(ctx, brk, key, n)
	}
	if rkey == "" {
		rkey = l.names.Key(key)
	}
	return l.callExact(ctx, brk, rkey, key, n)
}

// callExact asks Redis for exactly n tokens of key outside any lease; a
// grant that arrives after the caller left is refunded.
func (l *Limiter) callExact(ctx context.Context, brk *circuit.Breaker, rkey, key string, n int64) (Decision, error) {
	if sp, ok := recording(ctx); ok {
		// Before the call: a failing call may trip the breaker.
		sp.SetAttributes(telemetry.AttrCoalesced.Bool(false), telemetry.AttrBreaker.String(brk.State().String()))
	}
	r := l.authorize(ctx, call{brk: brk, rkey: rkey, want: n, min: n, share: 1, with: l.with(key)})
	if r.err != nil {
		return l.onError(ctx, brk, key, n, r.err)
	}
	return l.grantDecision(l.debts.charged(l.members, key, n, r.grant)), nil
}
