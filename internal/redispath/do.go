package redispath

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/deadline"
)

// Do makes one Redis call, op, through brk within the time budget: a peek,
// a reset, an adjustment. The error is the closed error, ctx's, or wraps
// the unavailable error (the breaker is open, a failure that counts
// against it, no reply in the budget); Redis replies that mean
// misconfiguration (NOPERM and the like) are returned as they are. sent
// reports whether op ran (false: it never will, so its effect can be
// queued for later without doubling it). rkey is the bucket op is about:
// its node's witness judges a call without a reply (see nodes.witnessOf).
//
// On a client that honours deadlines op runs on the caller's goroutine,
// bounded by the budget (by saturationGrace budgets more while this process
// is behind, as for an acquire call). On any other, op is carried by one of
// the path's few workers on a context detached from ctx, and the breaker is
// told op's real outcome whenever it comes.
func (p *Path) Do(ctx context.Context, brk *circuit.Breaker, rkey string, op func(context.Context) error) (sent bool, err error) {
	return p.do(ctx, brk, rkey, false, op)
}

// DoKept is Do for an op whose effect must land whoever waits for it (a
// Reservation's settlement): op runs on a context detached from ctx, and
// ctx bounds only how long its caller waits. In place it is waited for
// until its reply or its own deadline, whoever waits, so a caller whose
// ctx ends before that is not held there: a worker carries its op (as
// Caller.Acquire sends a lease refill to the lane's senders). Regression
// (a review): a Settle with a 50ms deadline was held for the whole
// budget, once per limit.
func (p *Path) DoKept(ctx context.Context, brk *circuit.Breaker, rkey string, op func(context.Context) error) (sent bool, err error) {
	return p.do(ctx, brk, rkey, true, op)
}

// do is Do, or DoKept if kept.
func (p *Path) do(ctx context.Context, brk *circuit.Breaker, rkey string, kept bool, op func(context.Context) error) (sent bool, err error) {
	if brk.Rejects(p.nodes.now) { // the breakers' clock (withClock)
		return false, p.heldBack(brk, breaker.ErrOpen)
	}
	done, err := brk.Allow()
	if err != nil {
		return false, p.heldBack(brk, err)
	}
	if p.bounded && brk.State() == breaker.Closed {
		// In place only while the breaker is closed: a probe its caller
		// cut short would say nothing (see callerLeft); a worker carries
		// it to its end (see Caller.Acquire).
		start := time.Now()
		limit := inPlaceLimit(start, p.budget)
		switch {
		case !kept:
			return p.doInPlace(ctx, brk, rkey, done, op, start, limit)
		case !endsBefore(ctx, start.Add(limit)):
			return p.doInPlace(context.WithoutCancel(ctx), brk, rkey, done, op, start, limit)
		}
	}
	if !p.gate.enter() {
		done(nil)
		return false, p.closed
	}
	ch := make(chan error, 1)
	start, replies := time.Now(), brk.RepliesSeen()
	limit := (1 + saturationGrace) * p.budget
	tell, stopVouch := p.vouchedProbe(brk, rkey, done)
	p.workers.run(func() {
		defer p.gate.leave()
		cctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), start.Add(limit))
		defer cancel()
		err := p.judged(brk, rkey, nil, start, limit, replies, op(cctx))
		stopVouch()
		tell(err)
		ch <- err
	})
	timer := newTimer(p.budget)
	defer releaseTimer(timer)
	select {
	case err = <-ch:
	case <-timer.C:
		return true, p.overdue(brk, start, p.budget)
	case <-ctx.Done():
		return true, ctx.Err()
	}
	return true, p.doError(err)
}

