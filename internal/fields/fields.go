// Package fields formats the RateLimit and RateLimit-Policy field values of
// draft-ietf-httpapi-ratelimit-headers-10 for a limit and a decision: the
// HTTP middleware sends them as header fields, the gRPC interceptors as
// response metadata.
package fields

import (
	"strconv"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
)

// MaxInt is the largest Integer a Structured Field may carry (RFC 9651,
// Section 3.3.1: at most 15 digits).
const MaxInt = 999_999_999_999_999

// Policy is what a limit puts in the header fields, formatted once.
type Policy struct {
	Limit  policy.Limit
	Member string // the RateLimit-Policy member (see policyMember)
	prefix string // the RateLimit member up to its remaining count: `"name";r=`
}

// NewPolicy formats l's fields.
func NewPolicy(l policy.Limit) *Policy {
	return &Policy{Limit: l, Member: policyMember(l), prefix: string(AppendString(nil, l.Name)) + ";r="}
}

// RateLimit returns the RateLimit member of p's limit: `"name";r=<remaining>;t=<t>`.
func (p *Policy) RateLimit(remaining, t int64) string {
	var buf [96]byte
	b := append(buf[:0], p.prefix...)
	b = strconv.AppendInt(b, remaining, 10)
	b = append(b, ";t="...)
	b = strconv.AppendInt(b, min(t, MaxInt), 10)
	return string(b)
}

// UntilMore is the time until the bucket of an allowed decision holds one
// more token: the time until it is full minus the time the tokens after the
// next one take to arrive.
func UntilMore(l policy.Limit, d leaselimit.Decision) time.Duration {
	if l.IsQuota() {
		// A calendar quota gets its tokens back at the end of its window.
		if d.Remaining >= l.Burst {
			return 0
		}
		return d.ResetAfter
	}
	if d.Remaining >= l.Burst || d.ResetAfter <= 0 || l.Rate <= 0 {
		return 0
	}
	next := d.ResetAfter - l.Interval(l.Burst-d.Remaining-1)
	if next <= 0 || next > d.ResetAfter {
		// The decision's numbers do not come from this limit's bucket (a
		// FailLocal share, a fake): one token's interval is the worst case.
		next = min(d.ResetAfter, l.Interval(1))
	}
	return next
}

// Of returns the RateLimit member values of a decision d of l: the tokens
// remaining (clamped to what a Structured Field holds) and t, the seconds
// until more quota when d is allowed, or until the request can be admitted
// (at least 1) when it is denied.
func Of(l policy.Limit, d leaselimit.Decision) (remaining, t int64) {
	remaining = min(max(d.Remaining, 0), MaxInt)
	if d.Allowed {
		return remaining, CeilSeconds(UntilMore(l, d))
	}
	return remaining, max(CeilSeconds(d.RetryAfter), 1)
}

// Count is how many RateLimit members decision d has under the limits of
// ps (one Policy for one limit; one per limit of a multi-limit, in For's
// order): one per limit when d carries their Parts, else one.
func Count(ps []*Policy, d leaselimit.Decision) int {
	if len(ps) > 1 && len(d.Parts) == len(ps) {
		return len(ps)
	}
	return 1
}

// Member returns the i-th RateLimit member of d under ps (i < Count). For
// a multi-limit, the limit that denied says when the request can be
// admitted, every other one when it has more quota; without Parts, the one
// member is the first policy's, its numbers d's own (Limit the limit that
// decided).
func Member(ps []*Policy, i int, d leaselimit.Decision) string {
	if Count(ps, d) == 1 {
		p, tight := ps[0], ps[0].Limit
		if len(ps) > 1 {
			// The member is named after the limit that decided (under
			// FailLocal, its share): named after the first, an outage's
			// daily share read as the burst limit's numbers.
			p, tight = named(ps, d.Limit), d.Limit
		}
		r, t := Of(tight, d)
		return p.RateLimit(r, t)
	}
	p := d.Parts[i]
	part := leaselimit.Decision{Allowed: d.Allowed || p.Limit != d.Limit, Remaining: p.Remaining,
		ResetAfter: p.ResetAfter, RetryAfter: d.RetryAfter}
	r, t := Of(p.Limit, part)
	return ps[i].RateLimit(r, t)
}

// named returns the policy of ps whose limit has l's name, or the first.
func named(ps []*Policy, l policy.Limit) *Policy {
	for _, p := range ps {
		if p.Limit.Name == l.Name {
			return p
		}
	}
	return ps[0]
}

// ResetAfter is how long until tight's bucket is full, as decision d
// says: its part's ResetAfter when d has parts (d.ResetAfter is the
// longest of them all, another limit's for a multi-limit), else d's own.
func ResetAfter(tight policy.Limit, d leaselimit.Decision) time.Duration {
	for _, p := range d.Parts {
		if p.Limit == tight {
			return p.ResetAfter
		}
	}
	return d.ResetAfter
}

// AppendString appends s as a Structured Field String (RFC 9651, Section
// 3.3.3): quoted, with '\' and '"' escaped. Bytes outside printable ASCII,
// which an sf-string cannot hold, become '?' (policy.Limit.Validate admits
// none in a limit's name).
func AppendString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\\' || c == '"':
			b = append(b, '\\', c)
		case c < 0x20 || c > 0x7e:
			b = append(b, '?')
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// CeilSeconds returns d in whole seconds, rounded up; 0 for d <= 0.
func CeilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	s := int64(d / time.Second)
	if d%time.Second != 0 {
		s++
	}
	return s
}

// Narrowest returns the limit of ps with the smallest Burst: the one a cost
// above every request's reach exceeds first.
func Narrowest(ps []*Policy) policy.Limit {
	l := ps[0].Limit
	for _, p := range ps[1:] {
		if p.Limit.Burst < l.Burst {
			l = p.Limit
		}
	}
	return l
}

// CannotAdmit says why a request of cost n is refused for good, after its
// subject ("The request "): n is above the Burst of limit l, so no wait
// would let it through.
func CannotAdmit(n int64, l policy.Limit) string {
	return "costs " + strconv.FormatInt(n, 10) + " tokens; policy \"" + l.Name +
		"\" admits at most " + strconv.FormatInt(l.Burst, 10) + " at once, so it can never be admitted"
}
