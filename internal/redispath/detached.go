package redispath

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/deadline"
	"github.com/leaselimit/leaselimit/internal/overload"
	"github.com/leaselimit/leaselimit/telemetry"
)

// The detached variant of an acquire call: the caller hands the call to
// its lane's senders and waits for it, looking at set points whether a
// late reply is Redis failing or this process being behind (see Caller).

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
	elapsed time.Duration // from start to the outcome's completion (see complete)
	sent    atomic.Int64
	state   atomic.Int32 // callPending, then who decided
	told    atomic.Bool  // the breaker was told the outcome of a call with own (see account)
	// wake gets a value when the outcome is the waiter's (see finished)
	// and when the lane's watchdog finds its first check point come (see
	// checkPoint): at most two values, which its buffer holds.
	wake chan struct{}
	// refs counts the waiter and the call while they use this value; the
	// last to let go puts it back in detachedCalls.
	refs atomic.Int32
}

// detachedCalls holds detachedCall values for reuse: one is about 500
// bytes, most of what an exact decision allocates.
var detachedCalls = sync.Pool{New: func() any { return &detachedCall{wake: make(chan struct{}, 2)} }}

// newDetachedCall returns a detachedCall from the pool, held by the waiter
// and the call.
func newDetachedCall() *detachedCall {
	d := detachedCalls.Get().(*detachedCall)
	d.refs.Store(2)
	return d
}

