package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/overload"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"go.opentelemetry.io/otel/trace"
)

// Limiter enforces one token-bucket policy.Limit per key, or several
// together, across every instance that shares the Redis deployment, the
// limit names and the prefix. Client.Limiter returns it.
//
// Redis holds the authoritative bucket of each key, updated by one atomic
// Lua script on Redis's clock. By default the Client also keeps a small
// lease of tokens for each busy key: the tokens are debited from the Redis
// bucket when the lease is granted, so most decisions are a local atomic
// operation and the fleet still never admits more than the bucket allows
// over a run. WithoutLease selects exact mode, where every decision is one
// Redis call.
//
// Most callers want Allow (or AllowN for weighted requests); Wait blocks
// until a request is admitted; Reserve takes tokens for work whose cost is
// known afterwards. While Redis is unavailable, decisions follow the
// failure policy (WithFailureMode) and carry SourceFallback; they are not
// errors.
//
// A Limiter is a view of its Client: it holds nothing to release (Close
// the Client), and its failure policy and enforcement (shadow mode) are its
// own, NewClient's by default and With's otherwise. Every view of the same
// limits decides from the same buckets and leases. A Limiter is safe for
// concurrent use.
type Limiter struct {
	*limitSet // the limits and what they keep on the engine, shared by every view of them
	view
	// err, if set, is what every call returns before it does anything:
	// the validation error of the limits, or an option With cannot take.
	err error
	// owner marks the Limiter that the deprecated New returned: its Close
	// closes the engine.
	owner bool
}

// Limit returns the limit the Limiter enforces: its only one, or the first
// of several (see Limits).
// A nil or zero Limiter's is the zero Limit, which Validate refuses.
func (l *Limiter) Limit() policy.Limit {
	if l == nil || l.limitSet == nil {
		return policy.Limit{}
	}
	return l.limit
}

// Allow is shorthand for AllowN(ctx, key, 1).
func (l *Limiter) Allow(ctx context.Context, key string) (Decision, error) {
	return l.AllowN(ctx, key, 1)
}

// AllowN reports whether n tokens may be taken for key now, and takes them if
// so (all or nothing; a denial takes nothing). n must be between 1 and the
// limit's Burst (the least Burst of several limits), and key 1 to MaxKeyLen
// bytes; other input returns ErrInvalidCost or ErrInvalidKey and touches
// nothing. So does a nil ctx (ErrNilContext) and a nil *Limiter (an error
// wrapping ErrClosed), in every method that takes a ctx.
//
// A denial is a Decision with Allowed false, not an error. Errors are
// ErrClosed, the ctx's error when ctx ends before a decision (ctx bounds
// the wait for Redis: a decision made locally, from a lease or the cache
// of a denial, is made even with a ctx already done), invalid input,
// leaselimit's own bugs (an unexpected script reply), and Redis replies that
// mean misconfiguration rather than an outage (NOPERM, WRONGTYPE). While Redis is
// unavailable the failure policy decides (SourceFallback, nil error), within
// the time budget of WithTimeout.
func (l *Limiter) AllowN(ctx context.Context, key string, n int64) (Decision, error) {
	return l.allowCounted(ctx, key, n, false)
}

// allowCounted is AllowN, traced and counted; exact makes the decision by
// asking Redis for exactly n tokens even in lease mode (see Reserve).
func (l *Limiter) allowCounted(ctx context.Context, key string, n int64, exact bool) (Decision, error) {
	if err := l.callable(ctx); err != nil {
		return Decision{Source: SourceNone}, err // before a span: there is no ctx to start it in
	}
	var span trace.Span
	if l.tel.Tracing() {
		ctx, span = l.tel.StartDecision(ctx)
	}
	d, err := l.decide(ctx, key, n, exact)
	if err == nil {
		l.tel.CountDecision(ctx, d.Allowed && !d.ShadowDenied, int(d.Source), d.Shadow)
	}
	if span != nil {
		l.tel.EndDecision(span, outcome(d, err, key, n))
	}
	return d, err
}

// decide is one decision as the caller gets it: allowN's, admitted anyway
// for a key in shadow (see WithShadow).
func (l *Limiter) decide(ctx context.Context, key string, n int64, exact bool) (Decision, error) {
	d, err := l.allowN(ctx, key, n, exact)
	if err == nil && l.enforce < 1 && !l.enforced(key) {
		d = shadowed(d)
	}
	return d, err
}

