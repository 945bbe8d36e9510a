package redispath

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/overload"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"
)

// saturationGrace is how many budgets more a call is waited for while this
// process, not Redis, is behind (a probe found it behind, or the client's
// own queue is congested): a call waits at most (1 + saturationGrace) × the
// budget in all, 500ms with the default budget.
const saturationGrace = 4

// ErrSaturated marks a call abandoned at the hard cap while the process
// was still behind. It is not a Redis failure: the breaker is credited
// with the call's real outcome when it completes.
var ErrSaturated = errors.New("no reply while this process was behind its scheduler")

// Call is one acquire call: the authority call to make through Brk, the
// breaker of its node (see Path.Route).
type Call struct {
	Brk *circuit.Breaker
	Acq authority.Acquisition
	// Keep marks a call whose grant is kept whoever waits for it (a lease
	// refill): the Receiver's Arrived gets it as soon as it arrives. A grant
	// of any other call that arrives after its caller stopped waiting goes
	// to the Receiver's Unclaimed instead.
	Keep bool
	// Tag is the root's own, for its Receiver (what a refill must
	// install); the path never reads it.
	Tag any
}

// Receiver is told what the root must do with an answer that the caller
// may not be there to take.
type Receiver interface {
	// Arrived gets the grant of a call with Keep, on the goroutine that
	// received it (the caller's, or a lane's sender), before the caller
	// gets the result.
	Arrived(c Call, g authority.Grant)
	// Unclaimed gets the grant of a call without Keep whose caller stopped
	// waiting before it arrived: no one will use its tokens.
	Unclaimed(c Call, g authority.Grant)
	// Saturated is told of a call given up at the hard cap while this
	// process was still behind (Redis may be healthy).
	Saturated()
}

// Caller makes one Limiter's acquire calls, with its telemetry and its
// Receiver. New picks one of two variants, once, by whether the client
// honours context deadlines (see Path.Caller).
//
// A call that is not answered within the budget is Redis's failure only if
// the process was keeping up: a CPU-bound process leaves the goroutine that
// carries a reply waiting in the run queue, and that delay is its own, not
// Redis's. So the waiter probes the scheduler (overload.Probe) and checks
// whether the client's own queue is the hold-up (congested); if the process
// is behind, it asks the process's decisions to yield (overload.Hold) so
// the reply's goroutine runs, and keeps waiting up to saturationGrace
// budgets more. Such a call never counts against the breaker: answered, it
// is a success; abandoned at the cap, the caller gets ErrSaturated and the
// breaker the call's real outcome.
type Caller struct {
	p    *Path
	tel  *recorder.Recorder
	recv Receiver
}

// Caller returns a Caller on p for one Limiter: its telemetry (the limit's
// name on spans and metrics) and its Receiver.
func (p *Path) Caller(tel *recorder.Recorder, recv Receiver) *Caller {
	return &Caller{p: p, tel: tel, recv: recv}
}

// Acquire makes call c within the time budget. The error is the Path's
// closed error, ErrSaturated, one wrapping circuit.ErrBudget (no reply in
// the budget) or breaker.ErrOpen, ctx's, or the call's own.
//
// On a client that honours context deadlines, a call that finds its lane
// idle is made in place, on the caller's goroutine (see direct); any other
// call waits for the lane's senders (see detached). A client that does not
// honour them could hold an in-place call for its ReadTimeout, past the
// budget, so its calls are all carried by the senders.
func (k *Caller) Acquire(ctx context.Context, c Call) (authority.Grant, error) {
	if err := ctx.Err(); err != nil {
		// Ended already: no call, rather than a race between its reply
		// and ctx.Done.
		return authority.Grant{}, err
	}
	ln := k.p.nodes.laneFor(c.Brk)
	if k.p.bounded && ln.claim() {
		done, err := k.p.admit(c.Brk)
		if err != nil {
			ln.release()
			return authority.Grant{}, err
		}
		return k.direct(ctx, c, ln, done)
	}
	// A detached call goes through the breaker with its batch (see
	// lane.send). While the breaker is not closed, a call goes through it
	// on its own: refused at once while it is open, or as the probe, as
	// a probe batch of every call that queued meanwhile would keep them
	// all waiting on a Redis that may still be down.
	var own func(error)
	if c.Brk.State() != breaker.Closed {
		done, err := k.p.admit(c.Brk)
		if err != nil {
			return authority.Grant{}, err
		}
		own = done
	} else if !k.p.gate.enter() {
		return authority.Grant{}, k.p.closed
	}
	return k.detached(ctx, c, ln, own)
}

// callSpan is a Redis call's client span that whoever finishes first ends:
// the call when it returns, or its waiter when it gives up, so that the
// span never outlives the decision span that is its parent.
type callSpan struct {
	span  trace.Span
	ended atomic.Bool
}