// release lets go of d; the last of the waiter and the call to let go
// empties it (a wake the waiter did not read, as when it had decided
// meanwhile, is still in its channel) and puts it back in the pool.
func (d *detachedCall) release() {
	if d.refs.Add(-1) != 0 {
		return
	}
	ch := d.wake
	for len(ch) > 0 {
		<-ch
	}
	*d = detachedCall{wake: ch}
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
func (k *Caller) detached(ctx context.Context, c *Call, ln *lane, own func(error)) (authority.Grant, error) {
	budget := k.p.budget
	start := time.Now()
	hardCap := start.Add((1 + saturationGrace) * budget)
	replies := c.Brk.RepliesSeen()
	d := newDetachedCall()
	defer d.release() // after the results below are read
	d.k, d.c, d.start = k, *c, start
	c = &d.c
	d.ctx, d.span.span = k.tel.StartAuthority(ctx, c.Acq.Want, c.Acq.Min, ln.ep)
	// Check points: at an eighth of the budget (if the process is behind
	// by then, its decisions start yielding at once, rather than after a
	// whole budget of starving the reply), where the lane's watchdog wakes
	// the waiter; then where the witness is asked (askAt, see askEarly),
	// at the budget, then every quarter budget up to the hard cap, on the
	// waiter's own timer.
	threshold := overload.Threshold(budget)
	due := start.Add(threshold)
	askAt := start.Add(budget - witnessWait(budget))
	var early *flight // the ask joined at askAt
	asked := false
	var probeAsk *flight // early, kept for judgeProbe
	// The call's own deadline lies a budget past the hard cap, so that the
	// waiter's cap decides first; go-redis honours it while waiting for a
	// pooled connection, which late readers hold longer.
	d.pending = pending{a: &d.c.Acq, ctx: d.ctx, deadline: start.Add(callLife(budget)), sent: &d.sent, own: own, checkAt: due, finish: d, k: k, c: &d.c}
	ln.submit(&d.pending, start)
	// taken completes the call with its delivered result, on the waiter's
	// goroutine.
	taken := func() (authority.Grant, error) {
		g, err := d.complete()
		d.account(err)
		k.sawLate(ctx, err, d.elapsed)
		return g, err
	}
	// settle ends the wait with what the waiter decided, unless the call
	// delivered its result first, which then wins.
	settle := func(to int32, err error) (authority.Grant, error) {
		if d.state.CompareAndSwap(callPending, to) {
			errType := ""
			if to == callGaveUp {
				if own != nil {
					k.p.judgeProbe(d, k.p.nodes.witnessOf(c.Brk, c.Acq.Key), probeAsk)
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
		return taken() // the call delivered first, which wins
	}
	var timer *time.Timer // from the first check point on
	defer func() {
		if timer != nil {
			releaseTimer(timer)
		}
	}()
	wakeIn := func(after time.Duration) {
		if timer == nil {
			timer = newTimer(after)
		} else {
			timer.Reset(after)
		}
	}
	held := false
	defer func() {
		if held {
			overload.Release()
		}
	}()
	var probe *overload.Probe
	for {
		var probed <-chan struct{}
		var ticked <-chan time.Time
		if probe != nil {
			probed = probe.Done()
		}
		if timer != nil {
			ticked = timer.C
		}
		select {
		case <-d.wake:
			if d.state.Load() == callDelivered {
				return taken()
			}
			// The watchdog's: the first check point has come.
		case <-ctx.Done():
			return settle(callLeft, ctx.Err())
		case <-probed:
		case <-ticked:
		}
		if err := deadline.Ended(ctx); err != nil {
			// ctx ended too (or its deadline passed, its timer not yet
			// run), and select chose another ready case: the caller
			// left, and that is not Redis's failure (a review: callers
			// with 99ms deadlines on a 100ms budget were blamed on
			// Redis, and got FailOpen's decisions past their deadline).
			return settle(callLeft, err)
		}
		now := time.Now()
		if !asked && !now.Before(askAt) {
			// Still no reply: the witness is asked now, so that its
			// verdict is known when the budget ends (see answers).
			early = k.p.nodes.witnessOf(c.Brk, c.Acq.Key).askEarly()
			probeAsk, asked = early, true
		}
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
			wakeIn(threshold)
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
		// At the budget's end, before Redis is blamed, it is asked on a
		// connection of leaselimit's own (see witness): if it answers,
		// the reply is held up on its way (a pool the application holds,
		// a segment retransmitted), not lost to an outage, and the call
		// waits on.
		vouched := false
		if !behind && now.Sub(start) >= budget {
			vouched = k.p.nodes.witnessOf(c.Brk, c.Acq.Key).answers(early)
			early = nil // its verdict is this one's; a later check point asks anew
		}
		if vouched && own != nil {
			// A probe of a breaker that is not closed: Redis answers,
			// and the breaker hears so now, not when the probe's own
			// reply comes. A pooled connection whose bytes were lost
			// (a blackhole: a flushed NAT entry, a middlebox that
			// failed over) held the probe, and the breaker half-open,
			// for go-redis's ReadTimeout (5 s by default), while every other call
			// went to the failure policy and Redis answered new
			// connections (a review: FailOpen decided 1.3-2.2 million
			// calls; TestProbeOnATornConnection). Its outcome is then
			// not counted again (see account).
			d.account(nil)
		}
		waitOn := behind || vouched
		var next time.Duration
		switch {
		case now.Before(askAt):
			next = askAt.Sub(now)
		case now.Sub(start) < budget:
			next = start.Add(budget).Sub(now) // look again at the budget's end
		case !waitOn:
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
		wakeIn(next)
	}
}

// judgeProbe tells the breaker the outcome of d, a probe of a breaker
// that is not closed given up at its budget (its caller gets the failure
// policy's decision then), by w's verdict on the ask the probe joined
// early (else a new one) once that ask has ended, up to its life later,
// on a goroutine Close waits for: success if Redis answered it, else the
// budget's failure. An ask on a connection made anew after an outage pays
// a dial before the script, past the witness's wait on a busy host: a
// review saw such a probe blamed while Redis answered (its ask answered in
// 72ms, the wait 50ms), the breaker open again for OpenFor, and FailOpen
// admit some 390,000 more on a spent bucket (TestProbeOnATornConnection).
// The call's own outcome is then not counted (see account).
func (p *Path) judgeProbe(d *detachedCall, w *witness, ask *flight) {
	own := d.pending.own
	if !d.told.CompareAndSwap(false, true) {
		return
	}
	p.tellWhenAnswered(w, ask, own, circuit.ErrBudget)
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
		d.wake <- struct{}{}
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

// checkPoint wakes the waiter at its first check point, on the lane's
// watchdog (see watchdog): once per call, so the channel has room.
func (d *detachedCall) checkPoint() { d.wake <- struct{}{} }

// account tells the breaker the outcome err of a call counted on its own
// (see detached), once: the first outcome told is the one counted (the
// waiter's verdict, or the call's own); a batched call's batch counts it.
func (d *detachedCall) account(err error) {
	if d.pending.own != nil && d.told.CompareAndSwap(false, true) {
		d.pending.own(err)
	}
}

// gaveUp reports whether the waiter gave up on the call and blamed Redis
// (see blame): its batch's outcome is then not the breaker's to count.
func (d *detachedCall) gaveUp() bool { return d.state.Load() == callGaveUp }

// complete is what follows the outcome of d, in d.c.Acq: its span, metrics
// and what the Receiver must know (see end; a call cut after it was sent
// is recovered by its lane, see recoverCuts), then the gate's leave. It runs
// once: on the waiter's goroutine if the waiter took the outcome, else on
// the sender's.
func (d *detachedCall) complete() (authority.Grant, error) {
	defer d.k.p.gate.leave()
	d.elapsed = time.Since(d.start)
	g, err := d.k.end(d.ctx, &d.c, &d.span, d.start, d.elapsed, d.c.Acq.Grant, d.c.Acq.Err)
	if errors.Is(err, circuit.ErrBudget) {
		// The call's own deadline lies past the hard cap: the waiter
		// decides every timeout before it, unless this process kept
		// the waiter (and likely the sender) from running.
		err = fmt.Errorf("%w: %v", ErrSaturated, err)
	}
	return g, err
}
