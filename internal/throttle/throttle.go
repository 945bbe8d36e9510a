// Package throttle lets a kind of log line through at most once per
// interval: what an operator must know, never a line per decision.
package throttle

import (
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/internal/monotime"
)

// Gate is one kind of line's gate; its zero value lets the first through.
type Gate struct {
	last atomic.Int64 // the monotime of the last line let through
}

// Due reports whether a line may be written now, at least every after the
// last one, and claims it.
func (g *Gate) Due(every time.Duration) bool {
	now := monotime.Now()
	last := g.last.Load()
	return (last == 0 || now-last >= int64(every)) && g.last.CompareAndSwap(last, now)
}
