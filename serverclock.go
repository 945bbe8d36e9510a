package leaselimit

import (
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/internal/monotime"
)

// serverClock estimates Redis's clock from the times its replies carry,
// for a calendar quota's window that no reply names: what a failure policy
// admitted while Redis could not answer (debts.go), and a reservation's
// tokens whose grant did not say (reserve.go). Redis's clock draws a
// quota's windows, and an instance's wall clock may be minutes off it:
// named by the instance's clock, a debt run up in the first minute of a
// window, on an instance a minute behind, went to the window before and
// was dropped there (refund.lua drops an adjustment of another window):
// the window admitted 150 of a quota of 100. The estimate is Redis's time
// in its last reply that moved it, plus the time since on this process's
// monotonic clock (see monotime), so a step of the instance's wall clock
// does not move it either. Before any reply, it is the instance's clock.
type serverClock struct {
	// offset is Redis's time less this process's monotonic time, in µs, as
	// the last stored reply showed it; 0: none yet.
	offset atomic.Int64
	_      [56]byte // written by any caller: off the cache line of what is only read
}

// serverClockJitter is how far a reply must move the estimate to be
// stored. A reply's time is its script's, read here after the way back, so
// the offsets replies show scatter by their latency; storing each would
// write one shared word per call.
const serverClockJitter = int64(2 * time.Millisecond / time.Microsecond)

// observe records at (µs: Redis's TIME when a script ran; 0, unknown, is
// ignored) in a reply received at received, a reading of the Client's
// clock.
func (c *serverClock) observe(at int64, received time.Time) {
	if at <= 0 {
		return
	}
	off := at - monotime.Of(received)/int64(time.Microsecond)
	if off == 0 {
		off = 1 // 0 is "none yet"
	}
	if old := c.offset.Load(); old == 0 || off > old+serverClockJitter || off < old-serverClockJitter {
		c.offset.Store(off)
	}
}

// at returns Redis's time, as estimated, at t, a reading of the Client's
// clock: t itself before any reply.
func (c *serverClock) at(t time.Time) time.Time {
	off := c.offset.Load()
	if off == 0 {
		return t
	}
	return time.UnixMicro(monotime.Of(t)/int64(time.Microsecond) + off)
}
