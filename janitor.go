package leaselimit

import (
	"time"

	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/lease"
)

// janitor is an engine's one background goroutine: it expires leases,
// forgets idle keys (of every limit), sends refunds in batches and logs
// breaker changes.
type janitor struct {
	table   *lease.Table
	refunds *refundQueue
	path    *redispath.Path
	log     *logger
	clock   localClock
	every   time.Duration
	stop    chan struct{}
	done    chan struct{}
}

// startJanitor starts the janitor; it runs every quarter of the lease TTL,
// between 5ms and 250ms.
func startJanitor(table *lease.Table, refunds *refundQueue, path *redispath.Path, log *logger, clock localClock, ttl time.Duration) *janitor {
	j := &janitor{table: table, refunds: refunds, path: path, log: log, clock: clock,
		every: min(max(ttl/4, 5*time.Millisecond), 250*time.Millisecond),
		stop:  make(chan struct{}), done: make(chan struct{})}
	go j.run()
	return j
}

func (j *janitor) run() {
	defer close(j.done)
	t := time.NewTicker(j.every)
	defer t.Stop()
	for {
		select {
		case <-j.stop:
			return
		case <-t.C:
		}
		j.log.breakerState(j.path.State())
		j.refunds.addReturns(j.table.Sweep(j.clock.now())...)
		j.refunds.flush()
	}
}

// halt stops the janitor and waits for it.
func (j *janitor) halt() {
	close(j.stop)
	<-j.done
}
