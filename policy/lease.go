package policy

import (
	"time"
)

// Lease tunes the local leases a Limiter keeps for busy keys. A lease is a
// small number of tokens taken from the Redis bucket ahead of use (the grant
// debits the bucket, so leases never let the fleet exceed the limit over a
// run) and spent locally with an atomic operation. The zero value of any
// field means its default; DefaultLease returns the defaults spelled out.
type Lease struct {
	// MaxTokens caps one lease. Lease sizes follow demand (see Horizon), so
	// this is a safety cap that only very hot keys reach: a key served a
	// million times a second needs leases of ~250k tokens to refill four
	// times a second. Larger leases hold more tokens away from other
	// instances. Default 100000.
	MaxTokens int64

	// Horizon is how much of a key's observed local demand one lease covers:
	// the lease size is demand rate × Horizon (capped), so a key seen once a
	// minute gets leases of 1 token (exact behaviour) and a key seen 100k
	// times a second gets leases that last about Horizon. Near a key's limit
	// this is the whole rule, and a short Horizon keeps what each instance
	// holds back small. Far from the limit (the bucket holds at least 16
	// times the lease), slow start may grow leases further: a lease used up
	// in under TTL/2 doubles the next one, because when many keys share
	// Redis, callers waiting on refills hide their own demand. Default 250ms.
	Horizon time.Duration

	// TTL is how long a lease may be spent after its grant. Unused tokens are
	// refunded to Redis when it expires. It bounds how long leased tokens can
	// be held back from the rest of the fleet, and slow start grows leases
	// only while they are used within TTL/2, so it also bounds how many busy
	// keys an instance can lease at once: each must be refilled within TTL/2,
	// so a key count above TTL/2 × the Redis calls per second the instance
	// can make keeps leases small. Default 2s; at most MaxLeaseTTL.
	TTL time.Duration

	// MaxShare caps one grant at this fraction of the tokens the bucket holds
	// at grant time (but never below the tokens the caller needs), so leases
	// shrink towards 1 token as the bucket nears empty and one instance
	// cannot drain a nearly empty bucket for the others. Default 0.5.
	MaxShare float64

	// Prefetch starts an asynchronous refill when a busy lease falls below
	// this fraction of its size, so a hot key's callers do not wait on
	// Redis. 0 means the default 0.25; a negative value disables prefetch.
	Prefetch float64

	// DenyCap caps how long a key denied by Redis is denied locally (the
	// negative cache) before Redis is asked again. Default 1s.
	DenyCap time.Duration

	// IdleTTL evicts a key's local state after this long without use.
	// Default 30s.
	IdleTTL time.Duration
}

// MaxLeaseTTL is the longest lease TTL Validate takes. A lease's expiry is
// its grant's time plus TTL, in nanoseconds: a TTL near math.MaxInt64
// overflowed, and every lease expired as it was granted (a review: 93
// admissions of 2,000 where an hour's TTL gave 1,011, with 568 Redis
// commands against 172), silently. A day is far past any use (leased
// tokens are held back from the rest of the fleet until they expire).
const MaxLeaseTTL = 24 * time.Hour

// DefaultLease returns the default lease settings.
func DefaultLease() Lease {
	return Lease{
		MaxTokens: 100_000,
		Horizon:   250 * time.Millisecond,
		TTL:       2 * time.Second,
		MaxShare:  0.5,
		Prefetch:  0.25,
		DenyCap:   time.Second,
		IdleTTL:   30 * time.Second,
	}
}

// WithDefaults returns s with every zero field replaced by its default.
func (s Lease) WithDefaults() Lease {
	d := DefaultLease()
	if s.MaxTokens == 0 {
		s.MaxTokens = d.MaxTokens
	}
	if s.Horizon == 0 {
		s.Horizon = d.Horizon
	}
	if s.TTL == 0 {
		s.TTL = d.TTL
	}
	if s.MaxShare == 0 {
		s.MaxShare = d.MaxShare
	}
	if s.Prefetch == 0 {
		s.Prefetch = d.Prefetch
	}
	if s.DenyCap == 0 {
		s.DenyCap = d.DenyCap
	}
	if s.IdleTTL == 0 {
		s.IdleTTL = d.IdleTTL
	}
	return s
}

// Validate reports whether s (after WithDefaults) is usable. The error wraps
// ErrInvalidLimit; its text says "invalid setting".
func (s Lease) Validate() error {
	defaultIdle := s.IdleTTL == 0
	s = s.WithDefaults()
	switch {
	case s.MaxTokens < 1:
		return invalidSetting("lease MaxTokens %d must be >= 1", s.MaxTokens)
	case s.Horizon < 0:
		return invalidSetting("lease Horizon %v must be >= 0", s.Horizon)
	case s.TTL < time.Millisecond:
		return invalidSetting("lease TTL %v must be >= 1ms", s.TTL)
	case s.TTL > MaxLeaseTTL:
		return invalidSetting("lease TTL %v must be <= MaxLeaseTTL (%v)", s.TTL, MaxLeaseTTL)
	case !(s.MaxShare > 0 && s.MaxShare <= 1):
		return invalidSetting("lease MaxShare %v must be in (0, 1]", s.MaxShare)
	case s.Prefetch >= 1 || s.Prefetch != s.Prefetch:
		return invalidSetting("lease Prefetch %v must be < 1", s.Prefetch)
	case s.DenyCap < 0:
		return invalidSetting("lease DenyCap %v must be >= 0", s.DenyCap)
	case s.IdleTTL < s.TTL && defaultIdle:
		return invalidSetting("lease TTL %v must be <= IdleTTL, whose default is %v: set IdleTTL too", s.TTL, s.IdleTTL)
	case s.IdleTTL < s.TTL:
		return invalidSetting("lease IdleTTL %v must be >= TTL %v", s.IdleTTL, s.TTL)
	}
	return nil
}
