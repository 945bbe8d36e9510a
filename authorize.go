package leaselimit

import (
	"context"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
)

// errSaturated marks a call abandoned at the hard cap while the process was
// still behind (see redispath.ErrSaturated): not a Redis failure.
var errSaturated = redispath.ErrSaturated

// call is one acquire call to make: take between min and want tokens of the
// bucket at rkey, at most max(min, share × its tokens).
type call struct {
	brk       *circuit.Breaker
	rkey      string
	want, min int64
	share     float64
	// refill, if set, is the lease refill the call performs: its grant is
	// installed in the lease as soon as it arrives, whether or not anyone
	// still waits. Without it (an exact call) a grant that arrives after
	// the caller stopped waiting is refunded.
	refill *refillCall
	// with, if set, are more buckets the same tokens are taken from, all or
	// none, in the same script call (several limits; see Client.Limiter).
	with []authority.Member
}

// refillCall is a lease refill on its way: the plan it asks Redis for, and
// the outcome its waiting callers collect, written when its grant arrives
// (see receiver.Arrived).
type refillCall struct {
	key     string // the user's key, for debts (see debtBook.charged)
	plan    lease.Refill
	outcome lease.Outcome
}

// reply is a call's result.
type reply struct {
	grant authority.Grant
	err   error
}

// authorize makes c through the engine's path to Redis (see redispath),
// bounded by the time budget whatever the client's own timeouts.
func (l *Limiter) authorize(ctx context.Context, c call) reply {
	rc := redispath.Call{Brk: c.brk, Acq: authority.Acquisition{Key: c.rkey, Limit: l.limit, Want: c.want, Min: c.min, Share: c.share, With: c.with}}
	if c.refill != nil {
		rc.Keep, rc.Tag = true, c.refill
	}
	g, err := l.calls.Acquire(ctx, &rc)
	if err != nil {
		return reply{err: err}
	}
	if l.quota {
		l.server.observe(g.At, l.clock.wall())
	}
	return reply{grant: g}
}

// receiver is what a Limiter does with the answers its path delivers
// (see redispath.Receiver).
type receiver struct {
	leases  *lease.Leases
	members []*member // the Limiter's limits, for debts (see debtBook.charged)
	debts   *debtBook
	refunds *refundQueue
	clock   localClock
	log     *logger
}

// Arrived installs a refill's grant in the lease, and queues what the
// lease gives back.
func (r *receiver) Arrived(c redispath.Call, g authority.Grant) {
	rc := c.Tag.(*refillCall)
	g = r.debts.charged(r.members, rc.key, c.Acq.Min, g)
	var back []lease.Return
	rc.outcome, back = r.leases.Complete(rc.plan, g, r.clock.now())
	r.refunds.addReturns(back)
}

// Unclaimed gives the tokens of an exact grant whose caller left back to
// every bucket it took them from.
func (r *receiver) Unclaimed(c redispath.Call, g authority.Grant) { r.refunds.refund(c.Acq, g) }

// Saturated logs a call abandoned while this process was behind.
func (r *receiver) Saturated() { r.log.saturated() }

// refund queues the tokens of grant g of acquisition a, which no one will
// use, back to every bucket it took them from, stamped with the grant (see
// authority.Refund): a calendar quota's window ends ResetAfter after it.
func (q *refundQueue) refund(a authority.Acquisition, g authority.Grant) {
	if g.Granted <= 0 {
		return
	}
	q.add(authority.Refund{Key: a.Key, Limit: a.Limit, Tokens: g.Granted, Since: g.At, Window: windowOfGrant(a.Limit, g.At, partReset(g, 0))})
	for i, m := range a.With {
		q.add(authority.Refund{Key: m.Key, Limit: m.Limit, Tokens: g.Granted, Since: g.At, Window: windowOfGrant(m.Limit, g.At, partReset(g, i+1))})
	}
}

// partReset is the ResetAfter of bucket i of g (Key's first, then With's):
// for a multi-limit grant its part's (g.ResetAfter is the longest of them),
// else g's; 0 when g says nothing of it (no window can be named).
func partReset(g authority.Grant, i int) time.Duration {
	switch {
	case g.Multi == nil && i == 0:
		return g.ResetAfter
	case g.Multi != nil && i < len(g.Multi.Parts):
		return g.Multi.Parts[i].ResetAfter
	}
	return 0
}

// windowOfGrant is authority.Refund.Window for tokens of limit granted at
// the server's time at (0: unknown) whose bucket is full again reset
// later: for a calendar quota, the end of its window (the boundary is when
// it is full again); 0 for a token bucket or an unknown time.
func windowOfGrant(limit policy.Limit, at int64, reset time.Duration) int64 {
	if !limit.IsQuota() || at == 0 {
		return 0
	}
	return at + reset.Microseconds()
}
