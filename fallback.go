package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/deadline"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
)

// onError turns a failed authority call into the caller's result: an error
// for ctx ending, Close, leaselimit's own bugs and Redis replies that mean
// misconfiguration; the failure policy's decision for an unavailable Redis;
// a denial for a reply this process was too busy to read (see shed).
func (l *Limiter) onError(ctx context.Context, brk *circuit.Breaker, key string, n int64, err error) (Decision, error) {
	// The caller's ctx has ended, or its deadline has passed before its
	// timer ran (see deadline.Ended).
	ended := deadline.Ended(ctx)
	switch {
	case errors.Is(err, ErrClosed):
		return Decision{Source: SourceNone}, ErrClosed
	case errors.Is(err, authority.ErrScript), errors.Is(err, authority.ErrReply):
		return Decision{Source: SourceNone}, fmt.Errorf("leaselimit: %w", err)
	case errors.Is(err, errSaturated):
		// Redis may be fine; this process could not read its reply in time.
		return l.shed(ctx, brk, key, n), nil
	case ended != nil && !errors.Is(err, circuit.ErrBudget) && !errors.Is(err, breaker.ErrOpen):
		return Decision{Source: SourceNone}, ended
	case !circuit.NoAnswer(err) && !errors.Is(err, breaker.ErrOpen) && !circuit.Excluded(err):
		// Redis answered, but not with a decision: NOPERM (an ACL that is
		// too narrow), WRONGTYPE (another program's key under our prefix)
		// and the like. That is misconfiguration, not an outage: say so
		// rather than let the failure policy hide it.
		l.log.misconfig(err)
		return Decision{Source: SourceNone}, fmt.Errorf("leaselimit: redis: %w", err)
	}
	if redis.IsReadOnlyError(err) {
		l.log.readonly(err)
	}
	return l.fallback(ctx, brk, key, n, fallbackReason(err)), nil
}

// fallbackReason names why a failed call left the decision to the failure
// policy (ratelimit.reason, and the log line): the breaker held it back;
// no connection could be made (a wrong address, Redis down: the path marks
// a call it gave up on without ever connecting, since go-redis's own dial
// retries outlast the budget); a connected Redis did not answer within the
// budget; or any other outage.
func fallbackReason(err error) string {
	var te interface{ Timeout() bool }
	switch {
	case errors.Is(err, breaker.ErrOpen):
		return telemetry.ReasonBreakerOpen
	case circuit.Unreachable(err):
		return telemetry.ReasonUnreachable
	case errors.Is(err, circuit.ErrBudget), errors.Is(err, context.DeadlineExceeded),
		errors.As(err, &te) && te.Timeout():
		return telemetry.ReasonTimeout
	}
	return telemetry.ReasonError
}

// breakerOpen is the answer to a call for n tokens of key that brk does not
// let through: the failure policy's decision, unless the caller's ctx has
// ended, which gets its error as it would from a call made. Regression (a
// review): while the breaker was open, callers whose ctx was already
// cancelled were admitted by FailOpen (764 in one run) and charged to the
// key's debt.
func (l *Limiter) breakerOpen(ctx context.Context, brk *circuit.Breaker, key string, n int64) (Decision, error) {
	if err := deadline.Ended(ctx); err != nil {
		return Decision{}, err
	}
	return l.fallback(ctx, brk, key, n, telemetry.ReasonBreakerOpen), nil
}

// fallback is the failure policy's decision for n tokens of key, made for
// reason while brk holds Redis calls back or a call failed. Leases already
// held keep serving until they expire. What the policy admits is charged
// to the bucket once Redis answers again (see debtBook).
func (l *Limiter) fallback(ctx context.Context, brk *circuit.Breaker, key string, n int64, reason string) Decision {
	d := l.decideWithoutRedis(ctx, brk, key, n, reason, l.mode)
	if d.Source == SourceFallback { // not a lease's decision
		l.log.fallback(l.mode, reason)
	}
	return d
}

// shed decides n tokens of key whose Redis call was abandoned at the hard
// cap while this process, not Redis, was behind (reason "saturated"): a
// denial, whatever the failure policy, unless a lease held serves it. It
// is logged as such when the call is given up (see logger.saturated).
// Redis was answering, and the rest of the fleet was taking the bucket's
// tokens: FailOpen's admission (or FailLocal's share) here went past the
// fleet's bound (a review measured 3,017 admitted of a bucket of 3,000 on
// a flooded host), and was charged only afterwards. The failure policy is
// for a Redis that cannot answer; an instance that far behind sheds.
func (l *Limiter) shed(ctx context.Context, brk *circuit.Breaker, key string, n int64) Decision {
	return l.decideWithoutRedis(ctx, brk, key, n, telemetry.ReasonSaturated, policy.FailClosed)
}

