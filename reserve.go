package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
)

// Reservation is tokens taken before the cost of the work they pay for is
// known (an LLM response's tokens, a query's computed cost). Settle it once
// the cost is known: the surplus goes back, or the excess is charged, into
// debt if need be.
type Reservation struct {
	lim      *Limiter
	key      string
	estimate int64
	decision Decision
	stamp    stamp       // where its tokens came from
	settled  atomic.Bool // Settle or Cancel ran (or there was nothing to settle)
}

// stamp is where a reservation's tokens came from, for the ledger (see
// authority.Refund): the server's clock at or before their grant (the
// bucket's generation: tokens that may predate a Reset are dropped, their
// charge too) and, for a calendar quota, the end of their window. A
// lease's window can move on while Reserve runs, so a stamp keeps both
// ends of that doubt: a surplus goes back to the earliest window the
// tokens can be of (refund), an excess is charged to the latest (charge).
// Unknown is 0; an unknown window is named by server, Redis's clock at
// taken as this instance estimates it (see serverClock).
type stamp struct {
	taken          time.Time // this process's clock when the tokens were taken
	server         time.Time // Redis's at taken, as estimated
	refund, charge origin
	// refundParts and chargeParts, for several limits, are each one's
	// window ends (their windows differ), as refund and charge bound them;
	// nil for one limit, whose window is refund's and charge's.
	refundParts, chargeParts []int64
}

// origin is the server's clock at (or bounding) a grant, and the end of
// its calendar window.
type origin struct{ since, window int64 }

// of returns the origin for an adjustment of n tokens.
func (s stamp) of(n int64) origin {
	if n < 0 {
		return s.charge
	}
	return s.refund
}

// member returns the stamp of the i-th bucket of several limits: that
// limit's window from the parts, or 0 (unknown: windowFor works it out
// from the origin's clock) where they do not name it. The stamp's own
// window is not every limit's: for a joint lease it is the soonest of
// their windows, so an hourly quota's end would be given to a daily one.
func (s stamp) member(i int) stamp {
	m := stamp{taken: s.taken, server: s.server, refund: origin{since: s.refund.since}, charge: origin{since: s.charge.since}}
	if i < len(s.refundParts) {
		m.refund.window = s.refundParts[i]
	}
	if i < len(s.chargeParts) {
		m.charge.window = s.chargeParts[i]
	}
	return m
}

// windowFor is authority.Refund.Window for an adjustment of n stamped
// tokens of limit's bucket.
func (s stamp) windowFor(limit policy.Limit, n int64) int64 {
	if !limit.IsQuota() {
		return 0
	}
	if w := s.of(n).window; w != 0 {
		return w
	}
	return windowOf(limit, s.server)
}

// stampOf returns the stamp of the tokens of d, a decision to take n that
// Reserve made: exactly a grant's when Redis granted outside a lease, else
// what the lease said before (pre, if known) and after the take.
func (l *Limiter) stampOf(d Decision, key string, taken time.Time, pre lease.Stamp, known bool) stamp {
	st := stamp{taken: taken, server: l.server.at(taken)}
	if d.since != 0 {
		o := origin{since: d.since, window: windowOfGrant(l.limit, d.since, d.ResetAfter)}
		st.refund, st.charge = o, o
		if len(d.Parts) == len(l.members) { // several limits: one has no Parts
			st.refundParts = make([]int64, len(l.members))
			for i, m := range l.members {
				st.refundParts[i] = windowOfGrant(m.limit, d.since, d.Parts[i].ResetAfter)
			}
			st.chargeParts = st.refundParts
		}
		return st
	}
	// The generation: a surplus goes back to the oldest generation the
	// tokens may be of (the lease's Since before the take bounds them
	// from below: tokens that may predate a Reset are not the fresh
	// bucket's to take back), an excess is charged to the newest (the
	// lease's newest grant by the reading after the take: the fresh
	// bucket pays for what may be its tokens, and only an excess of
	// tokens all older than a Reset is forgiven). A lease made for this
	// request has no earlier reading. The window: a surplus goes back to
	// the earliest, an excess is charged to the latest.
	post, _ := l.leases.Stamps(key, l.clock.now())
	st.charge = origin{since: pre.Ceiling(post), window: post.Window}
	st.chargeParts = post.Windows
	if known {
		// A grant older than the lease's tokens (a late reply) may have
		// joined it meanwhile: a surplus is then of unknown generation,
		// treated as older (dropped after a Reset).
		st.refund = origin{since: pre.Floor(post), window: pre.Window}
		st.refundParts = pre.Windows
	}
	return st
}

