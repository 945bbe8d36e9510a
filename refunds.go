package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
)

// maxQueuedRefunds bounds the refunds waiting for Redis. Past it, refunds
// are dropped: their tokens stay debited until the bucket refills (which
// only under-admits), counted by ratelimit.lease.refunds.dropped.
const maxQueuedRefunds = 100_000

// refundQueue holds unused leased tokens on their way back to their
// buckets: added by any goroutine, sent in batches by the janitor (flush)
// and once more by Close (final). It owns its lock, its bound and its
// counters (ratelimit.lease.refunds and …refunds.dropped).
type refundQueue struct {
	auth   *authority.Redis
	brks   *breakers
	tel    *telemetry.Recorder
	budget time.Duration
	clock  localClock

	mu    sync.Mutex
	queue []authority.Refund
	max   int // maxQueuedRefunds; tests lower it
}

func newRefundQueue(auth *authority.Redis, brks *breakers, tel *telemetry.Recorder, budget time.Duration, clock localClock) *refundQueue {
	return &refundQueue{auth: auth, brks: brks, tel: tel, budget: budget, clock: clock, max: maxQueuedRefunds}
}

// add queues n unused tokens of the bucket of limit at rkey, or, for a
// negative n, a charge of -n tokens (a reservation settled above its
// estimate, see Reservation.Settle). window is authority.Refund.Window:
// for a calendar quota, the end of the window the tokens were taken in; a
// quota refund without it is not applied (lease tokens of a quota are not
// given back: their window may have reset).
func (q *refundQueue) add(rkey string, limit policy.Limit, n, window int64) {
	if n == 0 {
		return
	}
	q.put([]authority.Refund{{Key: rkey, Limit: limit, Tokens: n, Window: window}})
}

// addReturns queues tokens the lease protocol gave back, by limit and user
// key.
func (q *refundQueue) addReturns(rs ...lease.Return) {
	for _, r := range rs {
		q.addReturn(&r)
	}
}

// addReturn queues r, if any (an Answer's Evicted): to its limit's
// bucket, or to every bucket of a multi-limit's lease.
func (q *refundQueue) addReturn(r *lease.Return) {
	if r == nil || r.Tokens <= 0 {
		return
	}
	if r.Limits == nil {
		q.add(q.auth.Key(r.Limit, r.Key), r.Limit, r.Tokens, 0)
		return
	}
	for _, l := range r.Limits {
		q.add(q.auth.Key(l, r.Key), l, r.Tokens, 0)
	}
}

// put appends rs unless that would pass the bound, in which case they are
// dropped and counted.
func (q *refundQueue) put(rs []authority.Refund) {
	q.mu.Lock()
	if len(q.queue)+len(rs) > q.max {
		q.mu.Unlock()
		q.countDropped(rs)
		return
	}
	q.queue = append(q.queue, rs...)
	q.mu.Unlock()
}

func (q *refundQueue) take() []authority.Refund {
	q.mu.Lock()
	defer q.mu.Unlock()
	rs := q.queue
	q.queue = nil
	return rs
}

// flush sends the queued refunds in one pipeline per breaker (per master
// node on a Cluster; go-redis splits a pipeline by node anyway). Refunds
// whose node is unavailable (the breaker holds calls back) are kept for the
// next round; refunds whose pipeline failed once sent are dropped, never
// sent again, so none is applied twice (see authority.Redis.Refund).
func (q *refundQueue) flush() {
	rs := q.take()
	if len(rs) == 0 {
		return
	}
	groups := map[*breaker.Breaker][]authority.Refund{}
	for _, r := range rs {
		brk := q.brks.forKey(r.Key, q.budget)
		groups[brk] = append(groups[brk], r)
	}
	now := q.clock.wall()
	for brk, g := range groups {
		if brk.Rejects(now) {
			q.put(g) // keep them until Redis is back
			continue
		}
		done, err := brk.Allow()
		if err != nil {
			q.put(g)
			continue
		}
		span := q.tel.StartRefund(q.brks.laneFor(brk).ep, len(g))
		ctx, cancel := context.WithTimeout(context.Background(), q.budget)
		err = q.auth.Refund(ctx, g)
		cancel()
		q.tel.EndRefund(span, tokens(g), err)
		if err != nil && errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("%w: %w", breaker.ErrBudget, err)
		}
		done(err)
		if err != nil {
			// Sent, outcome unknown: a refund may have been applied
			// before the error. Sending it again could give its tokens
			// back twice (over-admission); dropping it can only leave
			// them debited until the bucket refills.
			q.countDropped(g)
			continue
		}
		q.tel.CountRefund(context.Background(), tokens(g))
	}
}

// final sends whatever is queued, once, for Close, whatever the breakers
// say: the Limiter gets no later chance.
func (q *refundQueue) final() error {
	rs := q.take()
	if len(rs) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), q.budget)
	defer cancel()
	span := q.tel.StartRefund(q.brks.oneLane.ep, len(rs))
	err := q.auth.Refund(ctx, rs)
	q.tel.EndRefund(span, tokens(rs), err)
	if err != nil {
		return fmt.Errorf("leaselimit: refund on close: %w", err)
	}
	q.tel.CountRefund(context.Background(), tokens(rs))
	return nil
}

// countDropped counts rs as dropped: the tokens of their refunds stay
// debited (which only under-admits); their charges are not made (which
// over-admits, so they are counted apart).
func (q *refundQueue) countDropped(rs []authority.Refund) {
	if n := tokens(rs); n > 0 {
		q.tel.CountDroppedRefund(context.Background(), n)
	}
	if n := charged(rs); n > 0 {
		q.tel.CountDroppedCharge(context.Background(), n)
	}
}

// tokens returns the tokens rs refund (charges left out).
func tokens(rs []authority.Refund) int64 {
	var n int64
	for _, r := range rs {
		n += max(r.Tokens, 0)
	}
	return n
}

// charged returns the tokens rs charge.
func charged(rs []authority.Refund) int64 {
	var n int64
	for _, r := range rs {
		n += max(-r.Tokens, 0)
	}
	return n
}
