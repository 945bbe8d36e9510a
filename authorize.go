package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/overload"
	"github.com/leaselimit/leaselimit/telemetry"
)

// saturationGrace is how many budgets more a call is waited for while this
// process, not Redis, is behind (a probe found it behind, or the client's own queue is congested): a call waits at most
// (1 + saturationGrace) × the budget in all, 500ms with the default budget.
const saturationGrace = 4

// errSaturated marks a call abandoned at the hard cap while the process was
// still behind. It is not a Redis failure: the breaker is credited with the
// call's real outcome when it completes.
var errSaturated = errors.New("no reply while this process was behind its scheduler")

type callResult struct {
	g   authority.Grant
	err error
}

// The states of one call made on the waiter's behalf (authorize).
const (
	callPending   int32 = iota
	callDelivered       // the result went to the waiter
	callGaveUp          // the waiter blamed Redis and told the breaker
	callLeft            // the waiter's ctx ended: the call tells the breaker its outcome
	callOutwaited       // the waiter left at the hard cap, the process still behind: the call tells the breaker its outcome
)

// authorize makes one acquire call through the breaker, bounded by the time
// budget whatever the client's own timeouts.
//
// A call that is not answered within the budget is Redis's failure only if
// the process was keeping up: a CPU-bound process leaves the goroutine that
// carries a reply waiting in the run queue, and that delay is its own, not
// Redis's. So the waiter probes the scheduler (overload.Probe) and checks
// whether the client's own queue is the hold-up (congested); if the process
// is behind, it asks the process's decisions to yield (overload.Hold) so
// the reply's goroutine runs, and keeps waiting, re-checking every quarter
// budget, up to saturationGrace budgets more. Such a call never counts
// against the breaker: answered, it is a success; abandoned at the cap, the
// caller gets the failure policy (reason "saturated") and the breaker the
// call's real outcome.
//
// With default client options the call runs in its own goroutine on a
// context detached from ctx (so its outcome is known even if the caller
// leaves); a grant that arrives after the caller stopped waiting is passed
// to late, so its tokens are never lost silently. When the client honours
// deadlines (l.direct) the call runs in place on ctx; see authorizeDirect.
func (l *Limiter) authorize(ctx context.Context, brk *breaker.Breaker, rkey string, want, need int64, share float64, late func(authority.Grant)) (authority.Grant, error) {
	done, err := brk.Allow()
	if err != nil {
		return authority.Grant{}, err
	}
	if !l.enter() {
		done(nil)
		return authority.Grant{}, ErrClosed
	}
	if l.direct {
		defer l.wg.Done()
		return l.authorizeDirect(ctx, brk, done, rkey, want, need, share)
	}
	budget := l.cfg.timeout
	start := time.Now()
	hardCap := start.Add((1 + saturationGrace) * budget)
	replies := brk.Replies()
	// The call's own deadline lies a budget past the hard cap, so that the
	// waiter's cap decides first; go-redis honours it while waiting for a
	// pooled connection, which late readers hold longer.
	cctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), hardCap.Add(budget))
	var state atomic.Int32
	// The call writes its result before it claims the outcome, so a waiter
	// that finds the outcome claimed reads the result at once: a goroutine
	// preempted between the claim and a channel send would otherwise keep
	// the waiter for as long as a saturated scheduler takes to run it.
	var result callResult
	delivered := make(chan struct{})
	go func() {
		defer l.wg.Done()
		defer cancel()
		g, err := l.acquire(cctx, rkey, want, need, share)
		if !breaker.Counts(err) {
			brk.Replied()
		}
		if errors.Is(err, breaker.ErrBudget) {
			// The call's own deadline lies past the hard cap: the waiter
			// decides every timeout before it, unless this process kept
			// the waiter (and likely this goroutine) from running.
			err = fmt.Errorf("%w: %v", errSaturated, err)
		}
		result = callResult{g, err}
		if state.CompareAndSwap(callPending, callDelivered) {
			close(delivered)
			done(err)
			return
		}
		if s := state.Load(); s == callLeft || s == callOutwaited {
			done(err)
		}
		if err == nil && g.Granted > 0 && late != nil {
			late(g)
		}
	}()
	// settle ends the wait with what the waiter decided, unless the call
	// delivered its result first, which then wins.
	settle := func(to int32, err error) (authority.Grant, error) {
		if state.CompareAndSwap(callPending, to) {
			if to == callGaveUp {
				done(breaker.ErrBudget)
			}
			return authority.Grant{}, err
		}
		// The call delivered first: as on the delivered path below.
		l.sawLate(ctx, result.err, start)
		return result.g, result.err
	}
	// Check points: at an eighth of the budget (if the process is behind
	// by then, its decisions start yielding at once, rather than after a
	// whole budget of starving the reply), at the budget, then every
	// quarter budget up to the hard cap.
	threshold := overload.Threshold(budget)
	due := start.Add(threshold)
	timer := time.NewTimer(threshold)
	defer timer.Stop()
	held := false
	defer func() {
		if held {
			overload.Release()
		}
	}()
	var probe *overload.Probe
	for {
		var probed <-chan struct{}
		if probe != nil {
			probed = probe.Done()
		}
		select {
		case <-delivered:
			l.sawLate(ctx, result.err, start)
			return result.g, result.err
		case <-ctx.Done():
			return settle(callLeft, ctx.Err())
		case <-probed:
		case <-timer.C:
		}
		now := time.Now()
		var behind bool
		switch {
		case probe != nil:
			behind = probe.Behind(threshold) // done, or not run within the threshold
			probe = nil
		case now.Sub(due) >= threshold:
			overload.MarkBehind(now) // this waiter itself ran that late
			behind = true
		default:
			// On time at a check point: measure the scheduler's delay,
			// and wait up to the threshold for the verdict.
			probe = overload.Start(l.spawn)
			timer.Reset(threshold)
			continue
		}
		// A reply stuck while the process was behind needs a moment more
		// once it has caught up (the network poller runs every 10ms or so
		// on a busy process): Redis is blamed only if no probe found the
		// process behind within the last half budget.
		behind = behind || overload.Recent(now, budget/2)
		behind = behind || l.congested(brk, replies)
		if behind && !held {
			overload.Hold()
			held = true
		}
		var next time.Duration
		switch {
		case now.Sub(start) < budget:
			next = start.Add(budget).Sub(now) // look again at the budget's end
		case !behind:
			return settle(callGaveUp, fmt.Errorf("%w: no reply within %v", breaker.ErrBudget, budget))
		case !now.Before(hardCap):
			g, err := settle(callOutwaited, fmt.Errorf("%w: %v", errSaturated, now.Sub(start).Round(time.Millisecond)))
			if state.Load() == callOutwaited { // the waiter's decision, not a delivered result (settle counted that)
				l.sawSaturation(ctx, telemetry.SaturatedAbandoned)
				l.log.saturated()
			}
			return g, err
		default:
			next = min(budget/4, hardCap.Sub(now))
		}
		due = now.Add(next)
		timer.Reset(next)
	}
}

