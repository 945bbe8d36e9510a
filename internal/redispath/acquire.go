package redispath

import (
	"context"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/deadline"
)

// Acquire makes call c within the time budget. c is the caller's, read
// and not kept: a Call is some 250 bytes, copied once where it must be.
// The error is the Path's closed error, ErrSaturated, one wrapping
// circuit.ErrBudget (no reply in the budget) or breaker.ErrOpen, ctx's,
// or the call's own.
//
// On a client that honours context deadlines, a call that finds its lane
// idle is made in place, on the caller's goroutine (see direct); any other
// call waits for the lane's senders (see detached). A client that does not
// honour them could hold an in-place call for its ReadTimeout, past the
// budget, so its calls are all carried by the senders.
func (k *Caller) Acquire(ctx context.Context, c *Call) (authority.Grant, error) {
	if err := deadline.Ended(ctx); err != nil {
		// Ended already: no call, rather than a race between its reply
		// and ctx.Done.
		return authority.Grant{}, err
	}
	ln := k.p.nodes.laneFor(c.Brk)
	// In place only while the breaker is closed: a probe made in place
	// ends with its caller, and one its caller cut short says nothing
	// (see callerLeft), so a half-open breaker stayed half-open while
	// Redis answered, and every other caller got the failure policy
	// (a review: 6,876-7,181 FailOpen admissions against a bound of 400
	// in 2s, callers with deadlines of 5-30ms, Redis answering in 40ms).
	// The senders carry a probe to its end whoever waits.
	if k.p.bounded && c.Brk.State() == breaker.Closed && ln.claim() {
		start := time.Now()
		limit := inPlaceLimit(start, k.p.budget)
		// A call with Keep is waited for in place until its reply or its
		// own deadline, whoever waits (see direct): a caller whose ctx
		// ends sooner would be held past its end (a review: a 3ms caller
		// leading a lease refill held about 200ms). The senders carry
		// such a call, and its caller leaves when its ctx ends.
		if !c.Keep || !endsBefore(ctx, start.Add(limit)) {
			done, err := k.p.admit(c.Brk)
			if err != nil {
				ln.release()
				return authority.Grant{}, err
			}
			return k.direct(ctx, *c, ln, done, start, limit)
		}
		ln.release()
	}
	// A detached call goes through the breaker with its batch (see
	// lane.send). While the breaker is not closed, a call goes through it
	// on its own: refused at once while it is open, or as the probe, as
	// a probe batch of every call that queued meanwhile would keep them
	// all waiting on a Redis that may still be down.
	var own func(error)
	if c.Brk.State() != breaker.Closed {
		done, err := k.p.admit(c.Brk)
		if err != nil {
			return authority.Grant{}, err
		}
		own = done
	} else if !k.p.gate.enter() {
		return authority.Grant{}, k.p.closed
	}
	return k.detached(ctx, c, ln, own)
}

// endsBefore reports whether ctx has a deadline before t.
func endsBefore(ctx context.Context, t time.Time) bool {
	d, ok := ctx.Deadline()
	return ok && d.Before(t)
}
