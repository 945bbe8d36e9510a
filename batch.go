package leaselimit

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
// a batch forms during each round trip. The lane starts no goroutine: the
// caller that finds a free pipeline sends it, and hands the batch that
// formed meanwhile to one of its members.
type lane struct {
	auth     *authority.Redis
	max      int                // pipelines in flight at once
	fallback time.Duration      // a batch's deadline when no member has one
	ep       telemetry.Endpoint // the server the lane's calls go to, for their spans

	mu       sync.Mutex
	queue    []*pending
	inflight int
}

// pending is one call waiting in a lane.
type pending struct {
	a        authority.Acquisition
	deadline time.Time
	sent     *atomic.Int64 // if set, stamped when the call's batch is sent
	done     chan struct{} // closed when a holds the outcome, or when this call leads
	lead     []*pending    // set before done is closed: the batch this call must send
}

// maxBatch bounds a pipeline, so that one round trip never carries an
// unbounded queue and replies start flowing back early.
const maxBatch = 128

// lanePipelines is how many pipelines a lane keeps in flight at once: a
// quarter of the pool, at most 8 (so that batches leave connections to
// refunds and checks). With one, Redis sits idle while each batch's
// replies travel back; measured on the cold long tail (64 goroutines,
// exact mode), 1, 2, 4 and 8 pipelines gave 26k, 38k, 34k and 44k
// decisions/s in one noisy run.
func lanePipelines(pool int) int { return min(max(pool/4, 1), 8) }

func newLane(auth *authority.Redis, pool int, fallback time.Duration, ep telemetry.Endpoint) *lane {
	return &lane{auth: auth, max: lanePipelines(pool), fallback: fallback, ep: ep}
}

// acquire makes call a on the lane, bounded by ctx: alone if a pipeline is
// free, else in the next batch. sent, if not nil, is stamped when a's
// batch leaves. A call that leaves on ctx before its batch
// is sent is taken out of it; one whose batch is under way waits for it
// (bounded by the batch's deadline, the latest of its members').
func (ln *lane) acquire(ctx context.Context, a authority.Acquisition, sent *atomic.Int64) (authority.Grant, error) {
	p := &pending{a: a, sent: sent, done: make(chan struct{})}
	p.deadline, _ = ctx.Deadline()
	ln.mu.Lock()
	if ln.inflight < ln.max {
		ln.inflight++
		batch := ln.take(p)
		ln.mu.Unlock()
		ln.send(ctx, batch)
		return p.a.Grant, p.a.Err
	}
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
		ln.send(ctx, p.lead)
	}
	return p.a.Grant, p.a.Err
}

// take removes up to maxBatch waiting calls from the queue (after first,
// the caller's own, if not nil), in order, at
// most one per key (a pipeline go-redis resends after a broken connection
// then replays each call by its request id; see authority.AcquireAll);
// later calls on a key wait for the next batch. ln.mu must be held.
func (ln *lane) take(first *pending) []*pending {
	if len(ln.queue) == 0 {
		if first == nil {
			return nil
		}
		return []*pending{first} // an idle lane: no batch to form
	}
	batch := make([]*pending, 0, min(len(ln.queue), maxBatch)+1)
	keys := make(map[string]struct{}, cap(batch))
	if first != nil {
		batch = append(batch, first)
		keys[first.a.Key] = struct{}{}
	}
	rest := ln.queue[:0]
	for _, p := range ln.queue {
		if _, dup := keys[p.a.Key]; dup || len(batch) == maxBatch {
			rest = append(rest, p)
			continue
		}
		keys[p.a.Key] = struct{}{}
		batch = append(batch, p)
	}
	clear(ln.queue[len(rest):])
	ln.queue = rest
	return batch
}

// send sends batch as one pipeline (the caller holds one of the lane's
// pipelines), delivers each member's outcome, and passes the pipeline on
// to the batch that formed meanwhile, or frees it. ctx carries only values:
// the pipeline's deadline is its members' latest.
func (ln *lane) send(ctx context.Context, batch []*pending) {
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
		as[i] = &p.a
		if p.sent != nil {
			p.sent.Store(now)
		}
	}
	cctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	ln.auth.AcquireAll(cctx, as)
	cancel()
	ln.mu.Lock()
	next := ln.take(nil)
	if next == nil {
		ln.inflight--
	}
	ln.mu.Unlock()
	for _, p := range batch {
		if p.lead == nil { // a leader's done was closed to make it lead
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
