package leaselimit

import (
	"context"
	"errors"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/deadline"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/telemetry"
	"golang.org/x/sync/singleflight"
)

// miss decides a request the lease protocol could not decide locally
// (a.Status is Miss, or Exact for a key not seen lately, which goes to
// Redis for exactly its n with no refill): the caller joins the refill of
// its key, one per key at a time (concurrent misses of a key share one
// Redis call), and collects its decision from the tokens it brings. When
// refills keep going to other callers first, it asks Redis for exactly its
// n instead. While the breaker is not closed, a caller never waits for a
// refill another caller runs (it may be the probe): the failure policy
// decides for it at once.
func (l *Limiter) miss(ctx context.Context, key string, n int64, a lease.Answer) (Decision, error) {
	l.refunds.addReturn(a.Evicted)
	brk, rkey := l.route(l.names, key)
	if brk.Rejects(l.clock.wall) {
		return l.breakerOpen(ctx, brk, key, n)
	}
	if rkey == "" {
		rkey = l.names.Key(key)
	}
	state := brk.State() // before the call: a failing call may trip the breaker
	for a.Status == lease.Miss {
		t := a.Ticket
		l.leases.Join(t)
		var r singleflight.Result
		if l.leases.Lead(t) {
			// No refill of the key is running: this caller runs it on its
			// own goroutine (singleflight's DoChan would start one), and
			// callers that miss meanwhile wait for it with DoChan. (The
			// refill made here, apart from DoChan's, stays on the stack:
			// Do does not keep it.)
			r.Val, r.Err, r.Shared = l.sf.Do(key, l.refillOf(ctx, brk, rkey, t))
			l.leases.Led(t)
		} else {
			if brk.State() != breaker.Closed {
				// The refill running may be the breaker's probe: only
				// its own caller waits for it; this one could not have
				// made a call itself, and decides by the policy now.
				return l.breakerOpen(ctx, brk, key, n)
			}
			select {
			case r = <-l.sf.DoChan(key, l.refillOf(ctx, brk, rkey, t)):
			case <-ctx.Done():
				// The refill goes on; what it brings for us stays in the lease.
				return Decision{Source: SourceNone}, ctx.Err()
			}
		}
		if sp, ok := recording(ctx); ok {
			sp.SetAttributes(telemetry.AttrCoalesced.Bool(r.Shared), telemetry.AttrBreaker.String(state.String()))
		}
		if err := deadline.Ended(ctx); r.Err != nil && err != nil {
			return Decision{Source: SourceNone}, err
		}
		if errors.Is(r.Err, errRefillLeft) {
			// The caller that ran the refill left before the grant came
			// (the grant still goes to the lease); this one is still
			// here: it asks again.
			continue
		}
		if r.Err != nil {
			return l.onError(ctx, brk, key, n, r.Err)
		}
		a = l.leases.Collect(t, r.Val.(*refillCall).outcome, l.clock.now())
		l.refunds.addReturn(a.Evicted)
	}
	if a.Status == lease.Exact {
		return l.callExact(ctx, brk, rkey, key, n)
	}
	if a.Status == lease.Refused && l.leases.Pooled(key, n, l.clock.now()) {
		return l.pool(ctx, brk, rkey, key, n, l.decided(a))
	}
	return l.decided(a), nil
}

// pool serves a request the bucket denied though the bucket and this
// instance's lease could serve it together (see lease.Leases.Pooled): a
// request larger than the lease, which a Settle surplus joined or smaller
// requests left. The lease goes back to the bucket first, in one call per
// bucket within the budget, then the request asks Redis for exactly n. A
// lease that cannot go back now goes to the refund queue, and denied, the
// decision the bucket made, stands.
func (l *Limiter) pool(ctx context.Context, brk *circuit.Breaker, rkey, key string, n int64, denied Decision) (Decision, error) {
	r := l.leases.Surrender(key, l.clock.now())
	if r.Tokens <= 0 {
		return denied, nil
	}
	back := l.refunds.returned(r)
	for i, rf := range back {
		rf.ID = l.auth.NewID()
		if ok, err := l.send(ctx, brk, rf, false); !ok || err != nil {
			// This one is queued (see send); so must the rest be.
			for _, rest := range back[i+1:] {
				l.refunds.add(rest)
			}
			return denied, nil
		}
	}
	return l.callExact(ctx, brk, rkey, key, n)
}

