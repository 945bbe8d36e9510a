package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/overload"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"
)

// saturationGrace is how many budgets more a call is waited for while this
// process, not Redis, is behind (a probe found it behind, or the client's
// own queue is congested): a call waits at most (1 + saturationGrace) × the
// budget in all, 500ms with the default budget.
const saturationGrace = 4

// errSaturated marks a call abandoned at the hard cap while the process was
// still behind. It is not a Redis failure: the breaker is credited with the
// call's real outcome when it completes.
var errSaturated = errors.New("no reply while this process was behind its scheduler")

// call is one acquire call to make: take between min and want tokens of the
// bucket at rkey, at most max(min, share × its tokens).
type call struct {
	brk       *breaker.Breaker
	rkey      string
	want, min int64
	share     float64
	// refill, if set, is the lease refill the call performs: its grant is
	// installed in the lease as soon as it arrives, whether or not anyone
	// still waits. Without it (an exact call) a grant that arrives after
	// the caller stopped waiting is refunded.
	refill *lease.Refill
	// sent, if set, is stamped (Unix ns) when the call leaves this process
	// (see queued).
	sent *atomic.Int64
	// with, if set, are more buckets the same tokens are taken from, all or
	// none, in the same script call (a multi-limit; see For).
	with []authority.Member
	// span, if set, is the call's client span, begun by a waiter that may
	// end it before the call returns (detached); else acquire makes one.
	span *callSpan
}

// callSpan is a Redis call's client span that whoever finishes first ends:
// the call when it returns, or its waiter when it gives up, so that the
// span never outlives the decision span that is its parent.
type callSpan struct {
	span  trace.Span
	ended atomic.Bool
}

// finish ends s with the call's outcome, once.
func (s *callSpan) finish(tel *telemetry.Recorder, granted int64, err error, errType string) {
	if s.ended.CompareAndSwap(false, true) {
		tel.FinishAuthority(s.span, granted, err, errType)
	}
}

