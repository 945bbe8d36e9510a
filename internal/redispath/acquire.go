package redispath

import (
	"context"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
)

// Acquire makes call c within the time budget. The error is the Path's
// closed error, ErrSaturated, one wrapping circuit.ErrBudget (no reply in
// the budget) or breaker.ErrOpen, ctx's, or the call's own.
//
// On a client that honours context deadlines, a call that finds its lane
// idle is made in place, on the caller's goroutine (see direct); any other
// call waits for the lane's senders (see detached). A client that does not
// honour them could hold an in-place call for its ReadTimeout, past the
// budget, so its calls are all carried by the senders.
func (k *Caller) Acquire(ctx context.Context, c Call) (authority.Grant, error) {
	if err := ctx.Err(); err != nil {
		// Ended already: no call, rather than a race between its reply
		// and ctx.Done.
		return authority.Grant{}, err
	}
	ln := k.p.nodes.laneFor(c.Brk)
	if k.p.bounded && ln.claim() {
		done, err := k.p.admit(c.Brk)
		if err != nil {
			ln.release()
			return authority.Grant{}, err
		}
		return k.direct(ctx, c, ln, done)
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
