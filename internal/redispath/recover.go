package redispath

import (
	"context"
	"errors"
	"io"
	"net"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/monotime"
)

// What an acquire call leaves when its reply is lost after it was sent (a
// deadline cut the read, the client's own timeout, a connection that
// broke): Redis may have run it and granted tokens that no one will use.
// A detached call runs on past its waiter, but its own deadline (see
// callLife) can cut it too, and an in-place call's deadline is its
// socket's. So one of the path's recoverers sends its invocation again
// under its resend key to learn the outcome (see authority.Redis.Resend),
// and hands each grant to its Receiver as a late reply's would be: into
// the lease for a call with Keep, back to the bucket for any other. A
// call whose outcome stays unknown (Redis did not answer in time, or its
// invocation had no resend key) is counted on ratelimit.authority.unknown,
// with the tokens it asked for: they may stay debited. Regression (the
// fleet ledger): a lease refill cut at the budget while Redis answered
// late left its whole grant debited, unseen, of which the caller's
// failure-policy decision accounted for its own tokens only: 3 of 1,500
// seeds of refused connections lost 3-28 tokens of a bucket.

// maxRecovering bounds the cut calls waiting for or being recovered at
// once: each holds a recoverer for up to half a resend key's life while Redis
// does not answer. Past it a cut call's outcome stays unknown.
const maxRecovering = 256

// outcomeUnknown reports whether err, an acquire call's error, leaves
// unknown whether Redis ran it: its connection failed after the command
// may have been written (a read or write cut by the client's timeout or by
// a context deadline, a reset, the end of the stream). Not a dial: no
// connection was made. go-redis reports a read that a context deadline
// cut as the context's error, the same as a wait for a pooled connection
// that the deadline ended before anything was sent: both count, and a
// resend of a call that never ran decides it anew, its grant then given
// back. A call go-redis retried reports its last attempt only: one whose
// last dial failed says nothing of an earlier attempt (left as it was).
func outcomeUnknown(err error) bool {
	if err == nil {
		return false // before ne and op, which escape: a call answered allocates nothing here
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var op *net.OpError
	if errors.As(err, &op) {
		return op.Op == "read" || op.Op == "write"
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// cutCall is a call whose reply a deadline cut after it was sent: the
// Caller that made it (its Limiter's telemetry and Receiver) and a copy of
// the call.
type cutCall struct {
	k *Caller
	c Call
}

// recoverCuts hands the calls of a sent batch whose replies a deadline
// cut (see outcomeUnknown) to the path's recoverers, an invocation at a
// time (the calls that share a resend key, in the batch's order): those
// with a Caller, which a detached call's pending has.
func recoverCuts(batch []*pending, sent time.Time) {
	var cut []cutCall
	for _, p := range batch {
		if p.k != nil && outcomeUnknown(p.a.Err) {
			cut = append(cut, cutCall{p.k, *p.c})
		}
	}
	for len(cut) > 0 {
		key, _ := cut[0].c.Acq.Invocation()
		var one, rest []cutCall
		for _, cc := range cut {
			if k, _ := cc.c.Acq.Invocation(); k == key {
				one = append(one, cc)
			} else {
				rest = append(rest, cc)
			}
		}
		cut[0].k.p.recoverCut(one, sent)
		cut = rest
	}
}

// recoverCut has a recoverer learn the outcome of calls, the calls of one
// invocation sent at sent whose reply a deadline cut (see
// outcomeUnknown), in the order they went. It must be called while the
// calls hold their gate entries: the recoverers are then stopped only once
// they have run it (see Path.Wait), before Close gives back the leases and
// makes its final send. Calls that are not a whole invocation with a
// resend key (see authority.Redis.Resend) are counted unknown at once.
func (p *Path) recoverCut(calls []cutCall, sent time.Time) {
	key, n := calls[0].c.Acq.Invocation()
	if key == "" || n != len(calls) {
		countUnknown(calls)
		return
	}
	if p.recovering.Add(1) > maxRecovering {
		p.recovering.Add(-1)
		countUnknown(calls)
		return
	}
	queued := time.Now()
	p.recoverers.run(func() {
		defer p.recovering.Add(-1)
		p.recover(calls, sent, queued)
	})
}

// recover is recoverCut's work, on a recoverer: the calls' outcome
// learnt, each grant goes to its Caller's Receiver as a late reply's
// would: Arrived (into the lease) for a call with Keep, Unclaimed (back
// to the bucket) for any other.
func (p *Path) recover(calls []cutCall, sent, queued time.Time) {
	as := make([]*authority.Acquisition, len(calls))
	for i := range calls {
		as[i] = &calls[i].c.Acq
	}
	if !p.learn(as, calls[0].c.Brk, sent, queued) {
		countUnknown(calls)
		return
	}
	for i := range calls {
		cc := &calls[i]
		switch g := cc.c.Acq.Grant; {
		case cc.c.Acq.Err != nil:
			// Redis answered with an error: it granted nothing.
		case cc.c.Keep:
			cc.k.recv.Arrived(cc.c, g)
		case g.Granted > 0:
			cc.k.recv.Unclaimed(cc.c, g)
		}
	}
}

// countUnknown counts the tokens calls asked for on
// ratelimit.authority.unknown: Redis may have granted them.
func countUnknown(calls []cutCall) {
	for _, cc := range calls {
		cc.k.tel.CountUnknown(context.Background(), cc.c.Acq.Want)
	}
}

// learn sends as, the calls of one invocation, again under its resend key
// until Redis answers, each attempt bounded by the budget, a budget apart,
// while the key surely holds the first sending's reply: an attempt begins
// a budget or more before half its life after sent. While brk is open,
// Redis is down and no attempt is made. Once Close has begun, one attempt
// more, if it can begin within a budget of Close or of when the recovery
// was queued, whichever is later: recoveries queued behind each other on a
// Redis that does not answer do not hold Close for a budget each. It
// reports whether Redis answered: each call's Grant, or its Err for an
// error reply, is then its outcome.
func (p *Path) learn(as []*authority.Acquisition, brk *circuit.Breaker, sent, queued time.Time) bool {
	until := sent.Add(p.auth.ResendLife() / 2)
	for {
		now := time.Now()
		closing := p.gate.isClosed()
		if c := max(p.closedAt.Load(), monotime.Of(queued)); closing && monotime.Of(now) > c+int64(p.budget) {
			return false
		}
		if !now.Add(p.budget).Before(until) {
			return false
		}
		if !brk.Rejects(p.nodes.now) {
			ctx, cancel := context.WithTimeout(context.Background(), p.budget)
			p.auth.Resend(ctx, as)
			cancel()
			if err := as[0].Err; err == nil || !circuit.NoAnswer(err) {
				return true
			}
		}
		if closing {
			return false
		}
		pause := newTimer(p.budget)
		select {
		case <-pause.C:
		case <-p.gate.done(): // Close: one attempt more
		}
		releaseTimer(pause)
	}
}