// refund queues the tokens of c's grant g, which no one will use, back to
// every bucket it took them from, stamped with the grant (see
// authority.Refund): a calendar quota's window ends ResetAfter after it.
func (a *calls) refund(c call, g authority.Grant) {
	if g.Granted <= 0 {
		return
	}
	a.refunds.add(authority.Refund{Key: c.rkey, Limit: a.limit, Tokens: g.Granted, Since: g.At, Window: windowOfGrant(a.limit, g.At, partReset(g, 0))})
	for i, m := range c.with {
		a.refunds.add(authority.Refund{Key: m.Key, Limit: m.Limit, Tokens: g.Granted, Since: g.At, Window: windowOfGrant(m.Limit, g.At, partReset(g, i+1))})
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

// reply is a call's result: the grant and, for a refill, the outcome its
// waiting callers collect.
type reply struct {
	grant   authority.Grant
	outcome lease.Outcome
	err     error
}

// authorizer makes budgeted calls: one acquire call through the breaker,
// bounded by the time budget whatever the client's own timeouts. New picks
// one of two variants, once, by whether the client honours context
// deadlines (detached, direct).
//
// A call that is not answered within the budget is Redis's failure only if
// the process was keeping up: a CPU-bound process leaves the goroutine that
// carries a reply waiting in the run queue, and that delay is its own, not
// Redis's. So the waiter probes the scheduler (overload.Probe) and checks
// whether the client's own queue is the hold-up (congested); if the process
// is behind, it asks the process's decisions to yield (overload.Hold) so
// the reply's goroutine runs, and keeps waiting up to saturationGrace
// budgets more. Such a call never counts against the breaker: answered, it
// is a success; abandoned at the cap, the caller gets the failure policy
// (reason "saturated") and the breaker the call's real outcome.
type authorizer interface {
	authorize(ctx context.Context, c call) reply
}

// calls is what both variants share: the authority, the clock, and where
// grants and their bookkeeping go.
type calls struct {
	auth   *authority.Redis
	limit  policy.Limit
	budget time.Duration
	pool   int // the client's connection pool size (see congested)
	// client is the Redis client, whose pool tells a Redis that cannot be
	// connected to from one that does not answer (see unreachable).
	client  redis.UniversalClient
	brks    *breakers
	leases  *lease.Leases
	refunds *refundQueue
	gate    *gate
	clock   localClock
	tel     *telemetry.Recorder
	log     *logger
}

// newAuthorizer returns the variant for client: direct when it applies
// context deadlines to its reads and writes (go-redis's
// ContextTimeoutEnabled), so that a call can be bounded by its context
// alone; detached otherwise, where a hung Redis would hold a read for the
// client's ReadTimeout (3s by default).
func newAuthorizer(client redis.UniversalClient, c *calls) authorizer {
	if honoursDeadlines(client) {
		return direct{c}
	}
	return detached{c}
}

// The states of one detached call made on the waiter's behalf.
const (
	callPending   int32 = iota
	callDelivered       // the result went to the waiter
	callGaveUp          // the waiter blamed Redis and told the breaker
	callLeft            // the waiter's ctx ended: the call tells the breaker its outcome
	callOutwaited       // the waiter left at the hard cap, the process still behind: the call tells the breaker its outcome
)

// detached hands each call to its lane's senders (see lane.submit), whose
// goroutines carry it on a context detached from the caller's, so that its
// outcome is known even if the caller leaves; the caller waits for it up to
// the budget (and the grace while the process is behind).
type detached struct{ *calls }

func (a detached) authorize(ctx context.Context, c call) reply {
	done, err := a.admit(c)
	if err != nil {
		return reply{err: err}
	}
	budget := a.budget
	start := time.Now()
	hardCap := start.Add((1 + saturationGrace) * budget)
	replies := c.brk.Replies()
	ln := a.brks.laneFor(c.brk)
	tctx, span := a.tel.StartAuthority(ctx, c.want, c.min, ln.ep)
	c.span = &callSpan{span: span}
	d := &detachedCall{calls: a.calls, c: c, ctx: tctx, start: start, done: done, delivered: make(chan struct{})}
	d.c.sent = &d.sent
	// The call's own deadline lies a budget past the hard cap, so that the
	// waiter's cap decides first; go-redis honours it while waiting for a
	// pooled connection, which late readers hold longer.
	d.pending = pending{a: acquisition(a.limit, d.c), ctx: tctx, deadline: hardCap.Add(budget), sent: &d.sent, finish: d}
	ln.submit(&d.pending)
	state, sent := &d.state, &d.sent
	// settle ends the wait with what the waiter decided, unless the call
	// delivered its result first, which then wins.
	settle := func(to int32, err error) reply {
		if state.CompareAndSwap(callPending, to) {
			errType := ""
			if to == callGaveUp {
				done(breaker.ErrBudget)
				if a.unreachable(c.brk, start.Add(-2*budget)) {
					errType = "network"
				}
			}
			c.span.finish(a.tel, 0, err, errType)
			return reply{err: err}
		}
		// The call delivered first: as on the delivered path below.
		a.sawLate(ctx, d.result.err, start)
		return d.result
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
		case <-d.delivered:
			a.sawLate(ctx, d.result.err, start)
			return d.result
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
			probe = overload.Start(a.gate.spawn)
			timer.Reset(threshold)
			continue
		}
		// A reply stuck while the process was behind needs a moment more
		// once it has caught up (the network poller runs every 10ms or so
		// on a busy process): Redis is blamed only if no probe found the
		// process behind within the last half budget.
		behind = behind || overload.Recent(now, budget/2)
		behind = behind || a.congested(c.brk, replies) || a.queued(c.brk, replies, sent)
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
			r := settle(callOutwaited, fmt.Errorf("%w: %v", errSaturated, now.Sub(start).Round(time.Millisecond)))
			if state.Load() == callOutwaited { // the waiter's decision, not a delivered result (settle counted that)
				a.sawSaturation(ctx, telemetry.SaturatedAbandoned)
				a.log.saturated()
			}
			return r
		default:
			next = min(budget/4, hardCap.Sub(now))
		}
		due = now.Add(next)
		timer.Reset(next)
	}
}

