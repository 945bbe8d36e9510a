package redispath

import (
	"sync"
	"sync/atomic"
)

// gate tracks the goroutines and Redis calls of a Limiter that Close must
// wait for, and refuses new ones once Close has begun.
//
// Every exact decision enters and leaves it, from every goroutine at once,
// so the count and the closed mark share one word: entering is a load and
// an add, leaving an add. A read-locked mutex around a WaitGroup cost
// four adds per call on contended cache lines.
type gate struct {
	// state is the number of calls entered and not yet left, plus
	// closedBit once Close has begun.
	state atomic.Int64

	mu sync.Mutex // guards closing and drained while they are made
	// closing is closed when Close begins, made at the first call of
	// done: callers that sleep (WaitN) wake on it.
	closing chan struct{}
	// drained is closed once Close has begun and every call entered
	// before it has left; made by close before it sets closedBit, so
	// that a leave that sees the bit finds it.
	drained     chan struct{}
	drainedOnce sync.Once
}

// closedBit marks state once Close has begun; the count below it never
// reaches it (a count that high would be 2^62 calls in flight).
const closedBit = int64(1) << 62

// done returns a channel closed once Close has begun.
func (g *gate) done() <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closing == nil {
		g.closing = make(chan struct{})
		if g.isClosed() {
			close(g.closing)
		}
	}
	return g.closing
}

// isClosed reports whether Close has begun (one atomic load).
func (g *gate) isClosed() bool { return g.state.Load()&closedBit != 0 }

// enter registers a call that Close must wait for; leave ends it. enter
// fails once Close has begun.
func (g *gate) enter() bool {
	// The load first: once Close has begun, refused calls leave the count
	// alone, so a flood of them (a caller looping on ErrClosed) cannot
	// keep it from reaching zero and hold wait. Only an enter racing
	// close itself adds and takes back.
	if g.isClosed() {
		return false
	}
	if g.state.Add(1)&closedBit != 0 {
		g.leave()
		return false
	}
	return true
}

// leave ends a call registered by enter (or takes back the add of an enter
// that raced close). The last to leave after Close has begun lets wait
// return; an enter racing close may bring the count back to zero once
// more, hence the Once.
func (g *gate) leave() {
	if g.state.Add(-1) == closedBit {
		g.drainedOnce.Do(func() { close(g.drained) })
	}
}

// spawn runs f in a goroutine that Close waits for; it fails once Close
// has begun.
func (g *gate) spawn(f func()) bool {
	if !g.enter() {
		return false
	}
	go func() {
		defer g.leave()
		f()
	}()
	return true
}

// close refuses new calls from now on. It reports false if the gate was
// already closed.
func (g *gate) close() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.isClosed() {
		return false
	}
	g.drained = make(chan struct{})
	if g.state.Add(closedBit) == closedBit {
		g.drainedOnce.Do(func() { close(g.drained) }) // nothing in flight
	}
	if g.closing != nil {
		close(g.closing)
	}
	return true
}

// wait waits for the calls and goroutines admitted before close; it must
// follow close.
func (g *gate) wait() {
	g.mu.Lock()
	drained := g.drained
	g.mu.Unlock()
	if drained == nil {
		panic("redispath: gate.wait before close")
	}
	<-drained
}