// refill performs one refill of t's key: the work of the one caller that
// runs a coalesced miss or a prefetch. The call is bounded by the time
// budget; its caller may stop waiting when ctx ends, and its grant is still
// installed in the lease when it arrives (see receiver). The value is the
// *refillCall, whose outcome every waiting caller collects (a pointer, so
// that handing it through singleflight allocates nothing more).
func (l *Limiter) refill(ctx context.Context, brk *circuit.Breaker, rkey string, t lease.Ticket) (any, error) {
	r := l.leases.Plan(t, l.clock.now())
	l.refunds.addReturn(r.Expired)
	rc := &refillCall{plan: r, key: t.Key()}
	rep := l.authorize(ctx, call{brk: brk, rkey: rkey, want: r.Want, min: r.Min, share: r.Share, refill: rc,
		with: l.with(t.Key())})
	if rep.err != nil && deadline.Ended(ctx) != nil {
		return nil, errRefillLeft
	}
	if rep.err != nil {
		return nil, rep.err
	}
	return rc, nil
}

// refillOf returns the refill of t's key for singleflight. A function of
// its own so that the closure captures copies: one capturing miss's rkey,
// which miss assigns, moved rkey to the heap on every miss, a key decided
// exactly included (an allocation per cold decision).
func (l *Limiter) refillOf(ctx context.Context, brk *circuit.Breaker, rkey string, t lease.Ticket) func() (any, error) {
	return func() (any, error) { return l.refill(ctx, brk, rkey, t) }
}

// errRefillLeft is a refill's error when the caller that ran it stopped
// waiting (its ctx ended) before the grant came: the callers that waited
// with it ask again rather than take its ctx's error for theirs.
var errRefillLeft = errors.New("leaselimit: the caller running the refill left")

// prefetchSlots is how many background refills of a Client may run at
// once: half the client's connection pool (one node's pool on a Cluster; the
// slots are shared by all nodes), so that prefetches of many keys coming due
// together never queue on the pool ahead of callers that wait for a refill.
// A prefetch finding no slot is skipped; the key refills on a later hit or a
// miss. A slot is freed when its prefetch stops waiting (at the latest at
// the time budget), so against a slow Redis more calls than this can still
// be outstanding.
func prefetchSlots(pool int) int { return max(pool/2, 1) }

// prefetch refills t's key in the background before its lease runs dry
// (the protocol claimed the prefetch for this caller), sharing the refill
// with misses of the key that arrive meanwhile.
func (l *Limiter) prefetch(ctx context.Context, t lease.Ticket) {
	select {
	case l.slots <- struct{}{}:
	default:
		l.leases.Prefetched(t)
		return
	}
	ok := l.path.Spawn(func() {
		defer func() { <-l.slots }()
		defer l.leases.Prefetched(t)
		rkey := l.names.Key(t.Key())
		brk := l.path.Route(rkey)
		if brk.Rejects(l.clock.wall) {
			return
		}
		// The prefetch holds the key's refill claim (see miss), so that a
		// caller whose lease runs dry meanwhile waits for it bounded by
		// its own ctx (DoChan), rather than take the claim and join it
		// with Do, which nothing bounds: such a caller was held until the
		// prefetch ended, up to the budget, whatever its deadline
		// (TestShortDeadlineMissesDuringAPrefetch). A caller's refill
		// that holds the claim refills the lease already.
		if !l.leases.Lead(t) {
			return
		}
		defer l.leases.Led(t)
		// The request that claimed the prefetch may be over before the
		// prefetch is: its ctx carries only the trace.
		_, _, _ = l.sf.Do(t.Key(), func() (any, error) { return l.refill(context.WithoutCancel(ctx), brk, rkey, t) })
	})
	if !ok {
		<-l.slots
		l.leases.Prefetched(t)
	}
}
