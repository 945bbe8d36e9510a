package redispath

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/monotime"
	"github.com/leaselimit/leaselimit/internal/recorder"
)

// lane batches the acquire calls to one Redis node (one per breaker): calls
// that arrive while the lane's pipelines are all in flight wait and travel
// together in the next one, as auto-pipelining clients do. There is no wait
// window: a call that finds the lane idle goes at once, alone, so an idle
// Limiter pays no latency for batching; under load, a batch forms during
// each round trip.
//
// A call that finds the lane idle is sent by its caller, on its own
// goroutine (see claim), when the client honours context deadlines: no
// hand-off, so one caller's latency is one round trip. Every other call
// waits in the queue for the lane's senders: at most one long-lived
// goroutine per pipeline (and per batch left behind, see overdueMax),
// started when first needed and stopped by stop,
// that carry batch after batch while the queue holds calls. The caller
// waits for its outcome, bounded by the budget, and the sender delivers it
// (see pending.finish) whether or not anyone still waits. No call has a
// goroutine of its own.
type lane struct {
	auth     *authority.Redis
	brk      *circuit.Breaker  // the node's: one request per batch (see send)
	max      int               // pipelines in flight at once
	fallback time.Duration     // a batch's deadline when no member has one
	ep       recorder.Endpoint // the server the lane's calls go to, for their spans
	// witness asks the lane's node (a Cluster's node, or the single
	// node) whether it answers when the client cut a call (see
	// refusedAll); the lane closes it. witnessOf returns the witness of a
	// call's key (see nodes.witnessOf).
	witness   *witness
	witnessOf func(rkey string) *witness

	mu       sync.Mutex
	queue    []*pending
	inflight int        // pipelines in flight, whether a caller or a sender sends them
	flying   []outBatch // the senders' batches in flight, until their delivery starts
	senders  *crew      // one goroutine per pipeline
	dog      watchdog   // wakes waiters at their first check point, ends calls sent alone at their deadlines
	// swept counts the calls at the queue's head whose check point the
	// watchdog has passed: it looks at each queued call once, not at the
	// whole queue on every firing (see bark).
	swept int
	alone []aloneCall // the calls sent alone, whose witness the watchdog asks early
}

// aloneCall is a call sent alone (see sendAlone) while it is out: the
// watchdog asks the witness of its key at askAt (zero once asked, or if
// none), and keeps the ask in early, so that the verdict on a call
// without a reply is known when its budget ends (see witness.answers),
// and ends its context, budget, at its deadline.
type aloneCall struct {
	out   bool
	askAt time.Time
	rkey  string
	early *flight
	// budget, if set, is the call's context: the watchdog ends it at its
	// deadline (see budgetCtx).
	budget *budgetCtx
}

// outBatch is a batch a sender has sent, and its deadline.
type outBatch struct {
	calls []*pending
	until time.Time
}

// overdueMax is how many of a lane's batches past their deadline, still
// unanswered, may be left behind: their pipelines then no longer count
// against the lane's. On a client that does not bound its reads by the
// deadline, a batch sent on a connection whose bytes were lost (a
// blackhole, a flushed NAT entry) holds its pipeline for go-redis's
// ReadTimeout (5 s by default): with both held, every call after Redis
// came back waited to the hard cap and was denied until then (a review). The pool
// has other connections; a Redis that hangs for good is sent at most
// this many more batches.
const overdueMax = 4

// pending is one call waiting in a lane.
type pending struct {
	a        *authority.Acquisition // its outcome is written in a.Grant and a.Err
	ctx      context.Context        // the caller's, for its values (the trace) only
	deadline time.Time
	sent     *atomic.Int64 // if set, stamped when the call's batch is sent
	// own, if set, is the breaker's done of a call counted on its own (see
	// Caller.detached): its batch's breaker request leaves it out.
	own func(error)
	// checkAt, if set, is the waiter's first check point: the lane's
	// watchdog calls finish.checkPoint then, once (alarmed), unless the
	// call's delivery has started.
	checkAt time.Time
	alarmed bool // guarded by the lane's mu
	finish  finisher
	// k and c, if set, are the Caller and the call itself (a detached
	// call's): one whose reply a deadline cut after it was sent is
	// recovered from them (see recoverCuts).
	k *Caller
	c *Call
}

// finisher is what a lane tells of a call: finished is called on the
// sender's goroutine with the outcome in p.a; gaveUp reports whether the
// waiter gave up and blamed Redis already; checkPoint is the watchdog's
// call at p.checkAt, with the lane's mu held, so it must not block.
type finisher interface {
	finished(p *pending)
	gaveUp() bool
	checkPoint()
}

