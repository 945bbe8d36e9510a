package lease

import (
	"math/bits"
	"sync"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// localBucket is an in-process token bucket, used while Redis is unavailable under
// policy.FailLocal. Its state is exact integers as in the Redis script:
// whole tokens and the fraction of the next one in units of 1/p, for the
// limit's rate r and period p in µs reduced by their gcd (r tokens every p
// µs), with 128-bit products (math/bits), so any valid limit is exact.
type localBucket struct {
	mu     sync.Mutex
	w, f   uint64 // w + f/p tokens; valid at last
	last   int64  // now of the state, in µs
	inited bool
}

// Never is the retry Allow returns for n above the local burst: the local
// bucket can never admit it.
const Never = time.Duration(1<<63 - 1)

// reduced returns l's rate and period in µs divided by their gcd.
func reduced(l policy.Limit) (r, p uint64) {
	a, b := uint64(l.Rate), uint64(l.PeriodMicros())
	for b != 0 {
		a, b = b, a%b
	}
	return uint64(l.Rate) / a, uint64(l.PeriodMicros()) / a
}

// mulDiv returns floor((a*b + f)/c) and the remainder, or ok false when the
// quotient does not fit 64 bits.
func mulDiv(a, b, f, c uint64) (q, rem uint64, ok bool) {
	hi, lo := bits.Mul64(a, b)
	lo, carry := bits.Add64(lo, f, 0)
	hi += carry
	if hi >= c {
		return 0, 0, false
	}
	q, rem = bits.Div64(hi, lo, c)
	return q, rem, true
}

// untilTokens returns the µs until a bucket holding w + f/p tokens holds m
// more whole ones (m >= 1): ceil((m*p - f)/r).
func untilTokens(m, f, r, p uint64) time.Duration {
	q, rem, ok := mulDiv(m-1, p, p-f, r)
	if !ok || q >= uint64(Never/time.Microsecond) {
		return Never - 1
	}
	if rem > 0 {
		q++
	}
	return time.Duration(q) * time.Microsecond
}

// refill brings b to nowUs under l. Called with b.mu held.
func (b *localBucket) refill(l policy.Limit, nowUs int64) {
	if !b.inited {
		b.w, b.f, b.last, b.inited = uint64(l.Burst), 0, nowUs, true
	}
	b.w, b.f, b.last = refilled(l, b.w, b.f, b.last, nowUs)
}

// refilled returns the state w + f/p tokens at last brought to nowUs,
// capped at l's burst. A clock behind last refills nothing.
func refilled(l policy.Limit, w, f uint64, last, nowUs int64) (uint64, uint64, int64) {
	burst := uint64(l.Burst)
	if w >= burst {
		w, f = burst, 0
	}
	if nowUs > last {
		r, p := reduced(l)
		q, rem, ok := mulDiv(uint64(nowUs-last), r, f, p)
		if !ok || q >= burst-w {
			w, f = burst, 0
		} else {
			w, f = w+q, rem
		}
		last = nowUs
	}
	return w, f, last
}

// Allow takes n tokens from b under limit l at now (nanoseconds), all or
// nothing. It returns whether it did, the whole tokens left, and when denied
// the time until n tokens are available, or Never when n > l.Burst.
func (b *localBucket) Allow(l policy.Limit, n, now int64) (ok bool, remaining int64, retry time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(l, now/int64(time.Microsecond))
	if n > l.Burst {
		return false, int64(b.w), Never
	}
	if b.w >= uint64(n) {
		b.w -= uint64(n)
		return true, int64(b.w), 0
	}
	r, p := reduced(l)
	return false, int64(b.w), untilTokens(uint64(n)-b.w, b.f, r, p)
}

// Share returns the limit one of fleet instances enforces locally: rate and
// burst divided by fleet, rounded up, at least 1.
func Share(l policy.Limit, fleet int) policy.Limit {
	if fleet <= 1 {
		return l
	}
	f := int64(fleet)
	l.Rate = (l.Rate + f - 1) / f
	l.Burst = (l.Burst + f - 1) / f
	return l
}

// Full reports whether b, under limit l, has refilled to its burst by now:
// its state then says nothing a fresh bucket would not.
func (b *localBucket) Full(l policy.Limit, now int64) bool { return b.untilFull(l, now) == 0 }

// untilFull returns how long b, under limit l, takes from now to refill to
// its burst: 0 when it has.
func (b *localBucket) untilFull(l policy.Limit, now int64) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.inited {
		return 0
	}
	w, f, _ := refilled(l, b.w, b.f, b.last, now/int64(time.Microsecond))
	if w >= uint64(l.Burst) {
		return 0
	}
	r, p := reduced(l)
	return untilTokens(uint64(l.Burst)-w, f, r, p)
}

// emptyBucket returns a bucket that holds no token at now: see
// Leases.newLocalBucket.
func emptyBucket(now int64) *localBucket {
	return &localBucket{last: now / int64(time.Microsecond), inited: true}
}
