package redispath

import (
	"context"
	"errors"
	"net"
	"time"

	"github.com/leaselimit/leaselimit/internal/circuit"
)

// What an acquire call leaves when a deadline cuts its reply after it was
// sent: Redis may have run it and granted tokens that no one will use. A
// detached call runs on past its waiter, but its own deadline (see
// callLife) can cut it too, and an in-place call's deadline is its
// socket's. So one of the path's recoverers sends such a call again under its
// resend key to learn its outcome (see authority.Redis.Resend), and hands
// a grant to the Receiver as a late reply's would be: into the lease for a
// call with Keep, back to the bucket for any other. A call whose outcome
// stays unknown (it went in a batch with others, or Redis did not answer
// in time) is counted on ratelimit.authority.unknown, with the tokens it
// asked for: they may stay debited. Regression (the fleet ledger): a
// lease refill cut at the budget while Redis answered late left its whole
// grant debited, unseen, of which the caller's failure-policy decision
// accounted for its own tokens only: 11 tokens lost in a round of refused
// connections.

// maxRecovering bounds the cut calls waiting for or being recovered at
// once: each holds a recoverer for up to half a resend key's life while Redis
// does not answer. Past it a cut call's outcome stays unknown.
const maxRecovering = 256

// outcomeUnknown reports whether err, an acquire call's error, leaves
// unknown whether Redis ran it: a read or write cut by a deadline (the
// client's timeout, or a context deadline the client applies to its
// socket), not a dial or a wait for a pooled connection, which never
// wrote a byte.
func outcomeUnknown(err error) bool {
	if err == nil {
		return false // before ne and op, which escape: a call answered allocates nothing here
	}
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		return false
	}
	var op *net.OpError
	return !errors.As(err, &op) || op.Op != "dial"
}

// recoverCut has a recoverer learn the outcome of c, a call sent at sent
// whose reply a deadline cut (see outcomeUnknown), and extends the gate
// entry of the call, which must not have left yet, to it: Close waits for
// it, and for the refund or lease it leads to. c is taken by value: a
// pointer to the caller's would move every call's Call to the heap.
func (k *Caller) recoverCut(c Call, sent time.Time) {
	p := k.p
	if !c.Acq.SentAlone() {
		k.tel.CountUnknown(context.Background(), c.Acq.Want)
		return
	}
	if p.recovering.Add(1) > maxRecovering {
		p.recovering.Add(-1)
		k.tel.CountUnknown(context.Background(), c.Acq.Want)
		return
	}
	p.gate.extend()
	p.recoverers.run(func() { k.recover(&c, sent) })
}

// recover is recoverCut's work on a recoverer, which holds a gate entry.
func (k *Caller) recover(c *Call, sent time.Time) {
	defer k.p.gate.leave()
	defer k.p.recovering.Add(-1)
	if !k.p.learn(c, sent) {
		k.tel.CountUnknown(context.Background(), c.Acq.Want)
		return
	}
	switch g := c.Acq.Grant; {
	case c.Acq.Err != nil:
		// Redis answered with an error: it granted nothing.
	case c.Keep:
		k.recv.Arrived(*c, g)
	case g.Granted > 0:
		k.recv.Unclaimed(*c, g)
	}
}

// learn sends c again under its resend key until Redis answers it, each
// attempt bounded by the budget, a budget apart, while the key surely
// holds the first sending's reply: an attempt begins a budget or more
// before half its life after sent. While c's breaker is open, Redis is
// down and no attempt is made; once Close has begun, one more at most. It
// reports whether Redis answered: c.Acq's Grant, or its Err for an error
// reply, is then the call's outcome.
func (p *Path) learn(c *Call, sent time.Time) bool {
	until := sent.Add(p.auth.ResendLife() / 2)
	for {
		if !time.Now().Add(p.budget).Before(until) {
			return false
		}
		if !c.Brk.Rejects(p.nodes.now) {
			ctx, cancel := context.WithTimeout(context.Background(), p.budget)
			p.auth.Resend(ctx, &c.Acq)
			cancel()
			if c.Acq.Err == nil || !circuit.NoAnswer(c.Acq.Err) {
				return true
			}
		}
		if p.gate.isClosed() {
			return false
		}
		pause := newTimer(p.budget)
		select {
		case <-pause.C:
		case <-p.gate.done(): // one more attempt, then Close has its way
		}
		releaseTimer(pause)
	}
}