// outcome describes a finished decision (or its error) for its span.
func outcome(d Decision, err error, key string, n int64) recorder.Outcome {
	return recorder.Outcome{Allowed: d.Allowed && !d.ShadowDenied, Shadow: d.Shadow, Source: int(d.Source), Cost: n,
		Remaining: d.Remaining, RetryAfter: max(d.RetryAfter, d.shadowRetry), Key: key, Err: err, CallerError: callerError(err),
		Reason: errorReason(err)}
}

// errorReason is ratelimit.reason of a decision that ended with err.
func errorReason(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrInvalidKey):
		return "invalid_key"
	case errors.Is(err, ErrInvalidCost):
		return "invalid_cost"
	case errors.Is(err, policy.ErrInvalidLimit):
		return "invalid_limit"
	case errors.As(err, new(optionError)):
		return "invalid_option"
	case errors.Is(err, ErrClosed):
		return "closed"
	case errors.Is(err, ErrWouldExceedDeadline):
		return "would_exceed_deadline"
	case recorder.ContextReason(err) != "":
		return recorder.ContextReason(err)
	}
	return "redis_error" // a reply that is neither a decision nor an outage, or our own bug
}

// callerError reports errors that are the caller's doing (bad input or
// options, its context ending, a closed Client, a deadline too short to
// wait): not failures of leaselimit or Redis, so not marked as span errors.
func callerError(err error) bool {
	return errors.Is(err, ErrInvalidKey) || errors.Is(err, ErrInvalidCost) || errors.Is(err, ErrClosed) || errors.Is(err, policy.ErrInvalidLimit) ||
		errors.As(err, new(optionError)) ||
		errors.Is(err, ErrWouldExceedDeadline) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// recording returns the decision span in ctx if it is recording, so that
// attributes are built only when someone will see them (never the
// caller's own span, in events mode: see recorder.DecisionSpan).
func recording(ctx context.Context) (trace.Span, bool) { return recorder.DecisionSpan(ctx) }

// route returns the breaker for key and, on a Cluster (where finding the
// breaker needs it), key's Redis key under names; elsewhere rkey is "" and
// is built only when a Redis call is to be made, so breaker-open decisions
// stay cheap. Every bucket of one key is on one node (see authority.Namer),
// so the first bucket's breaker is every member's.
func (l *Limiter) route(names *keyNames, key string) (brk *circuit.Breaker, rkey string) {
	if l.path.Cluster() == nil {
		return l.path.Shared(), ""
	}
	rkey = names.Key(key)
	return l.path.Route(rkey), rkey
}

// allowN is one decision: validated, then made by the lease protocol (or,
// in exact mode or when exact is set, by Redis), asking Redis when the
// protocol says so.
func (l *Limiter) allowN(ctx context.Context, key string, n int64, exact bool) (Decision, error) {
	if err := l.usable(); err != nil {
		return Decision{Source: SourceNone}, err
	}
	// While a Redis reply is overdue because this process is behind, each
	// decision gives up the processor once, so that callers which never
	// block cannot starve the goroutine carrying that reply.
	overload.Yield()
	if err := l.check(key, n); err != nil {
		return Decision{Source: SourceNone}, err
	}
	if l.cfg.noLease || exact {
		return l.allowExact(ctx, key, n)
	}
	a := l.leases.Decide(key, n, l.clock.now())
	switch a.Status {
	case lease.Leased:
		if a.Prefetch {
			l.prefetch(ctx, a.Ticket)
		}
		return l.decided(a), nil
	case lease.Cached:
		return l.decided(a), nil
	}
	return l.miss(ctx, key, n, a)
}

// callable returns the error of a call that cannot be made at all: on a
// nil *Limiter, or a zero one that neither New nor Client.Limiter made
// (wrapping ErrClosed: nothing can be decided through it), or with a nil
// ctx (ErrNilContext). Each used to panic deep in the call, on a lease
// refill's singleflight as likely as on the caller's goroutine. It is the
// first check of every method that takes a ctx.
func (l *Limiter) callable(ctx context.Context) error {
	if err := l.present(); err != nil {
		return err
	}
	if ctx == nil {
		return ErrNilContext
	}
	return nil
}

// present returns the error of a nil *Limiter or a zero one (see
// callable), and nil for any other.
func (l *Limiter) present() error {
	if l == nil {
		return fmt.Errorf("%w: nil *Limiter", ErrClosed)
	}
	if l.limitSet == nil {
		if l.err != nil {
			return l.err // a nil or zero Client's (see Client.Limiter)
		}
		return fmt.Errorf("%w: a zero Limiter (make one with Client.Limiter)", ErrClosed)
	}
	return nil
}

// usable returns the error every call of l returns before it does
// anything: the Limiter's own (an invalid limit, an option With cannot
// take), or ErrClosed.
func (l *Limiter) usable() error {
	if l.err != nil {
		return l.err
	}
	if l.path.IsClosed() {
		return ErrClosed
	}
	return nil
}

// check validates one request for n tokens of key: n must fit every
// limit's Burst.
func (l *Limiter) check(key string, n int64) error {
	if err := checkKey(key); err != nil {
		return err
	}
	if n >= 1 && n <= l.maxCost {
		return nil
	}
	if len(l.members) > 1 {
		// The bound is the least Burst: name its limit. Regression: the
		// first limit's Burst was named, 100 where 50 was the bound.
		for _, m := range l.members {
			if m.limit.Burst == l.maxCost {
				return fmt.Errorf("%w: n = %d, want 1 <= n <= burst %d of %s (the least of the limits)", ErrInvalidCost, n, l.maxCost, m.limit.Name)
			}
		}
	}
	return fmt.Errorf("%w: n = %d, want 1 <= n <= burst %d", ErrInvalidCost, n, l.maxCost)
}

// checkKey returns ErrInvalidKey for a key outside 1 to MaxKeyLen bytes.
func checkKey(key string) error {
	if len(key) == 0 || len(key) > MaxKeyLen {
		return fmt.Errorf("%w: length %d, want 1 to %d bytes", ErrInvalidKey, len(key), MaxKeyLen)
	}
	return nil
}

// Wait is shorthand for WaitN(ctx, key, 1).
func (l *Limiter) Wait(ctx context.Context, key string) error {
	return l.WaitN(ctx, key, 1)
}

// WaitN blocks until n tokens for key are admitted, ctx ends, or the Client
// is closed (ErrClosed, at once, even mid-sleep). It fails fast, without
// waiting, for invalid input (n above the burst can never be admitted) and
// with ErrWouldExceedDeadline when a denial's RetryAfter reaches past
// ctx's deadline.
//
// WaitN reserves nothing while it sleeps: it asks again when RetryAfter
// says n tokens are due, and a key that others keep at its limit may have
// spent them first. A large n among many small requests can so wait until
// ctx ends, and ErrWouldExceedDeadline can come after sleeping, when a
// later denial's RetryAfter reaches past the deadline. A WaitN that
// returns ctx's error took no tokens, except in exact mode on a client with
// ContextTimeoutEnabled, where a call its ctx cut short may have been
// granted (under-admission).
func (l *Limiter) WaitN(ctx context.Context, key string, n int64) (err error) {
	if err := l.callable(ctx); err != nil {
		return err
	}
	var d Decision
	if l.tel.Tracing() {
		var span trace.Span
		ctx, span = l.tel.StartDecision(ctx)
		defer func() { l.tel.EndDecision(span, outcome(d, err, key, n)) }()
	}
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		d, err = l.decide(ctx, key, n, false)
		if err != nil {
			return err
		}
		l.tel.CountDecision(ctx, d.Allowed && !d.ShadowDenied, int(d.Source), d.Shadow)
		if d.Allowed {
			return nil
		}
		wait := d.RetryAfter
		// ctx's deadline is on the real clock, and so is the timer below:
		// compare the wait with it there, whatever withClock says.
		if dl, ok := ctx.Deadline(); ok && time.Now().Add(wait).After(dl) {
			return fmt.Errorf("%w: retry after %v", ErrWouldExceedDeadline, wait)
		}
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		select {
		case <-timer.C:
		case <-ctx.Done():
			return ctx.Err()
		case <-l.path.Closing():
			// A wait can last until a quota's window ends: Close must
			// not leave its caller asleep (a review: 10s past Close).
			return ErrClosed
		}
	}
}
