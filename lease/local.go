package lease

import (
	"sync"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// Local is an in-process token bucket, used while Redis is unavailable under
// policy.FailLocal. Its state is exact integers in the same units as the
// Redis script: a token is PeriodMicros units and one µs adds Rate units.
type Local struct {
	mu     sync.Mutex
	s      int64 // units; valid at last
	last   int64 // now of s, in µs
	inited bool
}

// Never is the retry Allow returns for n above the local burst: the local
// bucket can never admit it.
const Never = time.Duration(1<<63 - 1)

// Allow takes n tokens from b under limit l at now (nanoseconds), all or
// nothing. It returns whether it did, the whole tokens left, and when denied
// the time until n tokens are available, or Never when n > l.Burst.
func (b *Local) Allow(l policy.Limit, n, now int64) (ok bool, remaining int64, retry time.Duration) {
	p := l.PeriodMicros()
	capU := l.Burst * p
	nowUs := now / int64(time.Microsecond)
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.inited {
		b.s, b.last, b.inited = capU, nowUs, true
	}
	if nowUs > b.last {
		el := nowUs - b.last
		if el >= (capU-b.s+l.Rate-1)/l.Rate {
			b.s = capU
		} else {
			b.s += el * l.Rate
		}
		if b.s > capU {
			b.s = capU
		}
		b.last = nowUs
	}
	if n > l.Burst {
		return false, b.s / p, Never
	}
	if b.s >= n*p {
		b.s -= n * p
		return true, b.s / p, 0
	}
	us := (n*p - b.s + l.Rate - 1) / l.Rate
	return false, b.s / p, time.Duration(us) * time.Microsecond
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
func (b *Local) Full(l policy.Limit, now int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.inited {
		return true
	}
	capU := l.Burst * l.PeriodMicros()
	nowUs := now / int64(time.Microsecond)
	if nowUs <= b.last {
		return b.s >= capU
	}
	return nowUs-b.last >= (capU-b.s+l.Rate-1)/l.Rate
}
