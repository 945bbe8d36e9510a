package redispath

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/telemetry"
)

// lane batches the acquire calls to one Redis node (one per breaker): calls
// that arrive while the lane's pipelines are all in flight wait and travel
// together in the next one, as auto-pipelining clients do. There is no wait
// window: a call that finds a free pipeline goes at once, alone if nothing
// else waits, so an idle Limiter pays no latency for batching; under load,
// a batch forms during each round trip.
//
// Who sends a pipeline depends on the client. One that honours context
// deadlines (see honoursDeadlines) is bounded by the batch's deadline, so
// the caller that finds a free pipeline sends it on its own goroutine, and
// hands the batch that formed meanwhile to one of its members. Any other
// client may hold a read for its ReadTimeout (3s by default), far past the
// time budget, so its calls are sent by the lane's senders: at most one
// long-lived goroutine per pipeline, started when first needed and stopped
// by stop; the caller waits for its outcome, bounded by the budget, and the
// sender delivers it (see pending.finish) whether or not anyone still
// waits. No call has a goroutine of its own.
type lane struct {
	auth     *authority.Redis
	max      int                // pipelines in flight at once
	fallback time.Duration      // a batch's deadline when no member has one
	ep       telemetry.Endpoint // the server the lane's calls go to, for their spans

	mu       sync.Mutex
	queue    []*pending
	inflight int   // pipelines in flight, when callers send
	senders  *crew // one goroutine per pipeline, when they do not (see submit)
}

// pending is one call waiting in a lane.
type pending struct {
	a        *authority.Acquisition // its outcome is written in a.Grant and a.Err
	ctx      context.Context        // the caller's, for its values (the trace) only
	deadline time.Time
	sent     *atomic.Int64 // if set, stamped when the call's batch is sent

	// A call the caller sends (acquire):
	done chan struct{} // closed when a holds the outcome, or when this call leads; made only if the call queues
	lead []*pending    // set before done is closed: the batch this call must send
	one  [1]*pending   // the batch of a call that goes alone, without allocating one

	// A call a sender sends (submit): called on the sender's goroutine
	// with the outcome in a.
	finish interface{ finished(p *pending) }
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

func newLane(auth *authority.Redis, pool int, fallback time.Duration, ep telemetry.Endpoint) *lane {
	ln := &lane{auth: auth, max: lanePipelines(pool), fallback: fallback, ep: ep}
	ln.senders = newCrew(&ln.mu, ln.max, ln.nextBatch)
	return ln
}

// acquire makes call a on the lane on the caller's goroutine, bounded by
// ctx: alone if a pipeline is free, else in the next batch. sent, if not
// nil, is stamped when a's batch leaves. A call that leaves on ctx before
// its batch is sent is taken out of it; one whose batch is under way waits
// for it (bounded by the batch's deadline, the latest of its members').
// For a client that honours deadlines only (see lane).
func (ln *lane) acquire(ctx context.Context, a authority.Acquisition, sent *atomic.Int64) (authority.Grant, error) {
	p := &pending{a: &a, ctx: ctx, sent: sent}
	p.deadline, _ = ctx.Deadline()
	ln.mu.Lock()
	if ln.inflight < ln.max {
		ln.inflight++
		batch := ln.take(p)
		ln.mu.Unlock()
		ln.relay(batch)
		return p.a.Grant, p.a.Err
	}
	p.done = make(chan struct{})
	ln.queue = append(ln.queue, p)
	ln.mu.Unlock()
	select {
	case <-p.done:
	case <-ctx.Done():
		ln.mu.Lock()
		for i, q := range ln.queue {
			if q == p {
				ln.queue = append(ln.queue[:i], ln.queue[i+1:]...)
				ln.mu.Unlock()
				return authority.Grant{}, ctx.Err()
			}
		}
		ln.mu.Unlock()
		<-p.done // already in a batch: its outcome, or the lead, is coming
	}
	if p.lead != nil {
		ln.relay(p.lead)
	}
	return p.a.Grant, p.a.Err
}

// relay sends batch (the caller holds one of the lane's pipelines),
// delivers each member's outcome, and passes the pipeline on to the batch
// that formed meanwhile, or frees it.
func (ln *lane) relay(batch []*pending) {
	ln.send(batch)
	ln.mu.Lock()
	next := ln.take(nil)
	if next == nil {
		ln.inflight--
	}
	ln.mu.Unlock()
	for _, p := range batch {
		if p.done != nil && p.lead == nil { // a leader's done was closed to make it lead
			close(p.done)
		}
	}
	if next != nil {
		// The first waiting call sends the next batch; this caller
		// returns with its outcome now.
		next[0].lead = next
		close(next[0].done)
	}
}

// submit queues p for the lane's senders, which send it and call
// p.finish.finished with its outcome. p.deadline bounds its batch (the
// lane's fallback if zero). For a client that does not honour deadlines.
func (ln *lane) submit(p *pending) {
	ln.mu.Lock()
	ln.queue = append(ln.queue, p)
	ln.senders.wake()
	ln.mu.Unlock()
}

// nextBatch is the senders' next piece of work (see crew): the batch that
// waits, sent and its outcomes delivered. ln.mu is held.
func (ln *lane) nextBatch() func() {
	batch := ln.take(nil)
	if batch == nil {
		return nil
	}
	return func() {
		ln.send(batch)
		for _, p := range batch {
			p.finish.finished(p)
		}
	}
}

// stop ends the lane's senders once they have sent what is queued, and
// waits for them. Calls submitted later are never sent: the Limiter
// admits none once it is closing.
func (ln *lane) stop() { ln.senders.stop() }

// take removes up to maxBatch waiting calls from the queue (after first,
// the caller's own, if not nil), in order. Calls on one key may share a
// batch: the script decides them in order, and a batch go-redis resends
// returns its stored replies (see authority.AcquireAll). ln.mu must be
// held.
func (ln *lane) take(first *pending) []*pending {
	if len(ln.queue) == 0 {
		if first == nil {
			return nil
		}
		first.one[0] = first
		return first.one[:] // an idle lane: no batch to form
	}
	n := min(len(ln.queue), maxBatch)
	if first != nil {
		n = min(len(ln.queue), maxBatch-1)
	}
	batch := make([]*pending, 0, n+1)
	if first != nil {
		batch = append(batch, first)
	}
	batch = append(batch, ln.queue[:n]...)
	rest := copy(ln.queue, ln.queue[n:])
	clear(ln.queue[rest:])
	ln.queue = ln.queue[:rest]
	return batch
}

// send sends batch as one pipeline, each member's outcome in its a. The
// pipeline's context carries the first member's values (its trace) and
// the members' latest deadline.
func (ln *lane) send(batch []*pending) {
	var deadline time.Time
	for _, p := range batch {
		if p.deadline.After(deadline) {
			deadline = p.deadline
		}
	}
	if deadline.IsZero() {
		deadline = time.Now().Add(ln.fallback)
	}
	as := make([]*authority.Acquisition, len(batch))
	now := time.Now().UnixNano()
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
}
