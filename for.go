package leaselimit

import "github.com/leaselimit/leaselimit/policy"

// For returns a Limiter that enforces limit on the same engine as l: the
// same Redis client, breakers, key table, janitor, refund queue, telemetry
// and options. Use it for plans and tiers, where the limit depends on who
// asks:
//
//	d, err := lim.For(plans[user.Plan]).Allow(ctx, user.ID)
//
// Every method works on the Limiter it returns. Each limit has its own
// buckets in Redis (the key names carry the limit's name and parameters)
// and its own local state per key (leases, negative cache, slow start,
// FailLocal buckets); WithMaxKeys bounds the keys of all limits together.
// For of a limit seen before is one atomic load and one map lookup: no
// lock, no allocation, so it is meant to be called per request. Limits are
// kept for the engine's life: For is for a set of plans and overrides, not
// a limit computed afresh for each request.
//
// Close on the Limiter from New closes every Limiter that For made from
// it; Close on a Limiter from For does nothing (and says so). For on a
// Limiter from Enforcing gives Limiters with the same enforced share. After Close,
// For still returns a Limiter, whose calls return ErrClosed. An invalid
// limit gives a Limiter whose calls all return the validation error.
//
// A key moved to another limit (a plan upgrade) is decided by that limit's
// bucket from its next request on: a bucket of its own, full the first
// time it is used. The tokens this instance leased under the old limit are
// never spent under the new one; the janitor gives them back to the old
// bucket when the lease expires (within the lease TTL).
func (l *Limiter) For(limit policy.Limit, more ...policy.Limit) *Limiter {
	var f *Limiter
	switch {
	case len(more) > 0:
		f = l.groupOf(limit, more)
	case limit == l.limit && l.invalid == nil && l.group == nil:
		return l
	default:
		f = l.limiter(limit)
	}
	if f.enforce != l.enforce && f.invalid == nil {
		// l came from Enforcing: so do the Limiters it gives (a copy per
		// call: keep the one you need rather than calling For per request).
		return f.Enforcing(l.enforce)
	}
	return f
}
