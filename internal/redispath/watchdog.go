package redispath

import "time"

// watchdog wakes the waiters of a lane's calls at their first check point
// (see Caller.detached): one timer per lane, armed for the earliest check
// point of the calls the lane holds, in place of a timer armed and stopped
// for every call. Most calls are answered long before their first check
// point, an eighth of the budget, so the timer mostly fires to find its
// call answered and re-arms for the next; a waiter still waiting past its
// first check point counts the rest of its wait with a timer of its own.
// Every field is guarded by the lane's mu.
type watchdog struct {
	timer   *time.Timer // made when first armed; it runs lane.bark
	at      time.Time   // when timer fires; zero while disarmed
	stopped bool
}

// watch arms the watchdog for p's check point, if p has one and the
// watchdog fires later or not at all. ln.mu is held.
func (ln *lane) watch(p *pending) {
	if p.checkAt.IsZero() || ln.dog.stopped {
		return
	}
	if ln.dog.at.IsZero() || p.checkAt.Before(ln.dog.at) {
		ln.armAt(p.checkAt)
	}
}

// armAt sets the watchdog to fire at t. ln.mu is held.
func (ln *lane) armAt(t time.Time) {
	ln.dog.at = t
	if ln.dog.timer == nil {
		ln.dog.timer = time.AfterFunc(time.Until(t), ln.bark)
		return
	}
	ln.dog.timer.Reset(time.Until(t))
}

// bark wakes the waiter of every call, queued or in flight, whose check
// point has come, once, and re-arms the watchdog for the earliest one
// still to come. A batch being delivered is no longer in flight: its
// waiters are woken by their outcomes.
func (ln *lane) bark() {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	if ln.dog.stopped {
		return
	}
	ln.dog.at = time.Time{}
	now := time.Now()
	var next time.Time
	check := func(p *pending) {
		switch {
		case p.checkAt.IsZero() || p.alarmed:
		case !p.checkAt.After(now):
			p.alarmed = true
			p.finish.checkPoint()
		case next.IsZero() || p.checkAt.Before(next):
			next = p.checkAt
		}
	}
	for _, batch := range ln.flying {
		for _, p := range batch {
			check(p)
		}
	}
	for _, p := range ln.queue {
		check(p)
	}
	if !next.IsZero() {
		ln.armAt(next)
	}
}

// stopWatchdog stops the watchdog for good; a bark already under way
// finds it stopped. ln.mu is held.
func (ln *lane) stopWatchdog() {
	ln.dog.stopped = true
	if ln.dog.timer != nil {
		ln.dog.timer.Stop()
	}
}
