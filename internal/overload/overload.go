// Package overload tells a slow process from a slow Redis.
//
// When a process is CPU-bound, the goroutine that carries a Redis reply
// waits in the Go scheduler's run queue behind every other runnable
// goroutine: the reply arrived in time, but is read late. Counted as a Redis
// failure, such a miss would open the circuit breaker and hand decisions to
// the failure policy while Redis is healthy. This package measures the
// process's own scheduling delay (runtime/metrics /sched/latencies:seconds,
// the time goroutines spend runnable before they run), so that a caller
// whose time budget ran out can ask whether the process, not Redis, was
// behind; and it lets a waiter ask the process's other goroutines to yield
// the processor once per decision while a reply is overdue, so the goroutine
// carrying it gets to run.
//
// The state is process-wide, as the scheduler is: every Limiter in a process
// shares it.
package overload

import (
	"runtime"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// sampleEvery is the shortest interval between two readings of the
	// scheduler histogram. A reading costs a few microseconds; callers
	// read at most this often.
	sampleEvery = 25 * time.Millisecond
	// minEvents is how many scheduling events a window needs before its
	// percentile replaces the last one. The runtime tracks one transition
	// in eight per goroutine, so a saturated process, whose goroutines are
	// preempted every 10ms, records only tens of events a second; a
	// window with fewer events stays open (up to maxWindow) instead of
	// reporting no delay.
	minEvents = 16
	// maxWindow bounds how long a window stays open for want of events:
	// past it, the percentile of whatever it holds is taken.
	maxWindow = time.Second
	// quantile of the scheduling delays taken as the process's lag.
	quantile = 0.99
)

const schedMetric = "/sched/latencies:seconds"

var state struct {
	mu      sync.Mutex // one reader at a time; guards base and sample
	base    []uint64   // bucket counts at the start of the open window
	baseAt  time.Time
	sample  []metrics.Sample
	lastAt  atomic.Int64 // unix ns of the last reading
	lag     atomic.Int64 // ns: the quantile of the last closed window
	overdue atomic.Int32 // waiters past their budget whose reply is missing
}

// Lag returns the process's recent scheduling delay: the 99th percentile of
// the time goroutines spent runnable before they ran, over the last window
// of at least sampleEvery and minEvents events (at most maxWindow). now is
// the caller's clock reading. The histogram is read at most every
// sampleEvery; other calls return the last value.
func Lag(now time.Time) time.Duration {
	n := now.UnixNano()
	if n-state.lastAt.Load() >= int64(sampleEvery) && state.mu.TryLock() {
		read(now)
		state.mu.Unlock()
	}
	return time.Duration(state.lag.Load())
}

// read takes one reading of the scheduler histogram and closes the open
// window if it holds enough events. Called with state.mu held.
func read(now time.Time) {
	state.lastAt.Store(now.UnixNano())
	if state.sample == nil {
		state.sample = []metrics.Sample{{Name: schedMetric}}
	}
	metrics.Read(state.sample)
	if state.sample[0].Value.Kind() != metrics.KindFloat64Histogram {
		return // not supported by this runtime: no lag is ever reported
	}
	h := state.sample[0].Value.Float64Histogram()
	if state.base == nil {
		state.base = append([]uint64(nil), h.Counts...)
		state.baseAt = now
		return
	}
	var events uint64
	for i, c := range h.Counts {
		events += c - state.base[i]
	}
	if events < minEvents && now.Sub(state.baseAt) < maxWindow {
		return
	}
	state.lag.Store(int64(percentile(h, state.base, events)))
	copy(state.base, h.Counts)
	state.baseAt = now
}

// percentile returns the upper bound of the bucket holding the quantile of
// the events counted in h since base.
func percentile(h *metrics.Float64Histogram, base []uint64, events uint64) time.Duration {
	if events == 0 {
		return 0
	}
	want := uint64(float64(events)*quantile + 0.5)
	var seen uint64
	for i, c := range h.Counts {
		seen += c - base[i]
		if seen >= want {
			upper := h.Buckets[i+1]
			if upper > maxWindow.Seconds() {
				upper = h.Buckets[i] // the last bucket is unbounded
			}
			return time.Duration(upper * float64(time.Second))
		}
	}
	return 0
}

// Behind reports whether a call that has not been answered within budget
// is waiting on the process rather than on Redis: the process's recent
// scheduling delay (lag) or how late the waiter itself woke past its
// deadline (late) reaches an eighth of the budget. On an idle machine both
// are microseconds, so a Redis slower than the budget is still a failure;
// a process that keeps its goroutines waiting that long in the run queue
// may well be sitting on a reply that arrived in time.
func Behind(budget, lag, late time.Duration) bool {
	threshold := budget / 8
	return lag >= threshold || late >= threshold
}

// Hold marks a reply as overdue while the process is behind: until the
// matching Release, Yield gives up the processor once per call.
func Hold() { state.overdue.Add(1) }

// Release ends one Hold.
func Release() { state.overdue.Add(-1) }

// Yield gives up the processor once while some reply is overdue (a Hold is
// in force), so that the goroutine carrying it, waiting in the run queue,
// runs before callers that never block take their next turn. Otherwise it
// costs one atomic load.
func Yield() {
	if state.overdue.Load() > 0 {
		runtime.Gosched()
	}
}
