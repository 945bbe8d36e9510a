package leaselimit

import (
	"time"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/lease"
)

// janitor is an engine's one background goroutine: it expires leases,
// forgets idle keys (of every limit), sends refunds and the failure
// policy's debts in batches and logs breaker changes.
type janitor struct {
	table   *lease.Table
	refunds *refundQueue
	debts   *debtBook
	closed  <-chan struct{} // a breaker closed: charge the debts now
	path    *redispath.Path
	log     *logger
	clock   localClock
	every   time.Duration
	was     breaker.State // the breakers' state at the last tick
	stop    chan struct{}
	done    chan struct{}
}

// startJanitor starts the janitor; it runs every quarter of the lease TTL,
// between 5ms and 250ms.
func startJanitor(table *lease.Table, refunds *refundQueue, debts *debtBook, closed <-chan struct{}, path *redispath.Path, log *logger, clock localClock, ttl time.Duration) *janitor {
	j := &janitor{table: table, refunds: refunds, debts: debts, closed: closed, path: path, log: log, clock: clock,
		every: min(max(ttl/4, 5*time.Millisecond), 250*time.Millisecond),
		stop:  make(chan struct{}), done: make(chan struct{})}
	go j.run()
	return j
}

func (j *janitor) run() {
	defer close(j.done)
	t := time.NewTicker(j.every)
	defer t.Stop()
	for j.next(t.C) {
		state := j.path.State()
		if state == breaker.Closed && j.was != breaker.Closed {
			j.table.OutageOver()
		}
		j.was = state
		j.log.breakerState(state)
		j.table.Sweep(j.clock.now(), j.refunds.addReturns)
		j.debts.move(j.refunds, j.path, false)
		j.refunds.flush()
	}
}

// next waits for the next tick, or for a breaker to close (Redis answers
// again: what the failure policy admitted meanwhile is charged before the
// next tick), and reports false once halt was called. A halt wins over a
// tick that is also due: a round can take as long as a hung Redis holds
// its refunds (the client's read timeout, when it does not apply context
// deadlines), and select picks at random among ready cases, so halt would
// otherwise wait for another such round half the time, again and again
// (Close took 25s on a silent Redis with go-redis's 5s read timeout).
func (j *janitor) next(tick <-chan time.Time) bool {
	select {
	case <-j.stop:
		return false
	case <-tick:
	case <-j.closed:
	}
	select {
	case <-j.stop:
		return false
	default:
		return true
	}
}

// halt stops the janitor and waits for it.
func (j *janitor) halt() {
	close(j.stop)
	<-j.done
}