// detachedCall is one call of the detached variant: its place in its
// lane, and what the waiter and the lane's sender share. The sender writes
// the result before it claims the outcome, so a waiter that finds the
// outcome claimed reads the result at once: a sender preempted between the
// claim and a channel send would otherwise keep the waiter for as long as
// a saturated scheduler takes to run it.
type detachedCall struct {
	pending // the call in its lane
	*calls
	c         call
	ctx       context.Context // the call span's
	start     time.Time
	done      func(error) // the breaker's
	sent      atomic.Int64
	state     atomic.Int32 // callPending, then who decided
	result    reply
	delivered chan struct{} // closed when result is the waiter's
}

// finished takes the call's outcome from its lane's sender: its span,
// metrics and lease install (see end), then either the waiter gets it, or,
// if the waiter left, the breaker learns it and an exact grant goes back.
func (d *detachedCall) finished(p *pending) {
	defer d.gate.leave()
	r := d.end(d.ctx, d.c, d.start, p.a.Grant, p.a.Err)
	if errors.Is(r.err, breaker.ErrBudget) {
		// The call's own deadline lies past the hard cap: the waiter
		// decides every timeout before it, unless this process kept
		// the waiter (and likely the sender) from running.
		r.err = fmt.Errorf("%w: %v", errSaturated, r.err)
	}
	d.result = r
	if d.state.CompareAndSwap(callPending, callDelivered) {
		close(d.delivered)
		d.done(r.err)
		return
	}
	if s := d.state.Load(); s == callLeft || s == callOutwaited {
		d.done(r.err)
	}
	if r.err == nil && d.c.refill == nil {
		// The caller left before the grant arrived: give it back.
		d.refund(d.c, r.grant)
	}
}

// direct makes the call in place, on ctx bounded by a deadline: the client
// applies it to its reads, and a reply abandoned then leaves its tokens
// debited (under-admission). A deadline cannot be moved once a read has
// started, so it is chosen up front: the hard cap if a probe found the
// process behind within the last budget (its decisions then yield while
// the call runs), else the budget. A timeout is probed before it is blamed
// on Redis: one while the process is behind does not count against the
// breaker, and the failure policy decides with reason "saturated".
type direct struct{ *calls }

func (a direct) authorize(ctx context.Context, c call) reply {
	done, err := a.admit(c)
	if err != nil {
		return reply{err: err}
	}
	defer a.gate.leave()
	budget := a.budget
	start := time.Now()
	replies := c.brk.Replies()
	limit := budget
	if overload.Recent(start, budget) {
		limit = (1 + saturationGrace) * budget
		overload.Hold()
		defer overload.Release()
	}
	cctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	var sent atomic.Int64
	c.sent = &sent
	r := a.acquire(cctx, c)
	switch {
	case r.err != nil && errors.Is(r.err, breaker.ErrBudget) && ctx.Err() == nil:
		if overload.Measure(a.gate.spawn, overload.Threshold(budget)) || a.congested(c.brk, replies) || a.queued(c.brk, replies, &sent) {
			a.sawSaturation(ctx, telemetry.SaturatedAbandoned)
			a.log.saturated()
			r.err = fmt.Errorf("%w: %v", errSaturated, time.Since(start).Round(time.Millisecond))
		}
	case r.err == nil && limit > budget && time.Since(start) > budget:
		a.sawSaturation(ctx, telemetry.SaturatedAnswered)
	}
	done(r.err)
	return r
}

// admit lets c through its breaker and registers it with the gate; the
// caller must call done with the call's outcome and then gate.leave.
func (a *calls) admit(c call) (done func(error), err error) {
	done, err = c.brk.Allow()
	if err != nil {
		return nil, err
	}
	if !a.gate.enter() {
		done(nil)
		return nil, ErrClosed
	}
	return done, nil
}

// acquire makes the script call on ctx, which carries the deadline, on
// the caller's goroutine (the direct variant), with its span and metrics,
// and installs a refill's grant in the lease at once. A deadline overrun is
// marked with breaker.ErrBudget.
func (a *calls) acquire(ctx context.Context, c call) reply {
	ln := a.brks.laneFor(c.brk)
	var span trace.Span
	ctx, span = a.tel.StartAuthority(ctx, c.want, c.min, ln.ep)
	c.span = &callSpan{span: span}
	start := time.Now()
	g, err := ln.acquire(ctx, acquisition(a.limit, c), c.sent)
	return a.end(ctx, c, start, g, err)
}

