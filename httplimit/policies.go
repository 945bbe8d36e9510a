package httplimit

import (
	"sync/atomic"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/cowmap"
	"github.com/leaselimit/leaselimit/internal/fields"
	"github.com/leaselimit/leaselimit/policy"
)

// policyCache holds the fields.Policy of the limits WithLimitFunc chose. A
// limit seen before costs no lock and no allocation. Invalid limits are not
// kept (their requests fail).
type policyCache struct {
	m cowmap.Map[policy.Limit, *fields.Policy]
}

func (c *policyCache) get(l policy.Limit) *fields.Policy {
	if pf, ok := c.m.Load(l); ok {
		return pf
	}
	if l.Validate() != nil {
		return newPolicy(l)
	}
	return c.m.LoadOrMake(l, func() *fields.Policy { return newPolicy(l) })
}

// newPolicy formats l's fields.
func newPolicy(l policy.Limit) *fields.Policy { return fields.NewPolicy(l) }

// maxCachedLimiters bounds limiterCache: Client.Limiter returns the same
// Limiter for the same limits, so a service's set stays small; Limiters
// made afresh per request (Limiter.With per request) would otherwise grow
// it without end.
const maxCachedLimiters = 1024

// limiterCache holds the fields of the Limiters WithLimiterFunc chose. A
// *leaselimit.Limiter seen before costs no lock and no allocation; other
// Limiter types, which need not be comparable, and Limiters past
// maxCachedLimiters are described per request.
type limiterCache struct {
	m cowmap.Map[*leaselimit.Limiter, described]
	n atomic.Int32 // entries in m
}

// described is a Limiter's fields (see describe).
type described struct {
	policy *fields.Policy
	group  []*fields.Policy
}

func (c *limiterCache) get(l Limiter) (*fields.Policy, []*fields.Policy) {
	ll, ok := l.(*leaselimit.Limiter)
	if !ok {
		return describe(l)
	}
	if d, ok := c.m.Load(ll); ok {
		return d.policy, d.group
	}
	if c.n.Load() >= maxCachedLimiters {
		return describe(ll)
	}
	d := c.m.LoadOrMake(ll, func() described {
		c.n.Add(1)
		pf, group := describe(ll)
		return described{pf, group}
	})
	return d.policy, d.group
}
