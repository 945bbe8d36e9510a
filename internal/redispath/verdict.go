package redispath

import (
	"errors"
	"net"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/overload"
	"github.com/redis/go-redis/v9"
)

// How a call's outcome reaches its node's breaker, and how a call without
// a reply is judged: Redis failing (blame), no connection at all
// (unreachable), or this process's own queue (congested, queued).

// noted tells brk of a call's outcome err as soon as it arrives, on the
// goroutine that received it (before end): a network error, which says
// Redis cannot be reached (see unreachable); a reply, which the waiters of
// other calls count to tell a slow Redis from a process that is behind
// (see congested and queued). A call that got no connection
// (ErrSaturated, see witness.refused) brought no reply.
func noted(brk *circuit.Breaker, err error) {
	if isNetworkError(err) {
		brk.NoteNetworkError(time.Now())
	}
	if !circuit.Counts(err) && !errors.Is(err, ErrSaturated) {
		brk.CountReply()
	}
}

// blame counts a failure on brk for a waiter that gave up on Redis at the
// budget: one for each such waiter, as for calls made alone, so that a
// hung Redis trips the breaker one budget after it stopped answering,
// however the calls were batched. In a half-open breaker that lets no
// more requests through, the probe's own outcome decides instead.
func blame(brk *circuit.Breaker) {
	if done, err := brk.Allow(); err == nil {
		done(circuit.ErrBudget)
	}
}

// admit lets a call through brk and registers it with the gate; the caller
// must call done with the call's outcome and then gate.leave.
func (p *Path) admit(brk *circuit.Breaker) (done func(error), err error) {
	done, err = brk.Allow()
	if err != nil {
		return nil, err
	}
	if !p.gate.enter() {
		done(nil)
		return nil, p.closed
	}
	return done, nil
}

// unreachable reports whether a call given up at the budget failed to
// connect rather than to get an answer: go-redis retries a refused
// connection (5 dials, backoff, 3 retries: over a second) far past any
// budget, so the waiter's own timeout would hide it. Either the client's
// pool holds no connection at all and its dials fail (see dials: a silent
// Redis's connections are made, then dropped when their reads time out),
// or a call on brk came back with a network error since.
//
// Only a single node's (or Sentinel's) pool is read: a ClusterClient's
// PoolStats loads the slot map first, in this goroutine and without a
// deadline, which on an unreachable Cluster blocks for seconds.
func (p *Path) unreachable(brk *circuit.Breaker, since time.Time) bool {
	if c, ok := p.client.(*redis.Client); ok {
		if st := c.PoolStats(); st != nil && st.TotalConns == 0 && p.dials.failing(st) {
			return true
		}
	}
	return brk.NetworkErrorSince(since)
}

// isNetworkError reports whether err is a network failure that is not a
// timeout: a refused or reset connection.
func isNetworkError(err error) bool {
	if err == nil {
		return false // before ne, which escapes: no allocation on success
	}
	var ne net.Error
	return errors.As(err, &ne) && !ne.Timeout()
}

// behind reports whether a call begun at start, when brk had counted
// replies, whose deadline limit passed without a reply, ran out while
// Redis was not failing: this process was behind (it woke a threshold or
// more past that deadline: the scheduler kept it from reading; a probe
// finds the process behind now; or replies were queued for it, see
// congested), or Redis answers a connection of leaselimit's own, w, the
// witness of the call's node (see witness and nodes.witnessOf): a pool the
// application's own commands hold, a reply held up on its way; early is
// the ask of w the call joined early, if it did (see witness.answers).
// Such a call
// does not count against the breaker and is denied, not decided by the
// failure policy; the others are blamed on Redis. Every call the budget
// cuts is judged by it: an acquire call, and a peek, a reset or an
// adjustment (Do), and a refund pipeline.
func (p *Path) behind(brk *circuit.Breaker, w *witness, early *flight, start time.Time, limit time.Duration, replies int64) bool {
	threshold := overload.Threshold(p.budget)
	if time.Since(start)-limit >= threshold {
		overload.MarkBehind(time.Now())
		return true
	}
	return overload.Measure(p.gate.spawn, threshold) || p.congested(brk, replies) || w.answers(early)
}

// congested reports whether a call begun when brk had counted replies
// waits in the client's own queue for a connection: Redis has answered a
// whole pool's worth of other calls since, so each connection came back
// within the budget, and the queue is this process's (more concurrent calls
// than connections, or too little CPU to turn them round).
func (p *Path) congested(brk *circuit.Breaker, replies int64) bool {
	return brk.RepliesSeen()-replies >= int64(p.pool)
}

// queued reports whether a call begun when brk had counted replies has
// not left this process yet (see pending.sent) while Redis has answered
// other calls since: it waits in its lane behind batches that Redis is
// turning round, which is this process's queue, not Redis failing. On a
// hung Redis nothing is answered, and the call is blamed at the budget as
// before.
func queued(brk *circuit.Breaker, replies int64, sent *atomic.Int64) bool {
	return sent.Load() == 0 && brk.RepliesSeen() > replies
}

// vouchedProbe returns how to tell brk the outcome of a call that done
// (from brk.Allow) counts, a peek, a reset, an adjustment or a refund
// pipeline: done itself, unless the call is a probe of a breaker that is
// not closed; then a tell that counts once, and that counts success first
// if the call has no reply at the budget while Redis answers the witness
// of rkey within its ask's life, and a failure (circuit.ErrBudget) if the
// witness is not answered either (as Path.judgeProbe does for an acquire
// call): the breaker opens again, and the next call probes anew. stop,
// called once the call's own outcome is known, ends that wait. Such a
// probe on a pooled connection whose bytes were lost (a blackhole) would
// otherwise hold the breaker half-open until go-redis's ReadTimeout (5 s
// by default) on a client that does not bound its reads by the deadline,
// and every decision meanwhile went to the failure policy while Redis
// answered: when Redis answered the witness (TestProbeOnATornConnection),
// and when Redis came back only after the witness's ask had ended
// unanswered (TestProbeBeforeRedisCameBack).
func (p *Path) vouchedProbe(brk *circuit.Breaker, rkey string, done func(error)) (tell func(error), stop func()) {
	if brk.State() == breaker.Closed {
		return done, func() {}
	}
	w := p.nodes.witnessOf(brk, rkey)
	var told atomic.Bool
	tell = func(err error) {
		if errors.Is(err, ErrSaturated) && w.answered() {
			// Cut while Redis answers the witness: that answers the
			// probe's question (ErrSaturated alone, not counted, left
			// the breaker half-open for the next call to probe).
			err = nil
		}
		if told.CompareAndSwap(false, true) {
			done(err)
		}
	}
	t := time.AfterFunc(p.budget, func() { p.tellWhenAnswered(w, nil, tell, circuit.ErrBudget) })
	return tell, func() { t.Stop() }
}

// tellWhenAnswered tells a probe's outcome by the witness w, on a
// goroutine Close waits for: success if Redis answers ask (else a new
// one) before that ask ends, up to its life; else unanswered, if not nil
// (at once if no goroutine can start).
func (p *Path) tellWhenAnswered(w *witness, ask *flight, tell func(error), unanswered error) {
	started := p.gate.spawn(func() {
		switch {
		case w.answersInLife(ask):
			tell(nil)
		case unanswered != nil:
			tell(unanswered)
		}
	})
	if !started && unanswered != nil {
		tell(unanswered)
	}
}
