package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// maxQueuedRefunds bounds the adjustments waiting for Redis. Past it, new
// ones are dropped: the tokens of a refund stay debited until the bucket
// refills (which only under-admits), counted by
// ratelimit.lease.refunds.dropped; a charge is not made, counted by
// ratelimit.settle.charges.dropped.
const maxQueuedRefunds = 100_000

// refundQueue holds adjustments of the ledger on their way to their
// buckets: unused leased tokens, settlements, grants that arrived for no
// one. Any goroutine adds to it; the janitor sends it in batches (flush),
// and Close once more (final). It owns its lock, its bound and its counters
// (ratelimit.lease.refunds and …refunds.dropped).
//
// An adjustment is applied once, by its own id or its call's (see
// authority.Refund.Once), so one whose outcome is unknown can be sent
// again; what the queue must know is whether a failed send may have
// reached Redis (see reachedRedis):
// one that did not is kept until Redis answers; a refund that may have is
// sent again under its id or its call's for as long as Redis remembers it
// (authority.ResendWithin from its first such send), then dropped and
// counted; a charge is sent again until Redis answers (see expired).
type refundQueue struct {
	auth  *authority.Redis
	path  *redispath.Path
	tel   *recorder.Recorder
	clock localClock

	// retries: the client may send a command again on its own (see
	// redispath.Path.Retries), so its errors cannot show that a call never
	// reached Redis.
	retries bool

	mu     sync.Mutex
	queue  []queued
	spare  []queued // the storage of a queue flush sent, for the next (see recycle)
	max    int      // maxQueuedRefunds; tests lower it
	closed bool     // final ran: nothing more will be sent
}

// queued is one adjustment waiting in the queue.
type queued struct {
	authority.Refund
	// reached is when a send of it that may have reached Redis first
	// failed (the local clock's now); 0 if none did.
	reached int64
}

func newRefundQueue(auth *authority.Redis, path *redispath.Path, tel *recorder.Recorder, clock localClock) *refundQueue {
	return &refundQueue{auth: auth, path: path, tel: tel, clock: clock, retries: path.Retries(), max: maxQueuedRefunds}
}

// add queues one new adjustment (see authority.Refund): n unused tokens of
// the bucket of limit at rkey, or, for a negative n, a charge of -n.
func (q *refundQueue) add(rf authority.Refund) {
	if rf.Tokens == 0 {
		return
	}
	q.put(queued{Refund: rf})
}

// addReturns queues tokens the lease protocol gave back, by limit and user
// key: a sweep's (see lease.Table.Sweep, which hands it its returns), a
// drain's, a refill's that arrived for no one.
func (q *refundQueue) addReturns(rs []lease.Return) {
	for _, r := range rs {
		q.addReturn(&r)
	}
}

// addReturn queues r, if any (an Answer's Evicted).
func (q *refundQueue) addReturn(r *lease.Return) {
	if r == nil || r.Tokens <= 0 {
		return
	}
	var on [2]authority.Refund // most returns are one or two refunds: no allocation
	for _, rf := range q.appendReturned(on[:0], *r) {
		q.add(rf)
	}
}

// returned is the adjustments that give r back, without ids: to its
// limit's bucket, or to every bucket of a multi-limit's lease, a quota's
// within the window its tokens came from (r.Windows).
func (q *refundQueue) returned(r lease.Return) []authority.Refund {
	return q.appendReturned(nil, r)
}

// appendReturned appends to rs the adjustments that give r back (see
// returned), and returns rs.
func (q *refundQueue) appendReturned(rs []authority.Refund, r lease.Return) []authority.Refund {
	parts, n := r.Stamped()
	for _, p := range parts[:n] {
		if p.Limits == nil {
			rs = append(rs, authority.Refund{Key: q.auth.Key(p.Limit, p.Key), Limit: p.Limit, Tokens: p.Tokens, Since: p.Since, Window: p.Window})
			continue
		}
		for i, l := range p.Limits {
			rf := authority.Refund{Key: q.auth.Key(l, p.Key), Limit: l, Tokens: p.Tokens, Since: p.Since}
			if i < len(p.Windows) {
				rf.Window = p.Windows[i] // a quota's; 0 (none) for a token bucket
			}
			rs = append(rs, rf)
		}
	}
	return rs
}

