// Package throttle lets a kind of log line through at most once per
// interval: what an operator must know, never a line per decision.
package throttle

import (
	"sync/atomic"
	"time"
)

// Gate is one kind of line's gate; its zero value lets the first through.
type Gate struct {
	last atomic.Int64 // unix ns of the last line let through
}

// Due reports whether a line may be written now, at least every after the
// last one, and claims it.
func (g *Gate) Due(every time.Duration) bool {
	now := time.Now().UnixNano()
	last := g.last.Load()
	return (last == 0 || now-last >= int64(every)) && g.last.CompareAndSwap(last, now)
}
