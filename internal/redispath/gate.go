package redispath

import (
	"sync"
	"sync/atomic"
)

// gate tracks the goroutines and Redis calls of a Limiter that Close must
// wait for, and refuses new ones once Close has begun.
type gate struct {
	mu     sync.RWMutex // orders close against enter's wg.Add
	closed atomic.Bool
	wg     sync.WaitGroup
	// closing is closed when Close begins, made at the first call of
	// done (guarded by mu): callers that sleep (WaitN) wake on it.
	closing chan struct{}
}

// done returns a channel closed once Close has begun.
func (g *gate) done() <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closing == nil {
		g.closing = make(chan struct{})
		if g.closed.Load() {
			close(g.closing)
		}
	}
	return g.closing
}

// isClosed reports whether Close has begun (one atomic load).
func (g *gate) isClosed() bool { return g.closed.Load() }

// enter registers a call that Close must wait for; leave ends it. enter
// fails once Close has begun.
func (g *gate) enter() bool {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if g.closed.Load() {
		return false
	}
	g.wg.Add(1)
	return true
}

// leave ends a call registered by enter.
func (g *gate) leave() { g.wg.Done() }

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
	if g.closed.Load() {
		return false
	}
	g.closed.Store(true)
	if g.closing != nil {
		close(g.closing)
	}
	return true
}

// wait waits for the calls and goroutines admitted before close.
func (g *gate) wait() { g.wg.Wait() }