// failed takes back an adjustment whose send failed with err (its ID or
// Call set, see authority.Refund.Once): kept if err says it never reached
// Redis, or if it may have but can still be sent again under that id (see
// refundQueue); else dropped and counted.
// reached is when an earlier send that may have reached Redis failed (0:
// none).
func (q *refundQueue) failed(rf authority.Refund, err error, reached int64) {
	now := q.clock.now()
	switch {
	case errors.Is(err, authority.ErrScript), errors.Is(err, authority.ErrReply), errors.Is(err, authority.ErrRejected):
		// Our own bug, or a bucket the script cannot adjust (a value
		// another program wrote): sending it again cannot help.
		q.countDropped(rf)
		return
	case q.reachedRedis(err) && reached == 0:
		reached = max(now, 1) // 0 says none did
	}
	q.put(queued{Refund: rf, reached: reached})
}

// expired reports whether a is a refund that may have reached Redis so
// long ago (see refundQueue) that Redis may have forgotten its id: it must
// never be sent again, as a refund applied twice creates tokens. A charge
// never expires so: applied twice it under-admits, but never made it
// over-admits (a Cluster slot left in migration refused it for minutes,
// and the fleet took 19 tokens of a burst of 10).
func (a queued) expired(now int64) bool {
	return a.Tokens > 0 && a.reached != 0 && time.Duration(now-a.reached) >= authority.ResendWithin
}

// sendable drops and counts the adjustments of qs that must not be sent
// again (see queued.expired) and returns the rest.
func (q *refundQueue) sendable(qs []queued) []queued {
	now := q.clock.now()
	out := qs[:0]
	for _, a := range qs {
		if a.expired(now) {
			q.countDropped(a.Refund)
			continue
		}
		out = append(out, a)
	}
	return out
}

// reachedRedis reports whether a call that failed with err may have
// reached Redis: false when the breaker or Close held it back, or when
// go-redis says no byte was written (the dial failed, no connection was
// free in time, the client is closed) and the client does not retry on its
// own (see redispath.Path.Retries: a retried call reports its last attempt
// only, and an earlier one may have been applied before its connection
// broke).
func (q *refundQueue) reachedRedis(err error) bool {
	var op *net.OpError
	switch {
	case errors.Is(err, breaker.ErrOpen), errors.Is(err, ErrClosed), errors.Is(err, authority.ErrNotSent):
		return false
	case q.retries:
		return true
	case errors.As(err, &op) && op.Op == "dial":
		return false
	case errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, redis.ErrPoolExhausted), errors.Is(err, redis.ErrClosed):
		return false
	}
	return true
}

// put appends one adjustment unless that would pass the bound, in which
// case it is dropped and counted.
func (q *refundQueue) put(a queued) {
	q.mu.Lock()
	if len(q.queue) >= q.max || q.closed {
		// Past the bound, or after Close's final send (a call that ended
		// after it): dropped, and counted.
		q.mu.Unlock()
		q.countDropped(a.Refund)
		return
	}
	q.queue = append(q.queue, a)
	q.mu.Unlock()
}

// take empties the queue and returns what it held; the queue goes on in
// the storage of the last flush (see recycle).
func (q *refundQueue) take() []queued {
	q.mu.Lock()
	defer q.mu.Unlock()
	qs := q.queue
	q.queue, q.spare = q.spare, nil
	return qs
}

// maxSpareRefunds bounds the storage a flush keeps for the next queue: a
// queue grew from nothing on every janitor tick, copying its adjustments
// each time it doubled (on the cold long tail, a fifth of leases' heap
// allocation), but one flush after an outage must not pin a large one.
const maxSpareRefunds = 4096

// recycle keeps qs's storage, which a flush sent and no longer reads, for
// the queue after the next take.
func (q *refundQueue) recycle(qs []queued) {
	if cap(qs) > maxSpareRefunds {
		return
	}
	clear(qs[:cap(qs)])
	q.mu.Lock()
	if q.spare == nil {
		q.spare = qs[:0]
	}
	q.mu.Unlock()
}

// flush sends the queued adjustments in one pipeline per breaker (per
// master node on a Cluster; go-redis splits a pipeline by node anyway).
// Those whose node is unavailable (the breaker holds calls back) wait for
// the next round unsent; those that fail go back through failed.
func (q *refundQueue) flush() {
	taken := q.take()
	defer q.recycle(taken)
	qs := q.sendable(taken)
	if len(qs) == 0 {
		return
	}
	for brk, g := range q.byBreaker(qs) {
		failed, sent := q.path.Refund(brk, refundsOf(g), tokens(g))
		if !sent {
			q.putAll(g) // kept until Redis is back
			continue
		}
		q.refail(g, failed)
		if n := tokens(g) - tokensOf(failed); n > 0 {
			q.tel.CountRefund(context.Background(), n)
		}
	}
}

