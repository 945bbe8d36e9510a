package leaselimit

import (
	"context"
	"errors"

	"github.com/leaselimit/leaselimit/authority"
)

// ErrUnavailable is wrapped by the errors of Peek and Reset when Redis
// cannot be asked (the breaker is open) or does not answer in the time
// budget: they read or write the bucket itself, so no failure policy can
// answer for them.
var ErrUnavailable = errors.New("leaselimit: redis unavailable")

// Peek returns key's bucket as it is now, without taking anything:
// Remaining counts the bucket's tokens and those this instance holds in
// leases for key (taken from the bucket already, but still to be spent);
// RetryAfter is how long until a request for one token here would be
// admitted (0 when it would be now); ResetAfter is how long until the
// bucket is full; Allowed reports whether a request for one token would be
// admitted now, as far as the bucket and this instance know (other
// instances' leases are not counted: they were taken from the bucket).
// Source is SourceAuthority. With leases, an instance that was just denied
// keeps denying from its negative cache until a batch of tokens has
// accrued (see docs/semantics.md, "Negative cache"): Peek then says
// Allowed false and RetryAfter until the cache ends, though Remaining,
// the bucket's, may be above zero.
// With several limits, Parts holds each limit's bucket, and the Decision
// is the most restrictive: the one that makes a one-token request wait
// longest, or, when every one would admit it, the one with the fewest
// tokens.
//
// Peek makes one Redis call per limit, a script that reads the bucket and
// Redis's clock and writes nothing; it changes no local state either.
// While Redis is unavailable it returns an error wrapping ErrUnavailable.
func (l *Limiter) Peek(ctx context.Context, key string) (Decision, error) {
	if err := l.callable(ctx); err != nil {
		return Decision{Source: SourceNone}, err
	}
	if err := l.usable(); err != nil {
		return Decision{Source: SourceNone}, err
	}
	if err := checkKey(key); err != nil {
		return Decision{Source: SourceNone}, err
	}
	// What this instance holds is read before and after the buckets, and
	// the lesser counted: a refill (or a lease given back) between the two
	// reads moves tokens between a bucket and a lease, and must not be
	// counted twice. Each limit's own lease is read around its bucket (see
	// peekBucket), a joint lease of several around them all.
	joint := l.jointOutstanding(key)
	var pds [MaxLimits]Decision
	for i, m := range l.members {
		pd, err := l.peekBucket(ctx, m, key)
		if err != nil {
			return Decision{Source: SourceNone}, err
		}
		pds[i] = pd
	}
	joint = min(joint, l.jointOutstanding(key))
	var d Decision
	parts := make([]Part, len(l.members))
	for i, pd := range pds[:len(l.members)] {
		if joint > 0 {
			// Taken from every bucket: available in each.
			pd.Remaining = min(pd.Remaining+joint, pd.Limit.Burst)
			pd.RetryAfter, pd.Allowed = 0, true
		}
		parts[i] = Part{Limit: pd.Limit, Remaining: pd.Remaining, ResetAfter: pd.ResetAfter}
		worse := pd.RetryAfter > d.RetryAfter || (pd.RetryAfter == d.RetryAfter && pd.Remaining < d.Remaining)
		if i == 0 || worse {
			d = pd
		}
	}
	for _, p := range parts {
		d.ResetAfter = max(d.ResetAfter, p.ResetAfter)
	}
	if !l.cfg.noLease {
		// This instance denies from its negative cache until a batch
		// has accrued, whatever the bucket holds meanwhile: say what
		// the next Allow here will, and when it will admit (the
		// bucket's own RetryAfter may come sooner than the cache ends).
		if denied, wait := l.leases.Cached(key, l.clock.now()); denied {
			d.Allowed, d.RetryAfter = false, max(d.RetryAfter, wait)
		}
	}
	if len(parts) > 1 {
		d.Parts = parts // a Decision of one limit has none (see Decision.Parts)
	}
	return d, nil
}

