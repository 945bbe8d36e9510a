// Package overload tells a slow process from a slow Redis.
//
// When a process is CPU-bound, the goroutine that carries a Redis reply
// waits in the Go scheduler's run queue behind every other runnable
// goroutine: the reply arrived in time, but is read late. Counted as a Redis
// failure, such a miss would open the circuit breaker and hand decisions to
// the failure policy while Redis is healthy.
//
// A Probe measures the process's own delay directly, at the moment it
// matters: a goroutine yields the processor once (runtime.Gosched puts it at
// the back of the global run queue, where preempted goroutines and
// goroutines woken by the network poller wait too) and times how long it
// takes to run again. On an idle or merely busy machine that is
// microseconds; on a saturated one it is as long as a reply would wait.
//
// Hold and Yield let a waiter whose reply is overdue ask the process's other
// decisions to yield the processor once each, so that callers which never
// block cannot starve the goroutine carrying the reply.
//
// The state is process-wide, as the scheduler is: every Limiter in a process
// shares it.
package overload

import (
	"runtime"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/internal/monotime"
)

var (
	overdue atomic.Int32 // waiters whose reply is overdue while the process is behind
	// behindAt is when a probe last found the process behind (a
	// monotime), 0 if none has.
	behindAt atomic.Int64
)

// Threshold is the scheduling delay, as a share of budget, from which the
// process is taken to be behind: an eighth. A process that keeps a ready
// goroutine waiting that long may well be sitting on a reply that arrived in
// time; on an idle machine the delay is microseconds, so a Redis slower than
// the budget is still a Redis failure.
func Threshold(budget time.Duration) time.Duration { return budget / 8 }

// A Probe is one measurement of the scheduler's delay; see Start.
type Probe struct {
	start time.Time
	took  atomic.Int64 // ns; valid once done is closed
	done  chan struct{}
}

// Start starts a probe in a goroutine run by spawn, which returns false if
// it cannot run one (the Client's Close has begun); the probe then runs on
// the caller's goroutine, which yields the processor and measures how long
// the scheduler took to give it back, and is done when Start returns.
// Regression: a probe that could not run reported no delay, so during
// Close a reply this process read late on a saturated machine was blamed
// on Redis, and FailOpen admitted while Redis answered (found by an
// adversarial review; the admission, made after Close's last send, was
// never charged).
func Start(spawn func(func()) bool) *Probe {
	p := &Probe{start: time.Now(), done: make(chan struct{})}
	if !spawn(p.run) {
		p.run()
	}
	return p
}

func (p *Probe) run() {
	runtime.Gosched()
	p.took.Store(int64(time.Since(p.start)))
	close(p.done)
}

// Done is closed when the probe has run again.
func (p *Probe) Done() <-chan struct{} { return p.done }

// Behind reports, once Done is closed or the caller gave up waiting for it,
// whether the process is behind: the probe took threshold or longer, or has
// not run yet. A positive verdict is remembered for Recent.
func (p *Probe) Behind(threshold time.Duration) bool {
	var took time.Duration
	select {
	case <-p.done:
		took = time.Duration(p.took.Load())
	default:
		took = time.Since(p.start)
	}
	if took < threshold {
		return false
	}
	MarkBehind(time.Now())
	return true
}

// Measure starts a probe, waits for it up to threshold and returns its
// verdict (see Behind): for a caller that has nothing else to wait for.
func Measure(spawn func(func()) bool, threshold time.Duration) bool {
	p := Start(spawn)
	t := time.NewTimer(threshold)
	defer t.Stop()
	select {
	case <-p.Done():
	case <-t.C:
	}
	return p.Behind(threshold)
}

// MarkBehind records that the process was found behind at now (a goroutine
// of the caller's ran a threshold or more after it was due), for Recent.
func MarkBehind(now time.Time) {
	behindAt.Store(monotime.Of(now))
}

// Recent reports whether a probe found the process behind within the last
// within before now: a cheap hint for a caller that must choose its deadline
// before it can measure.
func Recent(now time.Time, within time.Duration) bool {
	at := behindAt.Load()
	return at != 0 && monotime.Of(now)-at < int64(within)
}

// Hold marks a reply as overdue while the process is behind: until the
// matching Release, Yield gives up the processor once per call.
func Hold() { overdue.Add(1) }

// Release ends one Hold.
func Release() { overdue.Add(-1) }

// Yield gives up the processor once while some reply is overdue (a Hold is
// in force), so that the goroutine carrying it, waiting in the run queue,
// runs before callers that never block take their next turn. Otherwise it
// costs one atomic load.
func Yield() {
	if overdue.Load() > 0 {
		runtime.Gosched()
	}
}
