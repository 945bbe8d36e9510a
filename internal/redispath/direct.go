package redispath

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/deadline"
	"github.com/leaselimit/leaselimit/internal/overload"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/telemetry"
)

// callerLeft is what the breaker is told of a call that its caller's ctx
// ended: nothing, an excluded outcome (see circuit.Excluded). Redis may
// have been about to answer: only a call that ran its whole budget tells
// that Redis did not. So a hung Redis trips the breaker by the calls of
// callers whose deadlines reach the budget; while every caller's deadline
// is shorter, each gets its ctx's error at its deadline and the failure
// policy decides nothing. Regression (a review): a call was counted a
// failure when Redis had answered no call for an eighth of the budget, and
// callers giving up at 18ms on a Redis that answered every call in 21-31ms
// opened the breaker, so that FailOpen admitted 12,734-23,986 requests
// against a bound of 100 while Redis answered.
var callerLeft = context.Canceled

// errBudgetCut is the cause of an in-place call's context ending at its
// own deadline (the budget's), which tells it from the caller's ctx ending.
var errBudgetCut = errors.New("redispath: the time budget ended")

// callerEnded reports whether a call made in place on cctx (a context with
// the budget as its deadline, made from ctx) failed with err because the
// caller's ctx ended, not the budget. cctx must not have been released
// (or cancelled) yet. A deadline that has passed counts before its
// timer has run (see deadline.Ended): the socket's deadline, the same
// instant, can cut the read first.
func callerEnded(ctx context.Context, cctx budgeted, err error) bool {
	if err == nil || deadline.Ended(ctx) == nil {
		return false
	}
	if ctx.Err() != nil {
		return !cctx.budgetEnded()
	}
	// ctx's deadline has passed, its timer not yet run: it cut the call
	// if it came no later than the budget's end (cctx's deadline is the
	// earlier of the two).
	d, _ := ctx.Deadline()
	cd, _ := cctx.Deadline()
	return !cd.Before(d)
}

// inPlaceLimit is the deadline of a call made in place at start (see
// direct): the hard cap if a probe found the process behind within the
// last budget, else the budget.
func inPlaceLimit(start time.Time, budget time.Duration) time.Duration {
	if overload.Recent(start, budget) {
		return (1 + saturationGrace) * budget
	}
	return budget
}

// direct makes the call in place, on the caller's goroutine, alone on the
// pipeline of ln that claim took, bounded by a deadline that the client
// applies to its reads and the lane's watchdog to its context (see
// budgetCtx). A deadline cannot be moved once a read has started, so it is
// chosen up front, limit after start or the caller's deadline if earlier
// (see inPlaceLimit; while it is the hard cap, the process's decisions
// yield as the call runs); a call it cuts is sent again by a recoverer to
// learn its outcome (see recoverCut). A timeout is probed before it is
// blamed on Redis: one while the process is behind does not count against
// the breaker, and the caller gets ErrSaturated. A call its caller's ctx
// ended is not Redis's failure: the caller gets ctx's error. A caller's
// cancellation does not cut a call under way (go-redis does not look for
// it during a read, and a wait for a connection ends at the deadline): a
// call that then runs its whole budget is Redis's failure, as any. done is
// the breaker's, from admit.
func (k *Caller) direct(ctx context.Context, call Call, ln *lane, done func(error), start time.Time, limit time.Duration) (authority.Grant, error) {
	defer k.p.gate.leave()
	one := &aloneSend{c: call}
	c := &one.c
	budget := k.p.budget
	replies := c.Brk.RepliesSeen()
	if limit > budget {
		overload.Hold()
		defer overload.Release()
	}
	base := ctx
	if c.Keep {
		// A grant kept whoever waits is not abandoned when the caller's
		// ctx ends (this variant cannot stop waiting without stopping
		// the call).
		base = context.WithoutCancel(ctx)
	}
	bctx := &one.budget
	bctx.start(base, start.Add(limit))
	defer bctx.release()
	var span callSpan
	cctx, sp := k.tel.StartAuthority(bctx, c.Acq.Want, c.Acq.Min, ln.ep)
	span.span = sp
	// The witness is asked early, so that its verdict on a call without
	// a reply is known when the budget ends (see witness.answers).
	early := ln.sendAlone(cctx, bctx, one, start.Add(limit-witnessWait(budget)))
	// Whether Redis may have run a call without a reply is read off its
	// own error, before a verdict below replaces it (see recoverCut).
	unknown := outcomeUnknown(c.Acq.Err)
	if clientCut(c.Acq.Err) { // rare: the node's pool is not looked up on every call
		c.Acq.Err = k.p.nodes.witnessOf(c.Brk, c.Acq.Key).refused(c.Acq.Err)
	}
	if !c.Keep && callerEnded(ctx, bctx, c.Acq.Err) {
		// The caller's ctx ended the call (its deadline came before the
		// budget's end, or it was cancelled): not Redis's doing, so
		// neither the breaker nor the path counts it, and the caller
		// gets its ctx's error, not the failure policy's decision. A
		// grant Redis may have made goes back to the bucket once a
		// recoverer has learnt of it.
		err := deadline.Ended(ctx)
		k.tel.RecordAuthority(ctx, time.Since(start), 0, err, false)
		span.finish(k.tel, 0, err, recorder.ContextReason(err))
		done(callerLeft)
		if unknown {
			k.p.recoverCut([]cutCall{{k, *c}}, start)
		}
		return authority.Grant{}, err
	}
	noted(c.Brk, c.Acq.Err)
	elapsed := time.Since(start)
	g, err := k.end(cctx, c, &span, start, elapsed, c.Acq.Grant, c.Acq.Err)
	if err != nil && errors.Is(err, circuit.ErrBudget) && k.p.behind(c.Brk, k.p.nodes.witnessOf(c.Brk, c.Acq.Key), early, start, limit, replies) {
		// Whoever waits (a lease refill runs on after its caller left:
		// c.Keep), a timeout is Redis's only if this process was not
		// behind (see behind).
		err = fmt.Errorf("%w: %v", ErrSaturated, time.Since(start).Round(time.Millisecond))
	}
	switch {
	case errors.Is(err, ErrSaturated): // behind, or no connection of the pool while Redis answered
		k.sawSaturation(ctx, telemetry.SaturatedAbandoned)
		k.recv.Saturated()
	case err == nil && elapsed > budget:
		// Answered within its deadline, yet delivered late: this
		// process kept the caller from running (as sawLate).
		k.sawSaturation(ctx, telemetry.SaturatedAnswered)
	}
	if err != nil && unknown {
		// Cut at the budget (or the hard cap): a grant Redis may have
		// made goes where a late reply's would.
		k.p.recoverCut([]cutCall{{k, *c}}, start)
	}
	done(err)
	return g, err
}