// Reserve takes estimate tokens of key now, like AllowN(ctx, key, estimate),
// and returns them as a Reservation to settle when the real cost is known.
// A denied Reserve takes nothing (the Reservation's Decision says so, and
// settling it does nothing). Errors are AllowN's, but for an estimate above
// the Burst: that takes a whole Burst now (no request could ever take
// more), and Settle charges the rest, into debt of at most one Burst, as
// for any cost above what was taken.
//
// On a key this instance holds no live lease of (none yet, or one that
// expired, as a calendar quota's does at the boundary), Reserve decides
// exactly (one Redis call, as the refill would be), so that the
// reservation's tokens carry the time and window of their grant: what
// bounds where a surplus may go back (see docs/semantics.md, the ledger).
//
// A Reservation never settled stays settled at its estimate. One whose
// tokens the failure policy granted (Decision.Source is SourceFallback: no
// tokens were taken from the bucket) is charged its estimate once Redis
// answers again, like every admission of the policy; its Settle adds an
// excess to that charge, and gives no surplus back.
func (l *Limiter) Reserve(ctx context.Context, key string, estimate int64) (*Reservation, error) {
	if err := l.callable(ctx); err != nil {
		return nil, err
	}
	// Read before the tokens are taken: a quota's window read early can
	// only make a surplus be dropped (under-admission), read late it could
	// put an old window's tokens into a new one; and a lease's Since
	// only grows but for a late grant, which stampOf sees in a second
	// reading, so what it says now holds for the tokens taken next.
	if l.usable() != nil {
		// An invalid limit or a closed Client: the decision's error,
		// traced as Allow's is (the leases below are not to be read).
		_, err := l.allowCounted(ctx, key, estimate, false)
		return nil, err
	}
	taken := time.Now()
	pre, known := l.leases.Stamps(key, l.clock.now())
	estimate = min(estimate, l.maxCost) // the rest is charged at Settle
	// Without a stamped lease of key to read now, nothing would bound the
	// generation of tokens a lease made meanwhile hands out (a reading
	// after the take may be of a later grant), and a surplus of unknown
	// generation is dropped for as long as a Reset's mark lives: such a
	// reservation is decided exactly, its tokens stamped by their grant.
	d, err := l.allowCounted(ctx, key, estimate, !known)
	if err != nil {
		return nil, err
	}
	st := l.stampOf(d, key, taken, pre, known)
	r := &Reservation{lim: l, key: key, estimate: estimate, decision: d, stamp: st}
	if !d.Allowed || d.ShadowDenied {
		r.settled.Store(true) // nothing was taken from the bucket
	}
	return r, nil
}

// Decision returns the decision Reserve made.
// A nil Reservation's is that of an error (Source SourceNone).
func (r *Reservation) Decision() Decision {
	if r == nil {
		return Decision{Source: SourceNone}
	}
	return r.decision
}