// maxBatch bounds a pipeline, so that one round trip never carries an
// unbounded queue and replies start flowing back early.
const maxBatch = 128

// lanePipelines is how many pipelines a lane keeps in flight at once: two,
// so that Redis works on one batch while the other's replies travel back
// and the next forms. More make smaller batches, and each batch has a
// fixed cost on Redis (a script call, a clock read, its resend key): in
// one interleaved run (benchmarks/cmd/compare -short, exact mode, 64
// goroutines) 2 pipelines gave 126k decisions/s on one hot key and 76k on
// 10k keys where 5 gave 89k and 64k. A pool too small for two (one
// connection) keeps one.
func lanePipelines(pool int) int { return min(pool, 2) }

func newLane(auth *authority.Redis, brk *circuit.Breaker, pool int, fallback time.Duration, ep recorder.Endpoint, w *witness) *lane {
	ln := &lane{auth: auth, brk: brk, max: lanePipelines(pool), fallback: fallback, ep: ep, witness: w}
	ln.witnessOf = func(string) *witness { return w }
	ln.senders = newCrew(&ln.mu, ln.max+overdueMax, ln.nextBatch)
	ln.dog.fire = ln.bark
	return ln
}

// claim takes one of the lane's pipelines for a call its caller sends
// alone (see sendAlone), if the lane is idle: a pipeline is free and no
// call waits, so sending now overtakes no one.
func (ln *lane) claim() bool {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	if ln.inflight < ln.max && len(ln.queue) == 0 {
		ln.inflight++
		return true
	}
	return false
}

// aloneSend is a call sent alone (see sendAlone) with the one-element
// list AcquireAll takes and its context, if it has a budget of its own
// (see direct): the call escapes into its batch, and the three took an
// allocation each.
type aloneSend struct {
	c      Call
	as     [1]*authority.Acquisition
	budget budgetCtx
}

// sendAlone sends one's call on the caller's goroutine, bounded by ctx,
// with the pipeline claim took; its outcome is in one.c.Acq. If it is still out at
// askAt (unless zero), the watchdog asks its witness (see bark), and that
// ask is returned (else nil); if budget is set (ctx is made from it), the
// watchdog ends it at its deadline. The pipeline then goes back to the
// lane, and the senders carry what queued meanwhile.
func (ln *lane) sendAlone(ctx context.Context, budget *budgetCtx, one *aloneSend, askAt time.Time) (early *flight) {
	a := &one.c.Acq
	i := -1
	if !askAt.IsZero() || budget != nil {
		ln.mu.Lock()
		i = slices.IndexFunc(ln.alone, func(c aloneCall) bool { return !c.out })
		if i < 0 {
			i = len(ln.alone)
			ln.alone = append(ln.alone, aloneCall{})
		}
		ln.alone[i] = aloneCall{out: true, askAt: askAt, rkey: a.Key, budget: budget}
		at := askAt
		if budget != nil {
			at = earliest(at, budget.deadline)
		}
		ln.dog.armFor(at)
		ln.mu.Unlock()
	}
	one.as[0] = a
	ln.auth.AcquireAll(ctx, one.as[:])
	ln.mu.Lock()
	if i >= 0 {
		early = ln.alone[i].early
		ln.alone[i] = aloneCall{}
	}
	ln.freePipeline()
	ln.mu.Unlock()
	return early
}

// release gives back the pipeline claim took; the senders carry what
// queued meanwhile.
func (ln *lane) release() {
	ln.mu.Lock()
	ln.freePipeline()
	ln.mu.Unlock()
}

// freePipeline gives back a pipeline claim took, and wakes a sender if a
// call waits. ln.mu is held.
func (ln *lane) freePipeline() {
	ln.inflight--
	if len(ln.queue) > 0 {
		ln.senders.wake()
	}
}

// submit queues p for the lane's senders, which send it and call
// p.finish.finished with its outcome. p.deadline bounds its batch (the
// lane's fallback if zero); the watchdog wakes its waiter at p.checkAt.
// now is the caller's latest reading of the clock (a queued call would
// otherwise read it once more, while both pipelines are busy).
func (ln *lane) submit(p *pending, now time.Time) {
	ln.mu.Lock()
	ln.queue = append(ln.queue, p)
	if !p.checkAt.IsZero() {
		ln.dog.armFor(p.checkAt)
	}
	if ln.inflight < ln.max || ln.held(now) < ln.max {
		// Else a sender takes the queue when its batch lands: an idle
		// one (see overdueMax) woken now would find no pipeline free.
		ln.senders.wake()
	}
	ln.mu.Unlock()
}

