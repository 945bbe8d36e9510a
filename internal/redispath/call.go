package redispath

import (
	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/recorder"
)

// Call is one acquire call: the authority call to make through Brk, the
// breaker of its node (see Path.Route).
type Call struct {
	Brk *circuit.Breaker
	Acq authority.Acquisition
	// Keep marks a call whose grant is kept whoever waits for it (a lease
	// refill): the Receiver's Arrived gets it as soon as it arrives. A grant
	// of any other call that arrives after its caller stopped waiting goes
	// to the Receiver's Unclaimed instead.
	Keep bool
	// Tag is the root's own, for its Receiver (what a refill must
	// install); the path never reads it.
	Tag any
}

// Receiver is told what the root must do with an answer that the caller
// may not be there to take.
type Receiver interface {
	// Arrived gets the grant of a call with Keep, on the goroutine that
	// received it (the caller's, or a lane's sender), before the caller
	// gets the result.
	Arrived(c Call, g authority.Grant)
	// Unclaimed gets the grant of a call without Keep whose caller stopped
	// waiting before it arrived: no one will use its tokens.
	Unclaimed(c Call, g authority.Grant)
	// Saturated is told of a call given up at the hard cap while this
	// process was still behind (Redis may be healthy).
	Saturated()
}

// Caller makes one Limiter's acquire calls, with its telemetry and its
// Receiver. New picks one of two variants, once, by whether the client
// honours context deadlines (see Path.Caller).
//
// A call that is not answered within the budget is Redis's failure only if
// the process was keeping up: a CPU-bound process leaves the goroutine that
// carries a reply waiting in the run queue, and that delay is its own, not
// Redis's. So the waiter probes the scheduler (overload.Probe) and checks
// whether the client's own queue is the hold-up (congested); if the process
// is behind, it asks the process's decisions to yield (overload.Hold) so
// the reply's goroutine runs, and keeps waiting up to saturationGrace
// budgets more. Such a call never counts against the breaker: answered, it
// is a success; abandoned at the cap, the caller gets ErrSaturated and the
// breaker the call's real outcome.
type Caller struct {
	p    *Path
	tel  *recorder.Recorder
	recv Receiver
}

// Caller returns a Caller on p for one Limiter: its telemetry (the limit's
// name on spans and metrics) and its Receiver.
func (p *Path) Caller(tel *recorder.Recorder, recv Receiver) *Caller {
	return &Caller{p: p, tel: tel, recv: recv}
}
