package redispath

import (
	"sync/atomic"

	"github.com/leaselimit/leaselimit/internal/dialstat"
	"github.com/redis/go-redis/v9"
)

// dials tells, from a single node's pool statistics, whether its dials
// fail: a pool with no connection is as empty when Redis refuses it (a
// wrong address, Redis down) as when a silent Redis's connections were
// made and then dropped at their deadlines (go-redis removes a connection
// whose read timed out before the call returns). Only the first is
// unreachable.
type dials struct {
	misses, made atomic.Uint32 // the pool's counts at the last look
	failed       atomic.Bool   // the verdict of the last look that saw a dial
}

// look takes client's counts as the baseline (a *redis.Client only; see
// Path.unreachable).
func (d *dials) look(client redis.UniversalClient) {
	if c, ok := client.(*redis.Client); ok {
		if st := c.PoolStats(); st != nil {
			d.failing(st)
		}
	}
}

// failing reports whether the pool's dials fail: since the last look it
// has needed new connections (misses) and made none (its connections, open
// or removed, did not grow). With no dial since the last look, that look's
// verdict stands.
func (d *dials) failing(st *redis.PoolStats) bool {
	now := dialstat.Of(st)
	last := dialstat.Mark{Misses: d.misses.Swap(now.Misses), Made: d.made.Swap(now.Made)}
	if last != now {
		d.failed.Store(last.Failing(now))
	}
	return d.failed.Load()
}