// finish ends s with the call's outcome, once.
func (s *callSpan) finish(tel *recorder.Recorder, granted int64, err error, errType string) {
	if s.ended.CompareAndSwap(false, true) {
		tel.FinishAuthority(s.span, granted, err, errType)
	}
}

// The states of one detached call made on the waiter's behalf.
const (
	callPending   int32 = iota
	callDelivered       // the result went to the waiter
	callGaveUp          // the waiter blamed Redis and told the breaker
	callLeft            // the waiter's ctx ended: the call tells the breaker its outcome
	callOutwaited       // the waiter left at the hard cap, the process still behind: the call tells the breaker its outcome
)

// detachedCall is one call of the detached variant: its place in its
// lane, and what the waiter and the lane's sender share. The outcome is in
// c.Acq before the sender claims it, so a waiter that finds the outcome
// claimed takes it at once: a sender preempted between the claim and a
// channel send would otherwise keep the waiter for as long as a saturated
// scheduler takes to run it.
type detachedCall struct {
	pending // the call in its lane
	k       *Caller
	c       Call
	span    callSpan
	ctx     context.Context // the call span's
	start   time.Time
	sent    atomic.Int64
	state   atomic.Int32 // callPending, then who decided
	// delivered gets a value when the outcome is the waiter's (see
	// finished).
	delivered chan struct{}
	// refs counts the waiter and the call while they use this value; the
	// last to let go puts it back in detachedCalls.
	refs atomic.Int32
}

// detachedCalls holds detachedCall values for reuse: one is about 500
// bytes, most of what an exact decision allocates.
var detachedCalls = sync.Pool{New: func() any { return &detachedCall{delivered: make(chan struct{}, 1)} }}

// newDetachedCall returns a detachedCall from the pool, held by the waiter
// and the call.
func newDetachedCall() *detachedCall {
	d := detachedCalls.Get().(*detachedCall)
	d.refs.Store(2)
	return d
}

// release lets go of d; the last of the waiter and the call to let go
// empties it (a value delivered to a waiter that had decided meanwhile is
// still in its channel) and puts it back in the pool.
func (d *detachedCall) release() {
	if d.refs.Add(-1) != 0 {
		return
	}
	ch := d.delivered
	select {
	case <-ch:
	default:
	}
	*d = detachedCall{delivered: ch}
	detachedCalls.Put(d)
}

// detached hands c to its lane's senders (see lane.submit), whose
// goroutines carry it on a context detached from the caller's, so that its
// outcome is known even if the caller leaves; the caller waits for it up
// to the budget (and the grace while the process is behind). The breaker
// counts the call's batch, once (see lane.send), and a failure for each
// waiter that gives up on Redis (see blame); a call with own (the breaker's
// done, from admit: the breaker was not closed) is counted on its own
// instead, its outcome or the waiter's verdict.
func (k *Caller) detached(ctx context.Context, c Call, ln *lane, own func(error)) (authority.Grant, error) {
	budget := k.p.budget
	start := time.Now()
	hardCap := start.Add((1 + saturationGrace) * budget)
	replies := c.Brk.RepliesSeen()
	d := newDetachedCall()
	defer d.release() // after the results below are read
	d.k, d.c, d.start = k, c, start
	d.ctx, d.span.span = k.tel.StartAuthority(ctx, c.Acq.Want, c.Acq.Min, ln.ep)
	// The call's own deadline lies a budget past the hard cap, so that the
	// waiter's cap decides first; go-redis honours it while waiting for a
	// pooled connection, which late readers hold longer.
	d.pending = pending{a: &d.c.Acq, ctx: d.ctx, deadline: hardCap.Add(budget), sent: &d.sent, own: own, finish: d}
	ln.submit(&d.pending)
	// settle ends the wait with what the waiter decided, unless the call
	// delivered its result first, which then wins.
	settle := func(to int32, err error) (authority.Grant, error) {
		if d.state.CompareAndSwap(callPending, to) {
			errType := ""
			if to == callGaveUp {
				if own != nil {
					own(circuit.ErrBudget)
				} else {
					blame(c.Brk)
				}
				if k.p.unreachable(c.Brk, start.Add(-2*budget)) {
					errType = "network"
					err = fmt.Errorf("%w: %w", circuit.ErrUnreachable, err)
				}
			}
			d.span.finish(k.tel, 0, err, errType)
			return authority.Grant{}, err
		}
		// The call delivered first: the waiter completes it, as on the
		// delivered path below.
		g, err := d.complete()
		d.account(err)
		k.sawLate(ctx, err, start)
		return g, err
	}
	// Check points: at an eighth of the budget (if the process is behind
	// by then, its decisions start yielding at once, rather than after a
	// whole budget of starving the reply), at the budget, then every
	// quarter budget up to the hard cap.
	threshold := overload.Threshold(budget)
	due := start.Add(threshold)
	timer := newTimer(threshold)
	defer releaseTimer(timer)
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
			g, err := d.complete()
			d.account(err)
			k.sawLate(ctx, err, start)
			return g, err
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
			probe = overload.Start(k.p.gate.spawn)
			timer.Reset(threshold)
			continue
		}
		// A reply stuck while the process was behind needs a moment more
		// once it has caught up (the network poller runs every 10ms or so
		// on a busy process): Redis is blamed only if no probe found the
		// process behind within the last half budget.
		behind = behind || overload.Recent(now, budget/2)
		behind = behind || k.p.congested(c.Brk, replies) || queued(c.Brk, replies, &d.sent)
		if behind && !held {
			overload.Hold()
			held = true
		}
		var next time.Duration
		switch {
		case now.Sub(start) < budget:
			next = start.Add(budget).Sub(now) // look again at the budget's end
		case !behind:
			return settle(callGaveUp, fmt.Errorf("%w: no reply within %v", circuit.ErrBudget, budget))
		case !now.Before(hardCap):
			g, err := settle(callOutwaited, fmt.Errorf("%w: %v", ErrSaturated, now.Sub(start).Round(time.Millisecond)))
			if d.state.Load() == callOutwaited { // the waiter's decision, not a delivered result (settle counted that)
				k.sawSaturation(ctx, telemetry.SaturatedAbandoned)
				k.recv.Saturated()
			}
			return g, err
		default:
			next = min(budget/4, hardCap.Sub(now))
		}
		due = now.Add(next)
		timer.Reset(next)
	}
}

