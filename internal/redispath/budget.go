package redispath

import (
	"errors"
	"sync"
	"time"
)

// The time budget's own rules, shared by every verb: how long a call is
// waited for while this process, not Redis, is behind, what a call
// abandoned then is, and the pooled timers the waiters count with.

// saturationGrace is how many budgets more a call is waited for while this
// process, not Redis, is behind (a probe found it behind, or the client's
// own queue is congested): a call waits at most (1 + saturationGrace) × the
// budget in all, 500ms with the default budget.
const saturationGrace = 4

// callLife is the context deadline of an acquire call the lane's senders
// carry, from when it was handed to them: a budget past the waiter's hard
// cap, so that the waiter decides first. No call of the path lives longer.
func callLife(budget time.Duration) time.Duration { return (2 + saturationGrace) * budget }

// ResendWindow is the longest go-redis may resend an acquire call of a
// path with this budget after Redis first ran it: the longest context
// deadline the path gives one (see authority.WithResendWindow).
func ResendWindow(budget time.Duration) time.Duration { return callLife(budget) }

// ErrSaturated marks a call abandoned at the hard cap while the process
// was still behind. It is not a Redis failure: the breaker is credited
// with the call's real outcome when it completes.
var ErrSaturated = errors.New("no reply while this process was behind its scheduler")

// timers holds stopped timers for the waiters of detached calls: a
// timer and its channel are two allocations, and most calls are answered
// long before their first check point. Since Go 1.23, Stop and Reset
// leave no stale value in a timer's channel, so a pooled timer is as good
// as a new one.
var timers sync.Pool

// newTimer returns a timer that fires after d, from the pool if it can.
func newTimer(d time.Duration) *time.Timer {
	if t, ok := timers.Get().(*time.Timer); ok {
		t.Reset(d)
		return t
	}
	return time.NewTimer(d)
}

// releaseTimer stops t and returns it to the pool.
func releaseTimer(t *time.Timer) {
	t.Stop()
	timers.Put(t)
}
