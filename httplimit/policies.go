package httplimit

import (
	"strconv"

	"github.com/leaselimit/leaselimit/internal/cowmap"
	"github.com/leaselimit/leaselimit/policy"
)

// policyFields is what a limit puts in the header fields, formatted once.
type policyFields struct {
	limit  policy.Limit
	policy string // the RateLimit-Policy member: `"name";q=<burst>;w=<window>`
	prefix string // the RateLimit member up to its remaining count: `"name";r=`
}

func newPolicyFields(l policy.Limit) *policyFields {
	quoted := string(appendSFString(nil, l.Name))
	return &policyFields{
		limit: l,
		policy: quoted + ";q=" + strconv.FormatInt(max(l.Burst, 0), 10) +
			";w=" + strconv.FormatInt(max(ceilSeconds(l.Period), 1), 10),
		prefix: quoted + ";r=",
	}
}

// policyCache holds the policyFields of the limits WithLimitFunc chose. A
// limit seen before costs no lock and no allocation. Invalid limits are not
// kept (their requests fail).
type policyCache struct {
	m cowmap.Map[policy.Limit, *policyFields]
}

func (c *policyCache) get(l policy.Limit) *policyFields {
	if pf, ok := c.m.Load(l); ok {
		return pf
	}
	if l.Validate() != nil {
		return newPolicyFields(l)
	}
	return c.m.LoadOrMake(l, func() *policyFields { return newPolicyFields(l) })
}
