package design

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// The lean hand-off: the lean floor as it must be built to keep a time
// budget on a client with go-redis's default options, and nothing more.
// Such a client applies no context deadline to its reads, so a hung Redis
// would hold a caller that sends its own batch for the client's ReadTimeout
// (3s); the batches are sent instead by long-lived senders (one per batch
// in flight), and each caller waits for its outcome at most the budget.
// Same script, batches and keys as the floor. What a design pays over it
// on one goroutine is the price of the two hand-offs, caller to sender and
// back.

// leanBudget is how long a caller waits for its outcome.
const leanBudget = 100 * time.Millisecond

type leanHandoff struct {
	name  string // the design's, for its errors
	send  func(ctx context.Context, batch []*leanCall)
	keyOf func(key string) string // the Redis key of a caller's key

	mu      sync.Mutex
	work    *sync.Cond
	queue   []*leanCall
	started int // senders, at most leanMaxInFlight
	idle    int
	stopped bool
	wg      sync.WaitGroup
}

func newLeanHandoff(client *redis.Client, limit policy.Limit) (Decider, error) {
	b, err := newLeanBatches(client, limit)
	if err != nil {
		return nil, err
	}
	return newHandoff(LeanHandoff, b.send, func(key string) string { return "lean:" + key }), nil
}

// newHandoff returns design name's hand-off batching around send, which
// runs one batch, and keyOf, which names a caller's key in Redis.
func newHandoff(name string, send func(context.Context, []*leanCall), keyOf func(string) string) *leanHandoff {
	h := &leanHandoff{name: name, send: send, keyOf: keyOf}
	h.work = sync.NewCond(&h.mu)
	return h
}

func (h *leanHandoff) Allow(ctx context.Context, key string) (Result, error) {
	return h.take(ctx, key, 1)
}

// take decides a call for cost tokens of key, all or none.
func (h *leanHandoff) take(ctx context.Context, key string, cost int64) (Result, error) {
	c := &leanCall{key: h.keyOf(key), cost: cost, done: make(chan struct{})}
	h.mu.Lock()
	if h.stopped {
		h.mu.Unlock()
		return Result{}, fmt.Errorf("design: %s: closed", h.name)
	}
	h.queue = append(h.queue, c)
	switch {
	case h.idle > 0:
		h.work.Signal()
	case h.started < leanMaxInFlight:
		h.started++
		h.wg.Add(1)
		go h.sender()
	}
	h.mu.Unlock()
	timer := time.NewTimer(leanBudget)
	defer timer.Stop()
	select {
	case <-c.done:
		return Result{Allowed: c.allowed}, c.err
	case <-timer.C:
		// Denied as a fallback, as leaselimit's designs decide a call
		// their budget ends (FailClosed): the harness counts it in the
		// cell's fallbacks. An error stopped the whole run: one reply
		// held up 100 ms by a busy machine ended a 20-round run in its
		// first warm-up.
		return Result{Fallback: true}, nil
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
}

// sender sends the queued calls, a batch at a time, until Close.
func (h *leanHandoff) sender() {
	defer h.wg.Done()
	h.mu.Lock()
	for {
		for len(h.queue) == 0 && !h.stopped {
			h.idle++
			h.work.Wait()
			h.idle--
		}
		if len(h.queue) == 0 {
			h.mu.Unlock()
			return
		}
		n := min(len(h.queue), leanMaxBatch)
		batch := h.queue[:n:n]
		h.queue = h.queue[n:]
		h.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), leanBudget)
		h.send(ctx, batch)
		cancel()
		h.mu.Lock()
	}
}

// Close stops the senders once they have sent what is queued.
func (h *leanHandoff) Close() error {
	h.mu.Lock()
	h.stopped = true
	h.work.Broadcast()
	h.mu.Unlock()
	h.wg.Wait()
	return nil
}
