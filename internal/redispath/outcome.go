package redispath

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/telemetry"
	"go.opentelemetry.io/otel/trace"
)

// What follows the outcome of an acquire call, whichever variant made it:
// its span, its metrics, and what the Receiver must know.

// callSpan is a Redis call's client span that whoever finishes first ends:
// the call when it returns, or its waiter when it gives up, so that the
// span never outlives the decision span that is its parent.
type callSpan struct {
	span  trace.Span
	ended atomic.Bool
}

// finish ends s with the call's outcome, once.
func (s *callSpan) finish(tel *recorder.Recorder, granted int64, err error, errType string) {
	if s.ended.CompareAndSwap(false, true) {
		tel.FinishAuthority(s.span, granted, err, errType)
	}
}

// end is what follows a call begun at start with its outcome g, err,
// elapsed after start, once noted has told its breaker: its metrics and
// span, whether the path counts it as failed, and for a call with Keep the
// grant handed to the Receiver. A deadline overrun is marked with
// circuit.ErrBudget.
func (k *Caller) end(ctx context.Context, c *Call, span *callSpan, start time.Time, elapsed time.Duration, g authority.Grant, err error) (authority.Grant, error) {
	k.tel.RecordAuthority(ctx, elapsed, g.Granted, err, c.Keep)
	errType := ""
	if !isNetworkError(err) && errors.Is(err, context.DeadlineExceeded) && k.p.unreachable(c.Brk, start) {
		errType = "network"
	}
	span.finish(k.tel, g.Granted, err, errType)
	if err != nil && errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("%w: %w", circuit.ErrBudget, err)
		if errType == "network" {
			err = fmt.Errorf("%w: %w", circuit.ErrUnreachable, err)
		}
	}
	if err != nil {
		if circuit.Counts(err) {
			k.p.nodes.failed()
		}
		return authority.Grant{}, err
	}
	if c.Keep {
		k.recv.Arrived(*c, g)
	}
	return g, nil
}

// sawLate records a delivered call that ended past its budget: abandoned
// by its own deadline while the process was behind (ErrSaturated), or
// answered after the budget and not blamed on Redis (the waiter found the
// process behind, or was itself too late to look).
func (k *Caller) sawLate(ctx context.Context, err error, elapsed time.Duration) {
	switch {
	case errors.Is(err, ErrSaturated):
		k.sawSaturation(ctx, telemetry.SaturatedAbandoned)
		k.recv.Saturated()
	case elapsed > k.p.budget:
		k.sawSaturation(ctx, telemetry.SaturatedAnswered)
	}
}

// sawSaturation records a call that ran past its budget while the process
// was behind: on the metric, and on the decision span in ctx.
func (k *Caller) sawSaturation(ctx context.Context, outcome string) {
	k.tel.CountSaturated(ctx, outcome)
	if sp, ok := recorder.DecisionSpan(ctx); ok {
		sp.SetAttributes(telemetry.AttrSaturated.Bool(true))
	}
}
