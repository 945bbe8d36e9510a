package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
)

// Reservation is tokens taken before the cost of the work they pay for is
// known (an LLM response's tokens, a query's computed cost). Settle it once
// the cost is known: the surplus goes back, or the excess is charged, into
// debt if need be.
type Reservation struct {
	lim      *Limiter
	key      string
	estimate int64
	decision Decision
	taken    time.Time   // when the estimate was taken (a quota's window)
	settled  atomic.Bool // Settle or Cancel ran (or there was nothing to settle)
}

// Reserve takes estimate tokens of key now, like AllowN(ctx, key, estimate),
// and returns them as a Reservation to settle when the real cost is known.
// A denied Reserve takes nothing (the Reservation's Decision says so, and
// settling it does nothing). Errors are AllowN's.
//
// A Reservation never settled stays settled at its estimate. One whose
// tokens the failure policy granted (Decision.Source is SourceFallback: no
// tokens were taken from the bucket) settles to nothing: the policy decided
// for the whole request.
func (l *Limiter) Reserve(ctx context.Context, key string, estimate int64) (*Reservation, error) {
	// Stamped before the tokens are taken: a quota's window read early can
	// only make a surplus be dropped (under-admission), read late it could
	// put an old window's tokens into a new one.
	taken := time.Now()
	d, err := l.AllowN(ctx, key, estimate)
	if err != nil {
		return nil, err
	}
	r := &Reservation{lim: l, key: key, estimate: estimate, decision: d, taken: taken}
	if !d.Allowed || d.ShadowDenied || d.Source == SourceFallback {
		r.settled.Store(true) // nothing was taken from the bucket
	}
	return r, nil
}

// Decision returns the decision Reserve made.
func (r *Reservation) Decision() Decision { return r.decision }

// Settle charges the reservation its actual cost: estimate − actual tokens
// go back when actual is lower; actual − estimate more are taken when it is
// higher, even past empty. A bucket in debt denies every request until the
// debt is paid off by refill (RetryAfter counts it); it owes at most one
// Burst, and a charge beyond that is forgiven.
//
// Settle is idempotent and safe from any goroutine: the first Settle or
// Cancel applies, later ones do nothing and return nil. It works against
// this instance's lease where it can (the surplus joins the lease, the
// excess is taken from it), and against the bucket in Redis otherwise, with
// one call within the time budget; ctx's cancellation does not stop it (a
// response that ended because its client left still has to be paid for).
// While Redis cannot be reached the adjustment is queued, with the
// refunds, and applied when it is back; one whose call failed after it was
// sent is dropped (it may have been applied) and counted:
// ratelimit.lease.refunds.dropped for a surplus, ratelimit.settle.charges.dropped
// for an excess. After the Limiter's Close, Settle makes its one call on
// the caller's goroutine and returns its error.
//
// actual < 0 returns ErrInvalidCost and settles nothing.
func (r *Reservation) Settle(ctx context.Context, actual int64) error {
	if actual < 0 {
		return fmt.Errorf("%w: actual cost %d, want >= 0", ErrInvalidCost, actual)
	}
	if !r.settled.CompareAndSwap(false, true) {
		return nil
	}
	return r.lim.adjust(context.WithoutCancel(ctx), r.key, r.estimate-actual, r.taken)
}

// adjustAfterClose makes an adjustment once the Limiter is closed: one
// call on the caller's goroutine, bounded by the time budget (as far as
// the client honours context deadlines).
func (l *Limiter) adjustAfterClose(ctx context.Context, rkey string, n, window int64) error {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.timeout)
	defer cancel()
	if _, err := l.auth.Adjust(ctx, rkey, l.limit, n, window); err != nil {
		return fmt.Errorf("leaselimit: settle after Close: %w", err)
	}
	return nil
}

// sameWindow reports whether a and b fall in the same window of every
// calendar quota the Limiter enforces (always, for token buckets).
func (l *Limiter) sameWindow(a, b time.Time) bool {
	if windowOf(l.limit, a) != windowOf(l.limit, b) {
		return false
	}
	for _, p := range l.group {
		if !p.sameWindow(a, b) {
			return false
		}
	}
	return true
}

// windowOf is authority.Refund.Window for tokens of limit taken at taken:
// the end of a calendar quota's window then, 0 for a token bucket.
func windowOf(limit policy.Limit, taken time.Time) int64 {
	if !limit.IsQuota() {
		return 0
	}
	end, _ := limit.Calendar.Window(taken)
	return end.UnixMicro()
}

// settleLocally applies an adjustment of n tokens to key's live lease when
// it can: the surplus joins it, an excess it holds comes out of it. (A
// multi-limit's lease holds tokens taken from every bucket at once.)
func (l *Limiter) settleLocally(key string, n int64, taken time.Time) bool {
	if l.cfg.noLease {
		return false
	}
	now := l.clock.now()
	if n > 0 {
		if !l.sameWindow(taken, time.Now()) {
			return false // a calendar quota's tokens of an earlier window: gone
		}
		return l.leases.Give(key, n, now)
	}
	_, ok := l.leases.Held(key, -n, now)
	return ok
}

// Cancel gives the whole estimate back: Settle(ctx, 0).
func (r *Reservation) Cancel(ctx context.Context) error { return r.Settle(ctx, 0) }

// adjust gives n tokens back to key's bucket (n > 0) or takes -n more
// (n < 0): through this instance's lease when it holds a live one that can,
// else through Redis (see Settle); for a multi-limit, to every limit's
// bucket.
func (l *Limiter) adjust(ctx context.Context, key string, n int64, taken time.Time) error {
	if n == 0 || l.settleLocally(key, n, taken) {
		return nil
	}
	if l.group != nil {
		var first error
		for _, p := range l.group {
			if err := p.adjust(ctx, key, n, taken); err != nil && first == nil {
				first = err
			}
		}
		return first
	}
	brk, rkey := l.route(key)
	if rkey == "" {
		rkey = l.auth.Key(l.limit, key)
	}
	window := windowOf(l.limit, taken)
	if l.gate.isClosed() {
		return l.adjustAfterClose(ctx, rkey, n, window)
	}
	sent, err := l.oneCall(ctx, brk, func(ctx context.Context) error {
		_, err := l.auth.Adjust(ctx, rkey, l.limit, n, window)
		return err
	})
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrClosed):
		// Close began after the check above: no call was made.
		return l.adjustAfterClose(ctx, rkey, n, window)
	case !sent && errors.Is(err, ErrUnavailable):
		l.refunds.add(rkey, l.limit, n, window) // applied when Redis is back
		return nil
	case errors.Is(err, ErrUnavailable):
		l.refunds.countDropped([]authority.Refund{{Key: rkey, Limit: l.limit, Tokens: n}})
		return nil
	}
	return err
}