// byBreaker splits qs by the breaker of each adjustment's node: qs itself
// when they share one (a single node, or a Cluster's flush that found one
// node's adjustments only).
func (q *refundQueue) byBreaker(qs []queued) map[*circuit.Breaker][]queued {
	first := q.path.Route(qs[0].Key)
	for i := 1; i < len(qs); i++ {
		if brk := q.path.Route(qs[i].Key); brk != first {
			groups := map[*circuit.Breaker][]queued{first: qs[:i:i]}
			for _, a := range qs[i:] {
				brk := q.path.Route(a.Key)
				groups[brk] = append(groups[brk], a)
			}
			return groups
		}
	}
	return map[*circuit.Breaker][]queued{first: qs}
}

// refail hands the adjustments of a sent group g that failed back to
// failed, each with the time an earlier send of it may have reached Redis.
func (q *refundQueue) refail(g []queued, failed []authority.Failed) {
	if len(failed) == 0 {
		return
	}
	reached := make(map[string]int64, len(g))
	for _, a := range g {
		if id := a.Once(); id != "" {
			reached[id] = a.reached
		}
	}
	for _, f := range failed {
		q.failed(f.Refund, f.Err, reached[f.Once()])
	}
}

// countSent counts the tokens of a refund sent at once, not through the
// queue (a Settle's surplus, a lease given back to serve a larger
// request), as flush counts those it sends.
func (q *refundQueue) countSent(rf authority.Refund) {
	if rf.Tokens > 0 {
		q.tel.CountRefund(context.Background(), rf.Tokens)
	}
}

// putAll puts back adjustments that were not sent.
func (q *refundQueue) putAll(g []queued) {
	for _, a := range g {
		q.put(a)
	}
}

// final sends whatever is queued, once, for Close, whatever the breakers
// say: the Client gets no later chance. What fails is dropped and counted.
func (q *refundQueue) final() error {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	qs := q.sendable(q.take())
	if len(qs) == 0 {
		return nil
	}
	failed := q.path.RefundFinal(refundsOf(qs), tokens(qs))
	for _, f := range failed {
		q.countDropped(f.Refund)
	}
	if n := tokens(qs) - tokensOf(failed); n > 0 {
		q.tel.CountRefund(context.Background(), n)
	}
	if len(failed) > 0 {
		// Say what was lost: a charge dropped here was admitted uncounted.
		return fmt.Errorf("leaselimit: close: %d adjustments not sent, dropped (refunds under-admit, charges were admitted uncounted): %w", len(failed), failed[0].Err)
	}
	return nil
}

// countDropped counts rf as dropped: the tokens of a refund stay debited
// (which only under-admits); a charge is not made (which over-admits, so
// it is counted apart).
func (q *refundQueue) countDropped(rf authority.Refund) {
	if rf.Tokens > 0 {
		q.tel.CountDroppedRefund(context.Background(), rf.Tokens)
	}
	if rf.Tokens < 0 {
		q.tel.CountDroppedCharge(context.Background(), -rf.Tokens)
	}
}

// refundsOf returns the adjustments of qs.
func refundsOf(qs []queued) []authority.Refund {
	rs := make([]authority.Refund, len(qs))
	for i, a := range qs {
		rs[i] = a.Refund
	}
	return rs
}

// tokens returns the tokens qs refund (charges left out).
func tokens(qs []queued) int64 {
	var n int64
	for _, a := range qs {
		n += max(a.Tokens, 0)
	}
	return n
}

// tokensOf returns the tokens failed adjustments would have refunded.
func tokensOf(failed []authority.Failed) int64 {
	var n int64
	for _, f := range failed {
		n += max(f.Tokens, 0)
	}
	return n
}

// adjustment is the ledger entry of n tokens of key's bucket under limit
// at rkey, with the stamps of where they came from, under a new id.
func (q *refundQueue) adjustment(rkey string, limit policy.Limit, n, window, since int64) authority.Refund {
	return authority.Refund{Key: rkey, Limit: limit, Tokens: n, Window: window, Since: since, ID: q.auth.NewID()}
}
