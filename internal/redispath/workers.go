package redispath

import "sync"

// crew is a few long-lived goroutines that run the work of their owner's
// queue: one starts when work finds none idle (at most max in all), parks
// while the queue is empty, and stop ends them once it is drained. The
// lanes' senders and Do's workers are crews, so that no call has a
// goroutine of its own.
type crew struct {
	mu   *sync.Mutex // the owner's: it guards the owner's queue too
	work *sync.Cond
	max  int
	// next returns the next piece of work, taken from the owner's queue
	// with mu held, or nil when the queue is empty.
	next func() func()

	started, idle int
	stopped       bool
	wg            sync.WaitGroup
}

func newCrew(mu *sync.Mutex, max int, next func() func()) *crew {
	return &crew{mu: mu, work: sync.NewCond(mu), max: max, next: next}
}

// wake gets work queued to a goroutine: an idle one, or a new one while
// fewer than max run. mu must be held.
func (c *crew) wake() {
	switch {
	case c.idle > 0:
		c.work.Signal()
	case c.started < c.max && !c.stopped:
		c.started++
		c.wg.Add(1)
		go c.loop()
	}
}

// loop runs the queue's work until stop, then what is left.
func (c *crew) loop() {
	defer c.wg.Done()
	c.mu.Lock()
	for {
		f := c.next()
		for f == nil && !c.stopped {
			c.idle++
			c.work.Wait()
			c.idle--
			f = c.next()
		}
		if f == nil { // stopped, and nothing left
			c.mu.Unlock()
			return
		}
		c.mu.Unlock()
		f()
		c.mu.Lock()
	}
}

// stop ends the crew once it has run what is queued, and waits for it.
// Work queued later is never run: its owner admits none once closing.
func (c *crew) stop() {
	c.mu.Lock()
	c.stopped = true
	c.work.Broadcast()
	c.mu.Unlock()
	c.wg.Wait()
}

// maxWorkers bounds the goroutines that carry Do's calls on a client that
// does not honour deadlines: peeks, resets and settlements are rarer than
// decisions, and a call waits for a worker no longer than its budget.
const maxWorkers = 4

// workers carries Do's calls on a client that does not honour deadlines
// (and, as the path's recoverers, the resends of cut calls).
type workers struct {
	mu    sync.Mutex
	queue []func()
	crew  *crew
}

func newWorkers() *workers {
	w := &workers{}
	w.crew = newCrew(&w.mu, maxWorkers, w.pop)
	return w
}

// run queues f for a worker.
func (w *workers) run(f func()) {
	w.mu.Lock()
	w.queue = append(w.queue, f)
	w.crew.wake()
	w.mu.Unlock()
}

// pop takes the first queued call; w.mu is held.
func (w *workers) pop() func() {
	if len(w.queue) == 0 {
		return nil
	}
	f := w.queue[0]
	w.queue[0] = nil
	w.queue = w.queue[1:]
	return f
}

// stop ends the workers once they have run what is queued.
func (w *workers) stop() { w.crew.stop() }
