package redispath

import "time"

// watchdog is one timer that fires at the earliest of the times it is
// armed for. A lane wakes its waiting calls at their first check point
// with it (see lane.bark), and ends the contexts of the calls sent alone at
// their deadlines (see budgetCtx), in place of a timer armed and stopped
// for every call: most calls are answered long before their first check point, an
// eighth of the budget, so it mostly fires to find its call answered, and
// is armed again for the next. Its owner's lock guards it.
type watchdog struct {
	fire    func() // run on the timer's goroutine when it fires
	timer   *time.Timer
	at      time.Time // when timer fires; zero while disarmed
	stopped bool
}

// armFor makes the watchdog fire at t, unless it fires sooner already or
// was stopped.
func (w *watchdog) armFor(t time.Time) {
	if w.stopped || (!w.at.IsZero() && !t.Before(w.at)) {
		return
	}
	w.at = t
	if w.timer == nil {
		w.timer = time.AfterFunc(time.Until(t), w.fire)
		return
	}
	w.timer.Reset(time.Until(t))
}

// fired notes that the timer fired, which disarms it. It reports false
// once the watchdog is stopped: a firing under way then does nothing.
func (w *watchdog) fired() bool {
	if w.stopped {
		return false
	}
	w.at = time.Time{}
	return true
}

// stop disarms the watchdog for good.
func (w *watchdog) stop() {
	w.stopped = true
	if w.timer != nil {
		w.timer.Stop()
	}
}