// doInPlace is Do on a client that honours deadlines, begun at start and
// bounded by limit (see inPlaceLimit). The breaker is told a timeout of
// the budget, not one of the caller's ctx (see callerLeft).
func (p *Path) doInPlace(ctx context.Context, brk *circuit.Breaker, rkey string, done func(error), op func(context.Context) error, start time.Time, limit time.Duration) (sent bool, err error) {
	if !p.gate.enter() {
		done(nil)
		return false, p.closed
	}
	defer p.gate.leave()
	replies := brk.RepliesSeen()
	cctx, cancel := context.WithTimeoutCause(ctx, limit, errBudgetCut)
	// The witness is asked early, so that its verdict on a call without
	// a reply is known when the budget ends (see witness.answers).
	var early atomic.Pointer[flight]
	ask := time.AfterFunc(limit-witnessWait(p.budget), func() { early.Store(p.nodes.witnessOf(brk, rkey).askEarly()) })
	err = op(cctx)
	ask.Stop()
	left := callerEnded(ctx, stdBudget{cctx}, err)
	cancel()
	if left {
		// The caller left: not Redis's doing, nor its success (see
		// callerLeft).
		done(callerLeft)
		return true, deadline.Ended(ctx)
	}
	err = p.judged(brk, rkey, early.Load(), start, limit, replies, err)
	done(err)
	if errors.Is(err, circuit.ErrBudget) {
		return true, p.overdue(brk, start, limit)
	}
	return true, p.doError(err)
}

// heldBack is the error of a call of Do that brk held back with err: it
// says when calls resume, since Peek and Reset carry no retry-after of
// their own, or that a probe is in flight (a half-open breaker lets one
// call through at a time).
func (p *Path) heldBack(brk *circuit.Breaker, err error) error {
	if u := brk.OpenUntil(); !u.IsZero() {
		if d := u.Sub(p.nodes.now()); d > 0 {
			return fmt.Errorf("%w: %w: Redis failed repeatedly; calls resume in %v", p.unavailable, err, d.Round(time.Millisecond))
		}
	}
	return fmt.Errorf("%w: %w: a probe of Redis is in flight; calls resume once it succeeds", p.unavailable, err)
}

// overdue is the error of a call of Do begun at start that limit ended
// without a reply: one that could not connect says so (see unreachable),
// as an acquire call's does. go-redis dials a refused connection again
// until the deadline, so without the look a Redis that was down read as
// one that did not answer.
func (p *Path) overdue(brk *circuit.Breaker, start time.Time, limit time.Duration) error {
	if p.unreachable(brk, start) {
		return fmt.Errorf("%w: %w: none within %v", p.unavailable, circuit.ErrUnreachable, limit)
	}
	return fmt.Errorf("%w: no reply within %v", p.unavailable, limit)
}

// judged is the outcome of a call of Do begun at start, when brk had
// counted replies, that ended with err at its deadline limit or before
// (early: the ask of its witness it made early, if any, see behind):
// err, with the reply counted (see noted); a deadline overrun marked
// circuit.ErrBudget when Redis is to blame, or ErrSaturated when this
// process was behind (see behind), which the breaker does not count, as
// for a call that got no connection while Redis answered (see
// witness.refused).
// Regression (a review): a Settle's adjustment cut at the budget while
// the process was behind counted against Redis without that check, and on
// a flooded host five in a row opened the breaker while Redis answered:
// FailOpen then admitted up to 2,800 on a bucket of 300.
func (p *Path) judged(brk *circuit.Breaker, rkey string, early *flight, start time.Time, limit time.Duration, replies int64, err error) error {
	var w *witness // the node's, looked up for a failed call only
	if err != nil {
		w = p.nodes.witnessOf(brk, rkey)
		err = w.refused(err)
	}
	noted(brk, err)
	switch {
	case err == nil || !errors.Is(err, context.DeadlineExceeded):
		return err
	case p.behind(brk, w, early, start, limit, replies):
		// Not on ratelimit.saturated, which counts decisions' calls.
		return fmt.Errorf("%w: %v", ErrSaturated, time.Since(start).Round(time.Millisecond))
	}
	return fmt.Errorf("%w: %w", circuit.ErrBudget, err)
}

// doError is what Do returns for op's error.
func (p *Path) doError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, authority.ErrScript), errors.Is(err, authority.ErrReply):
		return fmt.Errorf("leaselimit: %w", err)
	case errors.Is(err, ErrSaturated), circuit.NoAnswer(err):
		return fmt.Errorf("%w: %w", p.unavailable, err)
	}
	return fmt.Errorf("leaselimit: redis: %w", err)
}
