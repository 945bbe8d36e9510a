package httplimit

import (
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
