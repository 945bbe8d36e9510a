package leaselimit

import (
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"golang.org/x/sync/singleflight"
)

// MaxLimits is the most limits one Limiter enforces together (see
// Client.Limiter).
const MaxLimits = 4

// Part is one limit's state after a decision of a Limiter with several
// limits (see Client.Limiter): Decision.Parts holds one per limit, in the
// order they were given.
type Part struct {
	Limit      policy.Limit
	Remaining  int64
	ResetAfter time.Duration
}

// limitSet is the limits a Limiter enforces together, one to MaxLimits of
// them, and what they keep on the engine: every view of the same limits
// (see Limiter.With) shares it. One limit is a set of one: every verb runs
// one code path over members, and a request's tokens are taken from every
// member's bucket, or from none, in one script call.
type limitSet struct {
	*engine

	members []*member    // in the order given
	limit   policy.Limit // the first member's: a decision's Limit unless Parts say otherwise
	names   *keyNames    // the first member's: the Redis key of a call (the rest go With it)
	maxCost int64        // the least Burst of the members: the most one request may take
	quota   bool         // a member is a calendar quota: its replies' times feed the engine's serverClock
	// leases is the protocol that decides: the one member's own, or for
	// several limits a joint lease whose every token was taken from each
	// member's bucket at once. joint is that joint lease, nil for one
	// limit, whose lease is its member's: Peek, Reset and adjustments
	// reach a member's own lease and, apart from it, the joint one.
	leases *lease.Leases
	joint  *lease.Leases
	tel    *recorder.Recorder  // the set's ratelimit.limit.name (names joined with "+")
	log    *logger             // nil without WithLogger
	calls  *redispath.Caller   // budgeted authority calls
	sf     *singleflight.Group // one refill per key at a time (refill.go)
}

// member is one limit of an engine and its own state, shared by every set
// that has it: its Redis bucket names, and its own lease protocol (the
// lease, negative cache and FailLocal bucket of each key under this limit
// alone).
type member struct {
	limit  policy.Limit
	namer  authority.Namer // what debts are owed under (see debtKey)
	names  *keyNames       // namer's names, the last on each processor remembered
	leases *lease.Leases
	// joints are the joint leases of the sets this limit is in with
	// others, which a Reset of its bucket drops too (see Limiter.Reset);
	// copied on write, as sets are made (under the engine's sets lock).
	joints atomic.Pointer[[]*lease.Leases]
}

// addJoint records that joint, a set's joint lease, holds tokens of m's
// bucket.
func (m *member) addJoint(joint *lease.Leases) {
	var js []*lease.Leases
	if old := m.joints.Load(); old != nil {
		js = append(js, *old...)
	}
	js = append(js, joint)
	m.joints.Store(&js)
}

// forget drops key's local state under m's limit: its own lease and
// negative cache, and those of every joint lease with other limits.
func (m *member) forget(key string) {
	m.leases.Forget(key)
	if js := m.joints.Load(); js != nil {
		for _, j := range *js {
			j.Forget(key)
		}
	}
}

// setKey identifies the limits a Limiter enforces together, in order.
type setKey [MaxLimits]policy.Limit