// Settle charges the reservation its actual cost: estimate − actual tokens
// go back when actual is lower; actual − estimate more are taken when it is
// higher, even past empty. A bucket in debt denies every request until the
// debt is paid off by refill (RetryAfter counts it); it owes at most one
// Burst, and a charge beyond that is forgiven.
//
// Settle is idempotent and safe from any goroutine: the first Settle or
// Cancel applies, later ones do nothing and return nil. It works against
// this instance's lease where it can (the surplus joins the lease, the
// excess is taken from it), and against the bucket in Redis otherwise, with
// one call within the time budget; ctx's cancellation does not stop it (a
// response that ended because its client left still has to be paid for),
// and a caller whose ctx's deadline comes first stops waiting then while
// the call goes on, its outcome applied or queued as below.
// While Redis cannot be reached the adjustment is queued, with the
// refunds, and applied when it is back, once (it has its own id; see the
// ledger in docs/semantics.md): one that never reached Redis waits until Redis
// answers; a surplus whose outcome is unknown is sent again under its id for
// authority.ResendWithin, then dropped and counted on
// ratelimit.lease.refunds.dropped, and an excess until Redis answers (past
// the id's life it may be charged twice: under-admission, where dropping
// it would over-admit). Its tokens go back only to the generation (see Reset) and
// the calendar window they were taken from. After the Client's Close,
// Settle makes its one call on the caller's goroutine and returns its
// error.
//
// actual < 0 returns ErrInvalidCost and settles nothing, as does a nil or
// zero *Reservation (Reserve's with an error: nothing was reserved), with
// an error wrapping ErrClosed. A nil ctx settles as context.Background()
// would: a settlement deferred with its error ignored must not drop an
// excess (over-admission) for want of a ctx, which Settle only reads values
// from.
func (r *Reservation) Settle(ctx context.Context, actual int64) error {
	if r == nil || r.lim == nil {
		return fmt.Errorf("%w: a nil or zero *Reservation (nothing was reserved)", ErrClosed)
	}
	if ctx == nil {
		ctx = context.Background()
	}
	if actual < 0 {
		return fmt.Errorf("%w: actual cost %d, want >= 0", ErrInvalidCost, actual)
	}
	if !r.settled.CompareAndSwap(false, true) {
		return nil
	}
	if r.decision.Source == SourceFallback {
		return r.oweExcess(context.WithoutCancel(ctx), actual-r.estimate)
	}
	return r.lim.adjust(ctx, r.key, r.estimate-actual, r.stamp)
}