// peekBucket reads key's bucket under m's limit, and counts the tokens of
// it that m's own lease holds here (see Peek).
func (l *Limiter) peekBucket(ctx context.Context, m *member, key string) (Decision, error) {
	brk, rkey := l.route(m.names, key)
	if rkey == "" {
		rkey = m.names.Key(key)
	}
	var b authority.Bucket
	before := m.leases.Outstanding(key, l.clock.now())
	_, err := l.path.Do(ctx, brk, rkey, func(ctx context.Context) (err error) {
		b, err = l.auth.Peek(ctx, rkey, m.limit)
		return err
	})
	if err != nil {
		return Decision{}, err
	}
	lim := m.limit
	d := Decision{Limit: lim, Remaining: b.Tokens, RetryAfter: b.RetryAfter, ResetAfter: b.ResetAfter, Source: SourceAuthority}
	if held := min(before, m.leases.Outstanding(key, l.clock.now())); held > 0 {
		d.Remaining = min(b.Tokens+held, lim.Burst)
		d.RetryAfter = 0
		if !lim.IsQuota() {
			d.ResetAfter = max(b.ResetAfter-lim.Interval(held), 0)
		}
	}
	d.Allowed = d.Remaining >= 1
	return d, nil
}

// jointOutstanding is the tokens a joint lease of several limits holds for
// key now (see limitSet.joint); none for one limit, whose lease is its
// member's own.
func (l *Limiter) jointOutstanding(key string) int64 {
	if l.joint == nil {
		return 0
	}
	return l.joint.Outstanding(key, l.clock.now())
}

// Reset makes key's bucket full again, for every instance: it deletes the
// bucket in Redis (a missing bucket is full), then drops this instance's
// local state of key at once: its lease (whose tokens are not given back:
// the bucket they came from is gone) and its negative cache. Other
// instances learn of the reset on their next Redis call for key: a lease
// they hold keeps serving until it runs out or expires (the lease TTL, 2s
// by default), and a denial they cached lasts at most DenyCap (1s by
// default). Until then they may deny requests the full bucket would admit,
// or admit from their leases, which the old bucket paid for. With several
// limits, Reset does so for each limit's bucket in turn. A limit's local
// state includes what it holds with other limits: the lease of a set of
// limits (Client.Limiter with several) that has it, whose tokens of the
// other limits' buckets are dropped too.
//
// Reset makes one Redis call per limit (a script that deletes the bucket
// and marks the reset), once: go-redis's resends of it change nothing.
// While Redis is unavailable it returns an error wrapping ErrUnavailable
// and changes nothing here; the error does not tell that Redis made no
// reset (a reply past the time budget, or lost, may be of one made), and
// a Reset called again starts another generation.
//
// Reset starts the bucket's next generation: tokens taken from it before
// and given back after (a Reservation settled later, another instance's
// lease returned when it expires, a grant that arrived for no one) are not
// added to the fresh bucket, and a Reservation from before is not charged
// to it (see the ledger in docs/semantics.md). The mark lives
// authority.MarkLife (a week): a Reservation settled later than that after
// its grant gives nothing back, Reset or not (the mark that would tell may
// be gone), which only under-admits; so does one whose tokens' grant time
// is unknown (see Reservation.Settle), settled half that late.
func (l *Limiter) Reset(ctx context.Context, key string) error {
	if err := l.callable(ctx); err != nil {
		return err
	}
	if err := l.usable(); err != nil {
		return err
	}
	if err := checkKey(key); err != nil {
		return err
	}
	for _, m := range l.members {
		brk, rkey := l.route(m.names, key)
		if rkey == "" {
			rkey = m.names.Key(key)
		}
		if _, err := l.path.Do(ctx, brk, rkey, func(ctx context.Context) error {
			_, err := l.auth.Reset(ctx, rkey)
			return err
		}); err != nil {
			return err
		}
		// This instance's tokens of the old bucket, and its cached
		// denial, under this limit alone and in every set of limits
		// that has it. Regression: only this Limiter's own sets were
		// dropped, and after Limiter(a).Reset, Limiter(a, b)'s joint
		// lease here kept serving the old bucket's tokens (1,026
		// admitted of a fresh bucket of 1,000) and its cached denial
		// (a full bucket denied for up to DenyCap).
		m.forget(key)
	}
	return nil
}