// validLimits checks limits to be enforced together.
func validLimits(limits []policy.Limit) error {
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

// newSet returns the state of members' limits together on e: for one
// limit, its member's own lease decides; for several, a joint lease over
// them. Each member is the one its limit's own set has.
func (e *engine) newSet(members []*member) *limitSet {
	limits := make([]policy.Limit, len(members))
	names := make([]string, len(members))
	for i, m := range members {
		limits[i], names[i] = m.limit, m.limit.Name
	}
	name := strings.Join(names, "+")
	s := &limitSet{
		engine:  e,
		members: members,
		limit:   members[0].limit,
		names:   members[0].names,
		maxCost: members[0].limit.Burst,
		tel:     e.meters.WithLimit(name),
		log:     e.log.forLimit(name),
		sf:      new(singleflight.Group),
	}
	for _, m := range members {
		s.maxCost = min(s.maxCost, m.limit.Burst)
		s.quota = s.quota || m.limit.IsQuota()
	}
	if len(members) == 1 {
		s.leases = members[0].leases
	} else {
		s.joint = lease.NewGroup(e.table, name, limits, e.cfg.lease, e.cfg.fleetSize)
		s.leases = s.joint
		for _, m := range members {
			m.addJoint(s.joint)
		}
	}
	s.calls = e.path.Caller(s.tel, &receiver{leases: s.leases, members: s.members, debts: e.debts, refunds: e.refunds, clock: e.clock, log: s.log})
	e.log.manyLimits(e.made.Add(1))
	return s
}

// newMember returns limit's own state on e.
func (e *engine) newMember(limit policy.Limit) *member {
	namer := e.auth.Namer(limit)
	return &member{limit: limit, namer: namer, names: newKeyNames(namer), leases: lease.New(e.table, limit, e.cfg.lease, e.cfg.fleetSize)}
}

// invalidSet is the set of a Limiter whose limits cannot be enforced
// (err): it names them for Limit, Limits and the decision span, and has
// nothing else, since every call returns err first.
func (e *engine) invalidSet(limits []policy.Limit) *limitSet {
	s := &limitSet{engine: e, limit: limits[0]}
	names := make([]string, len(limits))
	for i, l := range limits {
		s.members = append(s.members, &member{limit: l})
		names[i] = l.Name
	}
	s.tel = e.meters.WithLimit(strings.Join(names, "+"))
	return s
}

// with returns the buckets besides the first that a call for key takes
// from, all or none (empty for one limit).
func (s *limitSet) with(key string) []authority.Member {
	with := make([]authority.Member, len(s.members)-1)
	for i, m := range s.members[1:] {
		with[i] = authority.Member{Key: m.names.Key(key), Limit: m.limit}
	}
	return with
}

// Limits returns the limits the Limiter enforces, in the order given to
// Client.Limiter: one, or several taken from together.
func (l *Limiter) Limits() []policy.Limit {
	if l == nil || l.limitSet == nil {
		return nil
	}
	out := make([]policy.Limit, len(l.members))
	for i, m := range l.members {
		out[i] = m.limit
	}
	return out
}

// addParts fills a lease decision d with every limit's state, when the
// lease knows it (a joint lease after its first grant; nil otherwise, and
// always for one limit, whose Decision has no Parts): each bucket as of the
// key's last grant (m) plus the tokens this instance holds in the lease,
// which are taken from every one. Limit becomes the one that denied (as
// the authority said) or, admitted, the one with the fewest tokens left.
func (s *limitSet) addParts(d *Decision, m *authority.Multi) {
	if m == nil || len(m.Parts) != len(s.members) {
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
		lim := s.members[i].limit
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

// grantDecision turns a grant of exactly the request into the caller's
// Decision. A grant of several buckets (g.Multi; nil for one limit) puts
// every limit in Parts, and names as the Limit the one that denied (the
// one that makes the request wait longest), or, when admitted, the one with
// the fewest tokens left.
func (s *limitSet) grantDecision(g authority.Grant) Decision {
	d := fromGrant(s.limit, g, SourceAuthority)
	m := g.Multi
	if m == nil || len(m.Parts) != len(s.members) {
		return d
	}
	d.Parts = make([]Part, len(s.members))
	tight := 0
	for i, p := range m.Parts {
		d.Parts[i] = Part{Limit: s.members[i].limit, Remaining: p.Remaining, ResetAfter: p.ResetAfter}
		if p.Remaining < m.Parts[tight].Remaining {
			tight = i
		}
	}
	d.Limit = s.members[tight].limit
	if !d.Allowed && m.Denied >= 0 && m.Denied < len(s.members) {
		d.Limit = s.members[m.Denied].limit
	}
	return d
}