// authorizeDirect makes the call in place, on ctx bounded by a deadline: the
// client applies it to its reads, and a reply abandoned then leaves its
// tokens debited (under-admission). A deadline cannot be moved once a read
// has started, so it is chosen up front: the hard cap if a probe found the
// process behind within the last budget (its decisions then yield while
// the call runs), else the budget. A timeout is probed before it is blamed
// on Redis: one while the process is behind does not count against the
// breaker, and the failure policy decides with reason "saturated".
func (l *Limiter) authorizeDirect(ctx context.Context, brk *breaker.Breaker, done func(error), rkey string, want, need int64, share float64) (authority.Grant, error) {
	budget := l.cfg.timeout
	start := time.Now()
	replies := brk.Replies()
	limit := budget
	if overload.Recent(start, budget) {
		limit = (1 + saturationGrace) * budget
		overload.Hold()
		defer overload.Release()
	}
	cctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	g, err := l.acquire(cctx, rkey, want, need, share)
	if !breaker.Counts(err) {
		brk.Replied()
	}
	switch {
	case err != nil && errors.Is(err, breaker.ErrBudget) && ctx.Err() == nil:
		if overload.Measure(l.spawn, overload.Threshold(budget)) || l.congested(brk, replies) {
			l.sawSaturation(ctx, telemetry.SaturatedAbandoned)
			l.log.saturated()
			err = fmt.Errorf("%w: %v", errSaturated, time.Since(start).Round(time.Millisecond))
		}
	case err == nil && limit > budget && time.Since(start) > budget:
		l.sawSaturation(ctx, telemetry.SaturatedAnswered)
	}
	done(err)
	return g, err
}

// congested reports whether a call begun when brk had counted replies
// waits in the client's own queue for a connection: Redis has answered a
// whole pool's worth of other calls since, so each connection came back
// within the budget, and the queue is this process's (more concurrent calls
// than connections, or too little CPU to turn them round).
func (l *Limiter) congested(brk *breaker.Breaker, replies int64) bool {
	return brk.Replies()-replies >= int64(l.pool)
}

// sawLate records a delivered call that ended past its budget: abandoned
// by its own deadline while the process was behind (errSaturated), or
// answered after the budget and not blamed on Redis (the waiter found the
// process behind, or was itself too late to look).
func (l *Limiter) sawLate(ctx context.Context, err error, start time.Time) {
	switch {
	case errors.Is(err, errSaturated):
		l.sawSaturation(ctx, telemetry.SaturatedAbandoned)
		l.log.saturated()
	case time.Since(start) > l.cfg.timeout:
		l.sawSaturation(ctx, telemetry.SaturatedAnswered)
	}
}

// sawSaturation records a call that ran past its budget while the process
// was behind: on the metric, and on the decision span in ctx.
func (l *Limiter) sawSaturation(ctx context.Context, outcome string) {
	l.tel.CountSaturated(ctx, outcome)
	if sp, ok := recording(ctx); ok {
		sp.SetAttributes(telemetry.AttrSaturated.Bool(true))
	}
}

// acquire makes one script call on ctx, which carries the deadline, with its
// span and metrics; a deadline overrun is marked with breaker.ErrBudget.
func (l *Limiter) acquire(ctx context.Context, rkey string, want, need int64, share float64) (authority.Grant, error) {
	cctx, span := l.tel.StartAuthority(ctx, want, need)
	start := time.Now()
	g, err := l.auth.Acquire(cctx, rkey, l.limit, want, need, share)
	l.tel.EndAuthority(cctx, span, time.Since(start), g.Granted, err)
	if err != nil && errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("%w: %w", breaker.ErrBudget, err)
	}
	if err != nil && breaker.Counts(err) {
		l.brk.failed()
	}
	return g, err
}