// finished takes the call's outcome from its lane's sender, on the
// sender's goroutine, after the breaker has counted its batch. The reply
// is noted at once (see noted); the rest (span, metrics, what the
// Receiver must know) is the waiter's to do if it still waits, so that the
// sender turns to the next batch without doing every member's bookkeeping
// first. If the waiter left, the sender completes the call, and a grant no
// one keeps goes to the Receiver.
func (d *detachedCall) finished(p *pending) {
	noted(d.c.Brk, p.a.Err)
	if d.state.CompareAndSwap(callPending, callDelivered) {
		d.delivered <- struct{}{}
		d.release()
		return
	}
	k := d.k // d may be reused once released
	g, err := d.complete()
	if s := d.state.Load(); s == callLeft || s == callOutwaited {
		d.account(err) // the waiter left it to the call
	}
	if err == nil && !d.c.Keep {
		// The caller left before the grant arrived.
		k.recv.Unclaimed(d.c, g)
	}
	d.release()
}

// account tells the breaker the outcome err of a call counted on its own
// (see detached); a batched call's batch counts it.
func (d *detachedCall) account(err error) {
	if d.pending.own != nil {
		d.pending.own(err)
	}
}

// gaveUp reports whether the waiter gave up on the call and blamed Redis
// (see blame): its batch's outcome is then not the breaker's to count.
func (d *detachedCall) gaveUp() bool { return d.state.Load() == callGaveUp }

// complete is what follows the outcome of d, in d.c.Acq: its span, metrics
// and what the Receiver must know (see end), then the gate's leave. It runs
// once: on the waiter's goroutine if the waiter took the outcome, else on
// the sender's.
func (d *detachedCall) complete() (authority.Grant, error) {
	defer d.k.p.gate.leave()
	g, err := d.k.end(d.ctx, d.c, &d.span, d.start, d.c.Acq.Grant, d.c.Acq.Err)
	if errors.Is(err, circuit.ErrBudget) {
		// The call's own deadline lies past the hard cap: the waiter
		// decides every timeout before it, unless this process kept
		// the waiter (and likely the sender) from running.
		err = fmt.Errorf("%w: %v", ErrSaturated, err)
	}
	return g, err
}

