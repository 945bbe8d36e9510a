package leaselimit

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
)

// MaxLimits is the most limits one Limiter from For enforces together.
const MaxLimits = 4

// Part is one limit's state after a decision of a Limiter with several
// limits (see For): Decision.Parts holds one per limit, in For's order.
type Part struct {
	Limit      policy.Limit
	Remaining  int64
	ResetAfter time.Duration
}

// groupKey identifies a set of limits For enforces together, in order.
type groupKey [MaxLimits]policy.Limit

// groupOf returns the engine's Limiter for first and more together (2 to
// MaxLimits limits, all valid and different), making it on first use. A
// group seen before costs no lock and no allocation.
func (e *engine) groupOf(first policy.Limit, more []policy.Limit) *Limiter {
	var k groupKey
	if len(more) < MaxLimits {
		k[0] = first
		copy(k[1:], more)
		if l, ok := e.groups.Load(k); ok {
			return l
		}
	}
	limits := append([]policy.Limit{first}, more...)
	if err := validGroup(limits); err != nil {
		return &Limiter{engine: e, limit: limits[0], invalid: err, tel: e.meters}
	}
	return e.groups.LoadOrMake(k, func() *Limiter { return e.newGroup(limits) })
}

// validGroup checks the limits For is to enforce together.
func validGroup(limits []policy.Limit) error {
	if len(limits) > MaxLimits {
		return fmt.Errorf("%w: %d limits together; at most %d", policy.ErrInvalidLimit, len(limits), MaxLimits)
	}
	for i, l := range limits {
		if err := l.Validate(); err != nil {
			return err
		}
		for _, o := range limits[:i] {
			if o == l {
				return fmt.Errorf("%w: %v given twice", policy.ErrInvalidLimit, l)
			}
		}
	}
	return nil
}

// newGroup returns a Limiter that takes every request's tokens from each
// of limits' buckets, or from none, in one script call.
func (e *engine) newGroup(limits []policy.Limit) *Limiter {
	parts := make([]*Limiter, len(limits))
	names := make([]string, len(limits))
	for i, l := range limits {
		parts[i] = e.limiter(l)
		names[i] = l.Name
	}
	first := parts[0]
	name := strings.Join(names, "+")
	l := &Limiter{
		engine: e,
		limit:  first.limit,
		tel:    e.meters.WithLimit(name),
		log:    newLogger(e.cfg.logger, name),
		leases: first.leases, // unused: a multi-limit keeps no lease; FailLocal asks each part
		group:  parts,
	}
	l.calls = newAuthorizer(e.client, &calls{auth: e.auth, limit: first.limit, budget: e.cfg.timeout, pool: poolSize(e.client),
		brks: e.brks, leases: first.leases, refunds: e.refunds, gate: &e.gate, clock: e.clock, tel: l.tel, log: l.log})
	return l
}

// Limits returns the limits the Limiter enforces: one, or, for a Limiter
// from For with several, all of them in For's order.
func (l *Limiter) Limits() []policy.Limit {
	if l.group == nil {
		return []policy.Limit{l.limit}
	}
	out := make([]policy.Limit, len(l.group))
	for i, p := range l.group {
		out[i] = p.limit
	}
	return out
}

// allowGroup decides n tokens of key under every limit of the group: one
// script call that takes them from every bucket or from none. It decides
// in exact mode whatever the options (a multi-limit keeps no lease).
func (l *Limiter) allowGroup(ctx context.Context, key string, n int64) (Decision, error) {
	brk, rkey := l.route(key)
	if brk.Rejects(l.clock.wall()) {
		return l.fallback(ctx, brk, key, n, telemetry.ReasonBreakerOpen), nil
	}
	if rkey == "" {
		rkey = l.auth.Key(l.limit, key)
	}
	with := make([]authority.Member, len(l.group)-1)
	for i, p := range l.group[1:] {
		with[i] = authority.Member{Key: l.auth.Key(p.limit, key), Limit: p.limit}
	}
	r := l.calls.authorize(ctx, call{brk: brk, rkey: rkey, want: n, min: n, share: 1, with: with})
	if r.err != nil {
		return l.onError(ctx, brk, key, n, r.err)
	}
	return l.groupDecision(r.grant), nil
}

// groupDecision turns a multi-limit grant into the caller's Decision: the
// Limit that denied (the one that makes the request wait longest), or, when
// admitted, the one with the fewest tokens left; every limit in Parts.
func (l *Limiter) groupDecision(g authority.Grant) Decision {
	m := g.Multi
	d := Decision{Allowed: g.Granted > 0, Remaining: g.Remaining, RetryAfter: g.RetryAfter,
		ResetAfter: g.ResetAfter, Source: SourceAuthority, Parts: make([]Part, len(l.group))}
	tight := 0
	for i, p := range m.Parts {
		d.Parts[i] = Part{Limit: l.group[i].limit, Remaining: p.Remaining, ResetAfter: p.ResetAfter}
		if p.Remaining < m.Parts[tight].Remaining {
			tight = i
		}
	}
	d.Limit = l.group[tight].limit
	if !d.Allowed {
		d.Limit = l.group[m.Denied].limit
		d.RetryAfter = max(d.RetryAfter, time.Microsecond)
	}
	return d
}

// peekGroup is Peek for a multi-limit: each limit's bucket (one read per
// limit), Parts in For's order, and the most restrictive as the Decision:
// the one that makes a one-token request wait longest, or, when every one
// would admit it, the one with the fewest tokens.
func (l *Limiter) peekGroup(ctx context.Context, key string) (Decision, error) {
	var d Decision
	parts := make([]Part, len(l.group))
	for i, p := range l.group {
		pd, err := p.Peek(ctx, key)
		if err != nil {
			return Decision{Source: SourceNone}, err
		}
		parts[i] = Part{Limit: pd.Limit, Remaining: pd.Remaining, ResetAfter: pd.ResetAfter}
		worse := pd.RetryAfter > d.RetryAfter || (pd.RetryAfter == d.RetryAfter && pd.Remaining < d.Remaining)
		if i == 0 || worse {
			d = pd
		}
	}
	d.Parts = parts
	for _, p := range parts {
		d.ResetAfter = max(d.ResetAfter, p.ResetAfter)
	}
	return d, nil
}

// adjustGroup gives n tokens back to (or takes -n more from) every limit's
// bucket: Settle for a multi-limit.
func (l *Limiter) adjustGroup(ctx context.Context, key string, n int64) error {
	var first error
	for _, p := range l.group {
		if err := p.adjust(ctx, key, n); err != nil && first == nil {
			first = err
		}
	}
	return first
}