// acquisition is the authority call c makes on limit's buckets.
func acquisition(limit policy.Limit, c call) authority.Acquisition {
	return authority.Acquisition{Key: c.rkey, Limit: limit, Want: c.want, Min: c.min, Share: c.share, With: c.with}
}

// end is what follows a call begun at start with its outcome g, err: its
// metrics and span, what the breakers learn of it, and for a refill the
// grant installed in the lease.
func (a *calls) end(cctx context.Context, c call, start time.Time, g authority.Grant, err error) reply {
	a.tel.RecordAuthority(cctx, time.Since(start), g.Granted, err)
	errType := ""
	switch {
	case isNetworkError(err):
		c.brk.NoteNetworkError(time.Now())
	case errors.Is(err, context.DeadlineExceeded) && a.unreachable(c.brk, start):
		errType = "network"
	}
	c.span.finish(a.tel, g.Granted, err, errType)
	if !breaker.Counts(err) {
		c.brk.Replied()
	}
	if err != nil && errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("%w: %w", breaker.ErrBudget, err)
	}
	if err != nil {
		if breaker.Counts(err) {
			a.brks.failed()
		}
		return reply{err: err}
	}
	r := reply{grant: g}
	if c.refill != nil {
		var back []lease.Return
		r.outcome, back = a.leases.Complete(*c.refill, g, a.clock.now())
		a.refunds.addReturns(back...)
	}
	return r
}

// unreachable reports whether a call given up at the budget failed to
// connect rather than to get an answer: go-redis retries a refused
// connection (5 dials, backoff, 3 retries: over a second) far past any
// budget, so the waiter's own timeout would hide it. Either the client's
// pool holds no connection at all, or a call on brk came back with a
// network error since.
//
// Only a single node's (or Sentinel's) pool is read: a ClusterClient's
// PoolStats loads the slot map first, in this goroutine and without a
// deadline, which on an unreachable Cluster blocks for seconds.
func (a *calls) unreachable(brk *breaker.Breaker, since time.Time) bool {
	if c, ok := a.client.(*redis.Client); ok {
		if st := c.PoolStats(); st != nil && st.TotalConns == 0 {
			return true
		}
	}
	return brk.NetworkErrorSince(since)
}

// isNetworkError reports whether err is a network failure that is not a
// timeout: a refused or reset connection.
func isNetworkError(err error) bool {
	var ne net.Error
	return err != nil && errors.As(err, &ne) && !ne.Timeout()
}

// congested reports whether a call begun when brk had counted replies
// waits in the client's own queue for a connection: Redis has answered a
// whole pool's worth of other calls since, so each connection came back
// within the budget, and the queue is this process's (more concurrent calls
// than connections, or too little CPU to turn them round).
func (a *calls) congested(brk *breaker.Breaker, replies int64) bool {
	return brk.Replies()-replies >= int64(a.pool)
}

// queued reports whether a call begun when brk had counted replies has
// not left this process yet (see call.sent) while Redis has answered other
// calls since: it waits in its lane behind batches that Redis is turning
// round, which is this process's queue (calls on one key go one per batch),
// not Redis failing. On a hung Redis nothing is answered, and the call is
// blamed at the budget as before.
func (a *calls) queued(brk *breaker.Breaker, replies int64, sent *atomic.Int64) bool {
	return sent.Load() == 0 && brk.Replies() > replies
}

// sawLate records a delivered call that ended past its budget: abandoned
// by its own deadline while the process was behind (errSaturated), or
// answered after the budget and not blamed on Redis (the waiter found the
// process behind, or was itself too late to look).
func (a *calls) sawLate(ctx context.Context, err error, start time.Time) {
	switch {
	case errors.Is(err, errSaturated):
		a.sawSaturation(ctx, telemetry.SaturatedAbandoned)
		a.log.saturated()
	case time.Since(start) > a.budget:
		a.sawSaturation(ctx, telemetry.SaturatedAnswered)
	}
}

// sawSaturation records a call that ran past its budget while the process
// was behind: on the metric, and on the decision span in ctx.
func (a *calls) sawSaturation(ctx context.Context, outcome string) {
	a.tel.CountSaturated(ctx, outcome)
	if sp, ok := recording(ctx); ok {
		sp.SetAttributes(telemetry.AttrSaturated.Bool(true))
	}
}