// direct makes the call in place, on the caller's goroutine, alone on the
// pipeline of ln that claim took, bounded by a deadline that the client
// applies to its reads: a reply abandoned then leaves its tokens debited
// (under-admission). A deadline cannot be moved once a read has started,
// so it is chosen up front: the hard cap if a probe found the process
// behind within the last budget (its decisions then yield while the call
// runs), else the budget. A timeout is probed before it is blamed on
// Redis: one while the process is behind does not count against the
// breaker, and the caller gets ErrSaturated. done is the breaker's, from
// admit.
func (k *Caller) direct(ctx context.Context, c Call, ln *lane, done func(error)) (authority.Grant, error) {
	defer k.p.gate.leave()
	budget := k.p.budget
	start := time.Now()
	replies := c.Brk.RepliesSeen()
	limit := budget
	if overload.Recent(start, budget) {
		limit = (1 + saturationGrace) * budget
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
	cctx, cancel := context.WithTimeout(base, limit)
	defer cancel()
	var span callSpan
	cctx, span.span = k.tel.StartAuthority(cctx, c.Acq.Want, c.Acq.Min, ln.ep)
	ln.sendAlone(cctx, &c.Acq)
	noted(c.Brk, c.Acq.Err)
	g, err := k.end(cctx, c, &span, start, c.Acq.Grant, c.Acq.Err)
	switch {
	case err != nil && errors.Is(err, circuit.ErrBudget) && ctx.Err() == nil:
		if overload.Measure(k.p.gate.spawn, overload.Threshold(budget)) || k.p.congested(c.Brk, replies) {
			k.sawSaturation(ctx, telemetry.SaturatedAbandoned)
			k.recv.Saturated()
			err = fmt.Errorf("%w: %v", ErrSaturated, time.Since(start).Round(time.Millisecond))
		}
	case err == nil && time.Since(start) > budget:
		// Answered within its deadline, yet delivered late: this
		// process kept the caller from running (as sawLate).
		k.sawSaturation(ctx, telemetry.SaturatedAnswered)
	}
	done(err)
	return g, err
}

// end is what follows a call begun at start with its outcome g, err, once
// noted has told its breaker: its metrics and span, whether the path
// counts it as failed, and for a call with Keep the grant handed to the
// Receiver. A deadline overrun is marked with
// circuit.ErrBudget.
func (k *Caller) end(ctx context.Context, c Call, span *callSpan, start time.Time, g authority.Grant, err error) (authority.Grant, error) {
	k.tel.RecordAuthority(ctx, time.Since(start), g.Granted, err)
	errType := ""
	if !isNetworkError(err) && errors.Is(err, context.DeadlineExceeded) && k.p.unreachable(c.Brk, start) {
		errType = "network"
	}
	span.finish(k.tel, g.Granted, err, errType)
	if err != nil && errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("%w: %w", circuit.ErrBudget, err)
		if errType == "network" {
			err = fmt.Errorf("%w: %w", circuit.ErrUnreachable, err)
		}
	}
	if err != nil {
		if circuit.Counts(err) {
			k.p.nodes.failed()
		}
		return authority.Grant{}, err
	}
	if c.Keep {
		k.recv.Arrived(c, g)
	}
	return g, nil
}

// noted tells brk of a call's outcome err as soon as it arrives, on the
// goroutine that received it (before end): a network error, which says
// Redis cannot be reached (see unreachable); a reply, which the waiters of
// other calls count to tell a slow Redis from a process that is behind
// (see congested and queued).
func noted(brk *circuit.Breaker, err error) {
	if isNetworkError(err) {
		brk.NoteNetworkError(time.Now())
	}
	if !circuit.Counts(err) {
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

// timers holds stopped timers for the waiters of detached calls: a
// timer and its channel are two allocations, and most calls are answered
// long before their first check point. Since Go 1.23, Stop and Reset
// leave no stale value in a timer's channel, so a pooled timer is as good
// as a new one.
var timers sync.Pool

// newTimer returns a timer that fires after d, from the pool if it can.
func newTimer(d time.Duration) *time.Timer {
	if t, ok := timers.Get().(*time.Timer); ok {
		t.Reset(d)
		return t
	}
	return time.NewTimer(d)
}

// releaseTimer stops t and returns it to the pool.
func releaseTimer(t *time.Timer) {
	t.Stop()
	timers.Put(t)
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

// sawLate records a delivered call that ended past its budget: abandoned
// by its own deadline while the process was behind (ErrSaturated), or
// answered after the budget and not blamed on Redis (the waiter found the
// process behind, or was itself too late to look).
func (k *Caller) sawLate(ctx context.Context, err error, start time.Time) {
	switch {
	case errors.Is(err, ErrSaturated):
		k.sawSaturation(ctx, telemetry.SaturatedAbandoned)
		k.recv.Saturated()
	case time.Since(start) > k.p.budget:
		k.sawSaturation(ctx, telemetry.SaturatedAnswered)
	}
}

// sawSaturation records a call that ran past its budget while the process
// was behind: on the metric, and on the decision span in ctx.
func (k *Caller) sawSaturation(ctx context.Context, outcome string) {
	k.tel.CountSaturated(ctx, outcome)
	if sp := trace.SpanFromContext(ctx); sp.IsRecording() {
		sp.SetAttributes(telemetry.AttrSaturated.Bool(true))
	}
}