// decideWithoutRedis is the decision, by mode, for n tokens of key that
// no Redis answer decided, for reason: a lease held first, then mode's,
// counted and traced with reason.
func (l *Limiter) decideWithoutRedis(ctx context.Context, brk *circuit.Breaker, key string, n int64, reason string, mode policy.FailureMode) Decision {
	wall := l.clock.wall()
	now := l.clock.mono(wall)
	if !l.cfg.noLease {
		if a, ok := l.leases.AllowLeased(key, n, now); ok {
			// Tokens taken from the bucket before: a lease decision,
			// not the policy's, counted and traced as such.
			return l.decided(a)
		}
	}
	l.tel.CountFallback(ctx, reason)
	if sp, ok := recording(ctx); ok {
		sp.SetAttributes(telemetry.AttrReason.String(reason))
		if reason == telemetry.ReasonBreakerOpen {
			// No call was made; after a failed call the span has the
			// state from before it, which the failure may have changed.
			sp.SetAttributes(telemetry.AttrBreaker.String(brk.State().String()))
		}
	}
	d := l.policyDecision(mode, brk, key, n, now, wall)
	if d.Allowed {
		// Admitted without the bucket: charged to it once Redis answers.
		l.owe(key, n, wall)
	}
	return d
}

// policyDecision is mode's decision for n tokens of key (the view's
// failure policy, see WithFailureMode, or FailClosed's for a shed call).
func (l *Limiter) policyDecision(mode policy.FailureMode, brk *circuit.Breaker, key string, n, now int64, wall time.Time) Decision {
	switch mode {
	case policy.FailClosed:
		return denial(l.limit, 0, l.untilProbe(brk, wall), SourceFallback)
	case policy.FailLocal:
		// Each limit's share in turn: with several, a request the second
		// denies keeps the tokens the first gave (during an outage several
		// limits can under-admit locally, never over-admit).
		var d Decision
		for _, m := range l.members {
			md := l.local(m, brk, key, n, now, wall)
			if !md.Allowed {
				return md
			}
			if len(l.members) == 1 {
				return md
			}
			// Admitted by every share: each share a part (the last
			// share's, reported alone, hid the one that refuses next).
			d.joinPart(Part{Limit: md.Limit, Remaining: md.Remaining, ResetAfter: md.ResetAfter})
		}
		d.Allowed, d.Source = true, SourceFallback
		return d
	}
	// FailOpen. Remaining is the best knowledge: what Redis last said for a
	// key seen before, else a full bucket.
	if len(l.members) == 1 {
		rem := l.leases.LastKnown(key)
		return Decision{Allowed: true, Limit: l.limit, Remaining: rem,
			ResetAfter: resetAfter(l.limit, rem), Source: SourceFallback}
	}
	// Several limits: each as a part, as FailLocal's shares and Redis's
	// decisions are (the first limit alone, reported with its burst, left
	// the others out of the response fields; a review).
	d := Decision{Allowed: true, Source: SourceFallback, Parts: make([]Part, 0, len(l.members))}
	for _, m := range l.members {
		rem := m.leases.LastKnown(key)
		d.joinPart(Part{Limit: m.limit, Remaining: rem, ResetAfter: resetAfter(m.limit, rem)})
	}
	return d
}

// joinPart adds p to d, a failure policy's admission under several
// limits: the part with the least room names the decision, and ResetAfter
// waits until every part is full, as Redis's decisions do.
func (d *Decision) joinPart(p Part) {
	if len(d.Parts) == 0 || p.Remaining < d.Remaining {
		d.Limit, d.Remaining = p.Limit, p.Remaining
	}
	d.ResetAfter = max(d.ResetAfter, p.ResetAfter)
	d.Parts = append(d.Parts, p)
}

// local is FailLocal's decision: n tokens of key's local bucket under m's
// limit, this instance's share of it (kept in m's own lease protocol, so
// every set and view with the limit draws on the one share).
func (l *Limiter) local(m *member, brk *circuit.Breaker, key string, n, now int64, wall time.Time) Decision {
	b := m.leases.AllowLocal(key, n, now)
	l.refunds.addReturn(b.Evicted)
	retry := b.RetryAfter
	if retry == lease.Never {
		// Above this instance's share: wait for Redis to come back.
		retry = l.untilProbe(brk, wall)
	}
	// The share decided: report it as the Limit, and its ResetAfter.
	share := m.leases.LocalShare()
	d := Decision{Allowed: b.Allowed, Limit: share, Remaining: b.Remaining,
		ResetAfter: share.Interval(share.Burst - b.Remaining), Source: SourceFallback}
	if !b.Allowed {
		d.RetryAfter = max(retry, time.Microsecond)
	}
	return d
}

// untilProbe is the RetryAfter of a fallback denial: until the breaker lets
// a probe through, at least the time budget.
func (l *Limiter) untilProbe(brk *circuit.Breaker, wall time.Time) time.Duration {
	retry := time.Duration(0)
	if u := brk.OpenUntil(); !u.IsZero() {
		retry = u.Sub(wall)
	}
	return max(retry, l.cfg.timeout)
}
