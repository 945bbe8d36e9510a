package leaselimit

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"golang.org/x/sync/singleflight"
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
		k[0] = canonical(first)
		for i, l := range more {
			k[1+i] = canonical(l)
		}
		if l, ok := e.groups.Load(k); ok {
			return l
		}
	}
	limits := append([]policy.Limit{first}, more...)
	for i := range limits {
		limits[i] = canonical(limits[i])
	}
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
		engine:  e,
		limit:   first.limit, // names the first bucket; the lease protocol uses the envelope
		namer:   e.auth.Namer(first.limit),
		tel:     e.meters.WithLimit(name),
		log:     newLogger(e.cfg.logger, name),
		leases:  lease.NewGroup(e.table, envelope(name, limits), limits, e.cfg.lease, e.cfg.fleetSize),
		group:   parts,
		sf:      new(singleflight.Group),
		enforce: e.cfg.enforce,
	}
	l.calls = e.path.Caller(l.tel, &receiver{leases: l.leases, refunds: e.refunds, clock: e.clock, log: l.log})
	return l
}

// envelope is the limit that sizes a multi-limit's leases: no looser than
// any of limits (the least burst, the slowest refill per token), so that a
// lease is bounded by every limit.
func envelope(name string, limits []policy.Limit) policy.Limit {
	env := policy.Limit{Name: name, Rate: limits[0].Rate, Period: limits[0].Period, Burst: limits[0].Burst}
	for _, l := range limits[1:] {
		env.Burst = min(env.Burst, l.Burst)
		// l refills more slowly per token when Period/Rate is larger.
		if float64(l.Period)/float64(l.Rate) > float64(env.Period)/float64(env.Rate) {
			env.Rate, env.Period = l.Rate, l.Period
		}
	}
	return env
}

// members returns the buckets besides the first that a multi-limit's call
// for key takes from (nil for one limit).
func (l *Limiter) members(key string) []authority.Member {
	if l.group == nil {
		return nil
	}
	with := make([]authority.Member, len(l.group)-1)
	for i, p := range l.group[1:] {
		with[i] = authority.Member{Key: p.namer.Key(key), Limit: p.limit}
	}
	return with
}

// addParts fills a multi-limit's lease decision d with every limit's state:
// each bucket as of the key's last grant (m) plus the tokens this instance
// holds in the lease, which are taken from every one. Limit becomes the
// one that denied (as the authority said) or, admitted, the one with the
// fewest tokens left.
func (l *Limiter) addParts(d *Decision, m *authority.Multi) {
	if m == nil || len(m.Parts) != len(l.group) {
		return
	}
	ps := m.Parts
	least := ps[0].Remaining
	for _, p := range ps[1:] {
		least = min(least, p.Remaining)
	}
	held := max(d.Remaining-least, 0)
	d.Parts = make([]Part, len(ps))
	d.ResetAfter = 0
	tight := 0
	for i, p := range ps {
		lim := l.group[i].limit
		rem := min(p.Remaining+held, lim.Burst)
		d.Parts[i] = Part{Limit: lim, Remaining: rem, ResetAfter: resetAfter(lim, rem)}
		if rem < d.Parts[tight].Remaining {
			tight = i
		}
		d.ResetAfter = max(d.ResetAfter, d.Parts[i].ResetAfter)
	}
	if !d.Allowed && m.Denied >= 0 && m.Denied < len(ps) {
		tight = m.Denied
	}
	d.Limit = d.Parts[tight].Limit
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

// groupDecision turns a multi-limit grant into the caller's Decision: the
// Limit that denied (the one that makes the request wait longest), or, when
// admitted, the one with the fewest tokens left; every limit in Parts.
func (l *Limiter) groupDecision(g authority.Grant) Decision {
	m := g.Multi
	d := Decision{Allowed: g.Granted > 0, Remaining: g.Remaining, RetryAfter: g.RetryAfter,
		ResetAfter: g.ResetAfter, Source: SourceAuthority, Parts: make([]Part, len(l.group)), since: g.At}
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
	// The multi-limit's own lease, taken from every bucket: the lesser of
	// what it held before and after the buckets were read (see Peek).
	held := l.leases.Holding(key, l.clock.now())
	pds := make([]Decision, len(l.group))
	for i, p := range l.group {
		pd, err := p.Peek(ctx, key)
		if err != nil {
			return Decision{Source: SourceNone}, err
		}
		pds[i] = pd
	}
	held = min(held, l.leases.Holding(key, l.clock.now()))
	for i, pd := range pds {
		if held > 0 {
			pd.Remaining = min(pd.Remaining+held, pd.Limit.Burst)
			pd.RetryAfter, pd.Allowed = 0, true
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
