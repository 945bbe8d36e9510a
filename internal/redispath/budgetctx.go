package redispath

import (
	"context"
	"sync"
	"time"
)

// budgetCtx is the context of an acquire call made in place (see direct):
// its parent's values, a deadline at the earlier of the parent's and the
// budget's end, and a Done closed when the lane's watchdog finds that
// deadline passed (see lane.bark), when the call is over (release), or at
// once if the parent had ended. The parent's cancellation later is not
// passed on: go-redis does not look for it during a read, and a wait for a
// connection ends at the deadline (context.AfterFunc on the parent would
// cost as many allocations as this type saves).
//
// It stands in for context.WithTimeoutCause, whose timer is armed and
// stopped for every call, most of them answered in a thousandth of the
// budget: the lane's watchdog is armed for each call sent alone already
// (its witness is asked at a check point before the budget ends), so the
// budget's end costs it one more comparison. On a lone caller with a
// cancellable parent, WithTimeoutCause and its cancel cost 1.3-1.8 µs of
// client CPU per decision and five allocations (benchmarks/cmd/compare
// -goroutines 1 -context-timeout -cpuprofile); a lone caller's p50 fell
// by about 4 µs without them (docs/performance.md).
//
// The deadline is what bounds the call: go-redis, with
// ContextTimeoutEnabled (the only clients whose calls are made in place),
// sets it on the socket for the write and the read, and Done ends a wait
// for a pooled connection or for a dial. A budgetCtx must be released.
type budgetCtx struct {
	context.Context // the parent, for its values
	deadline        time.Time
	// ownDeadline: deadline is the budget's end, not the parent's.
	ownDeadline bool

	mu sync.Mutex
	// done is made by the first Done, as context's own are: go-redis
	// asks for it only to wait for a connection or a dial, and a lone
	// call's context is made for every call (an allocation of 18).
	done       chan struct{}
	err, cause error // set once, when c ends (done, if made, closed)
}

// closedDone is the Done of a budgetCtx that ended before it was asked for.
var closedDone = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// newBudgetCtx returns a context for a call made in place from parent,
// whose budget ends at end.
func newBudgetCtx(parent context.Context, end time.Time) *budgetCtx {
	c := new(budgetCtx)
	c.start(parent, end)
	return c
}

// start makes c, a zero budgetCtx, the context of a call made in place
// from parent whose budget ends at end: a call sent alone keeps its
// context in the allocation that holds the call (see aloneSend).
func (c *budgetCtx) start(parent context.Context, end time.Time) {
	c.Context, c.deadline, c.ownDeadline = parent, end, true
	if d, ok := parent.Deadline(); ok && d.Before(end) {
		c.deadline, c.ownDeadline = d, false
	}
	if err := parent.Err(); err != nil {
		c.end(err, context.Cause(parent))
	}
}

func (c *budgetCtx) Deadline() (time.Time, bool) { return c.deadline, true }

func (c *budgetCtx) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		if c.err != nil {
			return closedDone
		}
		c.done = make(chan struct{})
	}
	return c.done
}

func (c *budgetCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// String names the context in a panic's or a log's message.
func (c *budgetCtx) String() string { return "redispath.budgetCtx" }

// expire ends c at its deadline: the watchdog's, once it has passed.
func (c *budgetCtx) expire() {
	cause := error(context.DeadlineExceeded)
	if c.ownDeadline {
		cause = errBudgetCut
	}
	c.end(context.DeadlineExceeded, cause)
}

// end ends c with err and its cause, unless it has ended.
func (c *budgetCtx) end(err, cause error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return
	}
	c.err, c.cause = err, cause
	if c.done != nil {
		close(c.done)
	}
}

// release ends c once its call is over, as a cancel func does.
func (c *budgetCtx) release() { c.end(context.Canceled, context.Canceled) }

// budgetEnded reports whether the budget's end, not the parent or the
// release, ended c: the watchdog expired it, or the budget's end has passed
// before the watchdog came (the socket's deadline, the same instant, can
// cut the read first). Regression (a review): a cancelled caller's call
// that ran its whole budget was Redis's failure or the caller's by which
// of the two came first, in about half the calls each.
func (c *budgetCtx) budgetEnded() bool {
	c.mu.Lock()
	cause := c.cause
	c.mu.Unlock()
	if cause != nil {
		return cause == errBudgetCut
	}
	return c.ownDeadline && !time.Now().Before(c.deadline)
}

// budgeted is the context a call made in place ran on, as callerEnded reads
// it: a budgetCtx, or a stdBudget.
type budgeted interface {
	Deadline() (time.Time, bool)
	budgetEnded() bool
}

// stdBudget is a context made by context.WithTimeoutCause with the cause
// errBudgetCut (see Path.doInPlace), as budgeted.
type stdBudget struct{ context.Context }

func (c stdBudget) budgetEnded() bool { return context.Cause(c.Context) == errBudgetCut }