// nextBatch is the senders' next piece of work (see crew): the batch that
// waits, if a pipeline is free, sent and its outcomes delivered. ln.mu is
// held.
func (ln *lane) nextBatch() func() {
	now := time.Now()
	if ln.held(now) >= ln.max {
		return nil // sendAlone wakes a sender when it frees its pipeline
	}
	batch := ln.take()
	if batch == nil {
		return nil
	}
	ln.inflight++
	until := batchDeadline(batch, now.Add(ln.fallback))
	ln.flying = append(ln.flying, outBatch{batch, until})
	return func() {
		ln.send(batch, until)
		ln.mu.Lock()
		ln.inflight--
		ln.land(batch)
		ln.mu.Unlock()
		for _, p := range batch {
			p.finish.finished(p)
		}
	}
}

// land removes batch, whose delivery starts, from the batches in flight.
// ln.mu is held.
func (ln *lane) land(batch []*pending) {
	for i, b := range ln.flying {
		if &b.calls[0] == &batch[0] {
			last := len(ln.flying) - 1
			ln.flying[i], ln.flying[last] = ln.flying[last], outBatch{}
			ln.flying = ln.flying[:last]
			return
		}
	}
}

// held is how many of the lane's pipelines hold it at now: those in
// flight, but for up to overdueMax of the senders' batches past their
// deadline. ln.mu is held.
func (ln *lane) held(now time.Time) int {
	overdue := 0
	for _, b := range ln.flying {
		if !b.until.After(now) {
			overdue++
		}
	}
	return ln.inflight - min(overdue, overdueMax)
}

// nextOverdue is the earliest deadline after now of the senders' batches
// in flight (zero if none): when the next of them is left behind. ln.mu is
// held.
func (ln *lane) nextOverdue(now time.Time) time.Time {
	var next time.Time
	for _, b := range ln.flying {
		if b.until.After(now) && (next.IsZero() || b.until.Before(next)) {
			next = b.until
		}
	}
	return next
}

// batchDeadline is the latest deadline of batch's calls, or fallback if
// none has one.
func batchDeadline(batch []*pending, fallback time.Time) time.Time {
	var deadline time.Time
	for _, p := range batch {
		if p.deadline.After(deadline) {
			deadline = p.deadline
		}
	}
	if deadline.IsZero() {
		return fallback
	}
	return deadline
}

// bark is the watchdog's firing: it wakes the waiter of every call, queued
// or in flight, whose check point has come, once, asks the witness for
// every call sent alone whose askAt has come, ends the context of every
// call sent alone whose deadline has passed, and arms the watchdog for
// the earliest of those still to come. A batch being delivered is no longer
// in flight: its waiters are woken by their outcomes.
func (ln *lane) bark() {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	if !ln.dog.fired() {
		return
	}
	now := time.Now()
	var next time.Time
	// check wakes p if its check point has come, and reports whether it
	// has or p has none.
	check := func(p *pending) bool {
		switch {
		case p.checkAt.IsZero() || p.alarmed:
		case !p.checkAt.After(now):
			p.alarmed = true
			p.finish.checkPoint()
		default:
			next = earliest(next, p.checkAt)
			return false
		}
		return true
	}
	for _, b := range ln.flying { // at most a few pipelines of maxBatch
		for _, p := range b.calls {
			check(p)
		}
	}
	// The queue is in the order the calls were submitted, so in the order
	// of their check points (up to the moment between a caller reading the
	// clock and queueing its call): the first whose check point is still
	// to come ends the sweep, and the next sweep starts there.
	for ln.swept < len(ln.queue) && check(ln.queue[ln.swept]) {
		ln.swept++
	}
	for i := range ln.alone {
		c := &ln.alone[i]
		if !c.out {
			continue
		}
		switch {
		case c.askAt.IsZero():
		case c.askAt.After(now):
			next = earliest(next, c.askAt)
		default:
			c.askAt = time.Time{}
			c.early = ln.witnessOf(c.rkey).askEarly() // takes no lock of a lane's
		}
		if c.budget != nil {
			if d := c.budget.deadline; d.After(now) {
				next = earliest(next, d)
			} else {
				c.budget.expire() // takes no lock of a lane's
				c.budget = nil
			}
		}
	}
	if len(ln.queue) > 0 && ln.inflight >= ln.max {
		// Calls wait while every pipeline is held. A batch in flight that
		// passes its deadline no longer holds one (see overdueMax), but
		// nothing else wakes a sender then: a call queued just before
		// waited to its hard cap with a pipeline free, and was denied
		// (a review: 501ms, queued 50ms before the lost batches were
		// overdue). The watchdog wakes one when it can send, and fires
		// again at the next batch's deadline until then. (While fewer
		// pipelines are in flight, the sender whose batch landed, or
		// submit, takes the queue: a sender woken here as well would
		// only idle, one more goroutine for every other wake to stir.)
		if ln.held(now) < ln.max {
			ln.senders.wake()
		} else if u := ln.nextOverdue(now); !u.IsZero() {
			next = earliest(next, u)
		}
	}
	if !next.IsZero() {
		ln.dog.armFor(next)
	}
}