// oweExcess settles a reservation the failure policy granted: its estimate
// is owed already (see Limiter.fallback), and an excess is owed too, to be
// charged once Redis answers (not charged, the fleet would admit it past
// the bound). A surplus is not given back: the policy's admission is
// charged as it was made (under-admission). After Close, the charge is one
// call on the caller's goroutine.
func (r *Reservation) oweExcess(ctx context.Context, excess int64) error {
	l := r.lim
	if excess <= 0 {
		return nil
	}
	if !l.path.IsClosed() {
		l.owe(r.key, excess, r.stamp.taken)
		return nil
	}
	var first error
	for _, m := range l.members {
		rf := authority.Refund{Key: m.names.Key(r.key), Limit: m.limit, Tokens: -excess, Window: windowOf(m.limit, r.stamp.server)}
		if err := l.adjustAfterClose(ctx, rf); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// adjustAfterClose makes an adjustment once the Client is closed: one
// call on the caller's goroutine, bounded by the time budget (as far as
// the client honours context deadlines).
func (l *Limiter) adjustAfterClose(ctx context.Context, rf authority.Refund) error {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.timeout)
	defer cancel()
	if _, err := l.auth.Apply(ctx, &rf); err != nil {
		return fmt.Errorf("leaselimit: settle after Close: %w", err)
	}
	return nil
}

// sameWindow reports whether a and b fall in the same window of every
// calendar quota among ms (always, for token buckets).
func sameWindow(ms []*member, a, b time.Time) bool {
	for _, m := range ms {
		if windowOf(m.limit, a) != windowOf(m.limit, b) {
			return false
		}
	}
	return true
}

// windowOf is authority.Refund.Window for tokens of limit taken at taken:
// the end of a calendar quota's window then, 0 for a token bucket.
func windowOf(limit policy.Limit, taken time.Time) int64 {
	if !limit.IsQuota() {
		return 0
	}
	end, _ := limit.Calendar.Window(taken)
	return end.UnixMicro()
}

// settleLocally applies an adjustment of n tokens of the buckets of ms to
// key's live lease in ls when it can: the surplus joins it, an excess it
// holds comes out of it. (A joint lease holds tokens taken from every
// bucket at once; one limit has none, ls nil.)
func (l *Limiter) settleLocally(ls *lease.Leases, ms []*member, key string, n int64, st stamp) bool {
	if l.cfg.noLease || ls == nil {
		return false
	}
	now := l.clock.now()
	if n > 0 {
		if !sameWindow(ms, st.server, l.server.at(time.Now())) {
			return false // a calendar quota's tokens of an earlier window: gone
		}
		return ls.Give(key, n, st.refund.since, st.charge.since, st.windowFor(ms[0].limit, n), now)
	}
	return ls.Charge(key, -n, st.charge.since, now)
}

// Cancel gives the whole estimate back: Settle(ctx, 0).
func (r *Reservation) Cancel(ctx context.Context) error { return r.Settle(ctx, 0) }

// adjust gives n tokens back to key's bucket under every limit of l (n >
// 0) or takes -n more (n < 0): through the joint lease of several limits
// when it holds a live one that can, else limit by limit, through this
// instance's own lease of the limit when it can, else through Redis (see
// Settle). st says where the tokens came from.
func (l *Limiter) adjust(ctx context.Context, key string, n int64, st stamp) error {
	if n == 0 || l.settleLocally(l.joint, l.members, key, n, st) {
		return nil
	}
	if len(l.members) == 1 { // the stamp is this limit's own
		return l.adjustBucket(ctx, l.members, key, n, st)
	}
	var first error
	for i := range l.members {
		if err := l.adjustBucket(ctx, l.members[i:i+1], key, n, st.member(i)); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// unknownSurplusLife is how long after its Reserve a reservation whose
// tokens' grant time is unknown (a lease read about a take it could not
// bound, see lease.Stamp.Floor) may still give a surplus back: half a
// reset mark's life, on this process's monotonic clock, so that the mark of
// any Reset after the grant is still there when the refund lands.
const unknownSurplusLife = authority.MarkLife / 2

// adjustBucket is adjust for the one bucket of key under the limit of
// ms[0].
func (l *Limiter) adjustBucket(ctx context.Context, ms []*member, key string, n int64, st stamp) error {
	m := ms[0]
	if l.settleLocally(m.leases, ms, key, n, st) {
		return nil
	}
	if n > 0 && st.of(n).since == 0 && time.Since(st.taken) >= unknownSurplusLife {
		// A surplus of tokens whose grant time is unknown: the scripts
		// cannot tell it old (see authority.MarkLife), and this one may be
		// of a generation a Reset since ended, whose mark is gone or soon
		// will be. Dropped: under-admission.
		l.refunds.countDropped(authority.Refund{Tokens: n})
		return nil
	}
	brk, rkey := l.route(m.names, key)
	if rkey == "" {
		rkey = m.names.Key(key)
	}
	rf := l.refunds.adjustment(rkey, m.limit, n, st.windowFor(m.limit, n), st.of(n).since)
	if l.path.IsClosed() {
		return l.adjustAfterClose(context.WithoutCancel(ctx), rf)
	}
	_, err := l.send(ctx, brk, rf, true)
	return err
}

// send applies the adjustment rf in one call within the time budget. One
// that fails, whenever it does (the call goes on past the budget), goes to
// the refund queue, which knows whether it may have reached Redis and
// sends it again under its id or keeps it until Redis is back (see
// refundQueue); one the breaker holds back is queued unsent. The error is
// for the caller's mistakes and a closed Limiter: an outage is not one;
// applied reports whether Redis applied rf within the budget. If kept (a
// settlement), ctx does not stop the call: it bounds only how long the
// caller waits for it (see redispath.Path.DoKept).
func (l *Limiter) send(ctx context.Context, brk *circuit.Breaker, rf authority.Refund, kept bool) (applied bool, err error) {
	do := l.path.Do
	if kept {
		do = l.path.DoKept
	}
	sent, err := do(ctx, brk, rf.Key, func(ctx context.Context) error {
		c := rf
		_, err := l.auth.Apply(ctx, &c)
		switch {
		case err == nil:
			// Counted where it is applied: Do may have stopped waiting
			// at the budget before a worker's Apply succeeds.
			l.refunds.countSent(rf)
		case !errors.Is(err, authority.ErrScript):
			l.refunds.failed(rf, err, 0)
		}
		return err
	})
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, ErrClosed):
		// Close began after the check: no call was made.
		if kept {
			ctx = context.WithoutCancel(ctx)
		}
		return false, l.adjustAfterClose(ctx, rf)
	case !sent:
		l.refunds.add(rf) // the breaker held it back: applied when Redis is back
		return false, nil
	case errors.Is(err, ErrUnavailable), errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return false, nil // the call's own goroutine queues it if it fails
	}
	return false, err
}
