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
// RetryAfter is how long until one token is available (0 when Remaining is
// at least 1); ResetAfter is how long until the bucket is full; Allowed
// reports whether a request for one token would be admitted now, as far as
// the bucket and this instance know (other instances' leases are not
// counted: they were taken from the bucket). Source is SourceAuthority.
//
// Peek makes one Redis call, a script that reads the bucket and Redis's
// clock and writes nothing; it changes no local state either.
// While Redis is unavailable it returns an error wrapping ErrUnavailable.
func (l *Limiter) Peek(ctx context.Context, key string) (Decision, error) {
	if err := l.usable(); err != nil {
		return Decision{Source: SourceNone}, err
	}
	if err := checkKey(key); err != nil {
		return Decision{Source: SourceNone}, err
	}
	if l.group != nil {
		return l.peekGroup(ctx, key)
	}
	brk, rkey := l.route(key)
	if rkey == "" {
		rkey = l.namer.Key(key)
	}
	var b authority.Bucket
	// What this instance holds is read before and after the bucket, and
	// the lesser counted: a refill (or a lease given back) between the two
	// reads moves tokens between the bucket and the lease, and must not be
	// counted twice.
	before := l.leases.Holding(key, l.clock.now())
	_, err := l.path.Do(ctx, brk, func(ctx context.Context) (err error) {
		b, err = l.auth.Peek(ctx, rkey, l.limit)
		return err
	})
	if err != nil {
		return Decision{Source: SourceNone}, err
	}
	d := Decision{Limit: l.limit, Remaining: b.Tokens, RetryAfter: b.RetryAfter, ResetAfter: b.ResetAfter, Source: SourceAuthority}
	if held := min(before, l.leases.Holding(key, l.clock.now())); held > 0 {
		d.Remaining = min(b.Tokens+held, l.limit.Burst)
		d.RetryAfter = 0
		if !l.limit.IsQuota() {
			d.ResetAfter = max(b.ResetAfter-l.limit.Interval(held), 0)
		}
	}
	d.Allowed = d.Remaining >= 1
	return d, nil
}

// Reset makes key's bucket full again, for every instance: it deletes the
// bucket in Redis (a missing bucket is full), then drops this instance's
// local state of key at once: its lease (whose tokens are not given back:
// the bucket they came from is gone) and its negative cache. Other
// instances learn of the reset on their next Redis call for key: a lease
// they hold keeps serving until it runs out or expires (the lease TTL, 2s
// by default), and a denial they cached lasts at most DenyCap (1s by
// default). Until then they may deny requests the full bucket would admit,
// or admit from their leases, which the old bucket paid for.
//
// Reset makes one Redis call (a script that deletes the bucket and marks
// the reset). While Redis is unavailable it returns
// an error wrapping ErrUnavailable and changes nothing here.
//
// Reset starts the bucket's next generation: tokens taken from it before
// and given back after (a Reservation settled later, another instance's
// lease returned when it expires, a grant that arrived for no one) are not
// added to the fresh bucket, and a Reservation from before is not charged
// to it (see the ledger in the README). A Reservation settled more than
// authority.MarkLife (24h) after a Reset of its key is the exception: by
// then the mark is gone.
func (l *Limiter) Reset(ctx context.Context, key string) error {
	if err := l.usable(); err != nil {
		return err
	}
	if err := checkKey(key); err != nil {
		return err
	}
	if l.group != nil {
		for _, p := range l.group {
			if err := p.Reset(ctx, key); err != nil {
				return err
			}
		}
		l.leases.Forget(key) // the multi-limit's own lease and negative cache
		return nil
	}
	brk, rkey := l.route(key)
	if rkey == "" {
		rkey = l.namer.Key(key)
	}
	if _, err := l.path.Do(ctx, brk, func(ctx context.Context) error {
		_, err := l.auth.Reset(ctx, rkey)
		return err
	}); err != nil {
		return err
	}
	l.leases.Forget(key)
	return nil
}