// earliest returns the earlier of t and u, where a zero t is none.
func earliest(t, u time.Time) time.Time {
	if t.IsZero() || u.Before(t) {
		return u
	}
	return t
}

// stop ends the lane's senders once they have sent what is queued, and
// waits for them, and stops its watchdog. Calls submitted later are never
// sent: the Limiter admits none once it is closing.
func (ln *lane) stop() {
	ln.senders.stop()
	ln.mu.Lock()
	ln.dog.stop()
	ln.mu.Unlock()
	ln.witness.close()
}

// take removes up to maxBatch waiting calls from the queue, in order.
// Calls on one key may share a batch: the script decides them in order,
// and a batch go-redis resends returns its stored replies (see
// authority.AcquireAll). ln.mu must be held.
func (ln *lane) take() []*pending {
	if len(ln.queue) == 0 {
		return nil
	}
	n := min(len(ln.queue), maxBatch)
	batch := make([]*pending, n)
	copy(batch, ln.queue)
	rest := copy(ln.queue, ln.queue[n:])
	clear(ln.queue[rest:])
	ln.queue = ln.queue[:rest]
	ln.swept = max(ln.swept-n, 0)
	return batch
}

// send sends batch as one pipeline, each member's outcome in its a. The
// pipeline's context carries the first member's values (its trace) and
// deadline, the members' latest (see batchDeadline).
//
// The batch is one request of the node's breaker, as one round trip to
// Redis, counted once (see batchOutcome). Its members were admitted when
// they arrived (see Caller.Acquire), so it is sent even if the breaker has
// opened since, and then goes uncounted: the answers it brings (denials
// that set a key's negative cache among them) are worth more than failing
// calls already made. Uncounted too while the breaker is due for a probe:
// the probe is a call of its own, vouched for by the witness (see
// Caller.detached), and a batch in its place, on a pooled connection whose
// bytes were lost, held the breaker half-open until go-redis's
// ReadTimeout (TestStaleBatchIsNoProbe). Members counted on their own
// (own: a probe while the breaker was not closed) are left out of the
// batch's request.
func (ln *lane) send(batch []*pending, deadline time.Time) {
	counted := false // a member the batch's request counts
	for _, p := range batch {
		counted = counted || p.own == nil
	}
	var done func(error)
	if counted && ln.brk.State() == breaker.Closed {
		done, _ = ln.brk.Allow() // nil if refused: the batch goes uncounted
	}
	as := make([]*authority.Acquisition, len(batch))
	now := monotime.Now()
	for i, p := range batch {
		as[i] = p.a
		if p.sent != nil {
			p.sent.Store(now)
		}
	}
	ctx := batch[0].ctx
	if ctx == nil {
		ctx = context.Background()
	}
	cctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	ln.auth.AcquireAll(cctx, as)
	cancel()
	recoverCuts(batch, monotime.Time(now)) // before the witness's verdicts replace the errors it reads
	refusedAll(as, ln.witnessOf)
	if done != nil {
		done(batchOutcome(batch))
	}
}

// batchOutcome is what the breaker counts for a sent batch: nothing (an
// excluded error) if a member's waiter gave up on it and blamed Redis
// already; else the first member error that counts against the breaker,
// else the first error (excluded: a reply that is not an outage), else
// success. The batch's own deadline lies past every member's hard cap
// (see Caller.detached), so reaching it means this process kept the
// sender from reading the reply, not that Redis failed (as complete says
// of each call): it is ErrSaturated, which the breaker does not count.
func batchOutcome(batch []*pending) error {
	var first error
	for _, p := range batch {
		if p.own != nil {
			continue // counted on its own
		}
		if p.finish.gaveUp() {
			return context.Canceled
		}
		if err := p.a.Err; err != nil {
			switch {
			case errors.Is(err, context.DeadlineExceeded):
				err = ErrSaturated
			case circuit.Counts(err):
				return err
			}
			if first == nil {
				first = err
			}
		}
	}
	return first
}
