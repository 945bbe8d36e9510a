// Package lease keeps the per-key local leases of a leaselimit Limiter: a
// bounded table of entries, each holding tokens already debited from the
// Redis bucket, spent with a lock-free compare-and-swap.
//
// Nothing here reads a clock or talks to Redis. Every time-dependent function
// takes now, a monotonic reading in nanoseconds from an origin of the
// caller's choosing; the caller (the root package) owns the clock, the Redis
// calls and the goroutines. That keeps the lease logic testable with step
// tables over fixed timestamps.
package lease

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// Entry is the local state of one key. The fast path (Take, Denied) uses only
// atomics; refills and expiry serialise on the entry's mutex.
type Entry struct {
	key string

	tokens    atomic.Int64          // leased tokens not yet spent
	reserved  atomic.Int64          // tokens the last refill set aside for the callers that waited on it
	expires   atomic.Int64          // now at which the lease stops serving
	denyUntil atomic.Int64          // negative cache: deny until this now
	denyMin   atomic.Int64          // the request size the negative cache was set for
	lastUse   atomic.Int64          // coarse: updated at most once per useGrain
	remote    atomic.Int64          // tokens the bucket held at the last grant
	size      atomic.Int64          // target lease size at the last refill
	low       atomic.Int64          // prefetch when tokens fall below this
	refilling atomic.Bool           // a prefetch is queued or running
	removed   atomic.Bool           // evicted from the table; refills must refund
	local     atomic.Pointer[Local] // the FailLocal bucket, made on first use

	pendSum atomic.Int64 // tokens wanted by callers waiting on a refill
	pendMin atomic.Int64 // smallest such want (0: none)

	mu         sync.Mutex
	rate       float64 // EWMA of locally served tokens per second
	lastRefill int64   // now of the last refill
	refilled   bool    // lastRefill is set
	level      int64   // tokens right after the last install
	lastNeed   int64   // tokens the last install reserved for waiting callers
}

// useGrain is how stale Entry.lastUse may be; it keeps hot keys from writing
// a shared cache line on every hit.
const useGrain = int64(10 * time.Millisecond)

// Key returns the user key of e.
func (e *Entry) Key() string { return e.key }

// Tokens returns the leased tokens not yet spent.
func (e *Entry) Tokens() int64 { return e.tokens.Load() }

// Local returns e's local fallback bucket, creating it on first use.
func (e *Entry) Local() *Local {
	if b := e.local.Load(); b != nil {
		return b
	}
	e.local.CompareAndSwap(nil, new(Local))
	return e.local.Load()
}

// LocalBucket returns e's local fallback bucket, or nil if it has none.
func (e *Entry) LocalBucket() *Local { return e.local.Load() }

// Reserved returns the tokens set aside for callers waiting on a refill.
func (e *Entry) Reserved() int64 { return e.reserved.Load() }

// Remote returns how many tokens the bucket held at the last grant.
func (e *Entry) Remote() int64 { return e.remote.Load() }

// Removed reports whether e was evicted from its table; a caller holding it
// should look the key up again.
func (e *Entry) Removed() bool { return e.removed.Load() }

// Take spends n tokens (n >= 1) of a live lease. It reports whether it did and how
// many leased tokens are left. It never blocks and never allocates.
func (e *Entry) Take(n, now int64) (ok bool, left int64) {
	if now >= e.expires.Load() {
		return false, 0
	}
	if now-e.lastUse.Load() > useGrain {
		e.lastUse.Store(now)
	}
	for {
		t := e.tokens.Load()
		if t < n {
			return false, t
		}
		if e.tokens.CompareAndSwap(t, t-n) {
			return true, t - n
		}
	}
}

// TakeReserved spends n of the tokens the last refill set aside for the
// callers that waited on it (see Install), so that callers on the fast path
// cannot take them first. It reports whether it did.
func (e *Entry) TakeReserved(n int64) bool {
	for {
		r := e.reserved.Load()
		if r < n {
			return false
		}
		if e.reserved.CompareAndSwap(r, r-n) {
			return true
		}
	}
}

// NeedsPrefetch reports whether a lease with left tokens is low enough to be
// refilled ahead of time, and claims the refill when it is: a true result
// must be followed by a refill and then PrefetchDone.
func (e *Entry) NeedsPrefetch(left int64) bool {
	if left >= e.low.Load() || e.refilling.Load() {
		return false
	}
	return e.refilling.CompareAndSwap(false, true)
}

// PrefetchDone releases the claim taken by NeedsPrefetch.
func (e *Entry) PrefetchDone() { e.refilling.Store(false) }

// Denied reports whether the negative cache denies e at now for a request as
// large as the one Redis denied, and for how long.
func (e *Entry) Denied(now int64) (bool, time.Duration) {
	d := e.denyUntil.Load()
	if now < d {
		return true, time.Duration(d - now)
	}
	return false, 0
}

// Denied reports whether the negative cache denies n tokens of e at now, and
// for how long. A denial was for denyMin tokens; a smaller request is denied
// for less, by the refill time of the difference, so a request that a
// central bucket would admit is not held back.
func (z Sizer) Denied(e *Entry, n, now int64) (bool, time.Duration) {
	d := e.denyUntil.Load()
	if now >= d {
		return false, 0
	}
	if m := e.denyMin.Load(); n < m {
		d -= int64(float64(m-n) * z.perToken)
		if now >= d {
			return false, 0
		}
	}
	return true, time.Duration(d - now)
}

// Touch records a use of e at now.
func (e *Entry) Touch(now int64) {
	if now-e.lastUse.Load() > useGrain {
		e.lastUse.Store(now)
	}
}

// AddPending registers a caller that waits for a refill and needs n tokens.
// The next Plan includes it.
func (e *Entry) AddPending(n int64) {
	e.pendSum.Add(n)
	for {
		m := e.pendMin.Load()
		if m != 0 && m <= n {
			return
		}
		if e.pendMin.CompareAndSwap(m, n) {
			return
		}
	}
}

// Request is what one refill asks of the authority.
type Request struct {
	Want int64 // tokens to ask for
	Min  int64 // fewest tokens worth taking (all-or-nothing below it)
	Need int64 // tokens the waiting callers asked for, reserved for them on a grant
}

// Sizer turns a key's observed demand into a lease size. It is immutable and
// shared by all entries of a table.
type Sizer struct {
	limit    policy.Limit
	settings policy.Lease
	horizon  float64 // seconds
	perToken float64 // nanoseconds of refill per token
}

// NewSizer returns a Sizer for limit l with settings s (defaults applied).
func NewSizer(l policy.Limit, s policy.Lease) Sizer {
	s = s.WithDefaults()
	return Sizer{limit: l, settings: s, horizon: s.Horizon.Seconds(),
		perToken: float64(l.Period) / float64(l.Rate)}
}

// Settings returns the lease settings with defaults applied.
func (z Sizer) Settings() policy.Lease { return z.settings }

// ewmaTau is the time constant of the demand estimate.
const ewmaTau = float64(time.Second)

// Plan starts a refill of e at now: it updates the demand estimate, takes the
// pending wants, and returns what to ask the authority for. The caller must
// hold no lock; Plan and Install lock e themselves.
func (z Sizer) Plan(e *Entry, now int64) Request {
	e.mu.Lock()
	defer e.mu.Unlock()
	// Reserved tokens not claimed by now (a waiter gave up) join the lease.
	if r := e.reserved.Swap(0); r > 0 {
		e.tokens.Add(r)
		e.level += r
	}
	cur := e.tokens.Load()
	if e.refilled && now > e.lastRefill {
		served := e.level - cur + e.lastNeed
		if served < 0 {
			served = 0
		}
		dt := float64(now - e.lastRefill)
		inst := float64(served) / (dt / float64(time.Second))
		alpha := 1 - math.Exp(-dt/ewmaTau)
		e.rate += alpha * (inst - e.rate)
	}
	need := e.pendSum.Swap(0)
	minWant := e.pendMin.Swap(0)

	// spare is the lease to keep beyond what the waiting callers need:
	// demand × Horizon, capped. A cold key (spare 0) asks for exactly what
	// its callers need, which is exact mode.
	spare := int64(math.Ceil(e.rate * z.horizon))
	spare = clamp(spare, 0, z.settings.MaxTokens)
	spare = clamp(spare, 0, z.limit.Burst)
	size := clamp(spare, 1, z.limit.Burst)
	e.size.Store(size)
	if z.settings.Prefetch > 0 && size > 1 {
		e.low.Store(int64(float64(size) * z.settings.Prefetch))
	} else {
		e.low.Store(0)
	}

	if cur < 0 {
		cur = 0
	}
	want := need
	if extra := spare - cur; extra > 0 {
		want += extra
	}
	want = clamp(want, 1, z.limit.Burst)
	m := minWant
	if m < 1 {
		m = 1
	}
	if m > want {
		m = want
	}
	return Request{Want: want, Min: m, Need: min(need, want)}
}

// Outcome is the authority's answer to a Request.
type Outcome struct {
	Granted    int64
	Remaining  int64
	RetryAfter time.Duration // when Granted == 0: until Min tokens are available
	Min        int64         // the Request's Min
}

// maxBatchWait caps how much longer than RetryAfter a denied key waits to
// gather a lease's worth of tokens: long enough that a key far over its
// limit asks Redis a few dozen times a second, short enough that tokens do
// not sit unclaimed in Redis for long (what is left there when demand stops
// is under-admission).
const maxBatchWait = 50 * time.Millisecond

// Install puts granted tokens into e's lease at now, or, on a denial, starts
// the negative cache. It returns the tokens e must refund because it was
// evicted while the refill ran.
//
// On a denial the key is denied locally until enough tokens for one lease of
// e's size are available (RetryAfter plus the refill time of the rest, the
// latter at most maxBatchWait), capped by DenyCap: a key far over its limit then costs one Redis call per
// lease, not one per token. For a cold key the size is 1 and this is exactly
// RetryAfter.
func (z Sizer) Install(e *Entry, req Request, o Outcome, now int64) (refund int64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.lastRefill, e.refilled = now, true
	if o.Granted <= 0 {
		e.remote.Store(o.Remaining)
		wait := o.RetryAfter
		if extra := e.size.Load() - req.Min; extra > 0 {
			wait += min(z.limit.Interval(extra), maxBatchWait)
		}
		if wait > z.settings.DenyCap {
			wait = z.settings.DenyCap
		}
		if wait > 0 {
			e.denyMin.Store(req.Min)
			e.denyUntil.Store(now + int64(wait))
		}
		e.level = e.tokens.Load()
		return 0
	}
	e.denyUntil.Store(0)
	if e.removed.Load() {
		e.level = 0
		return o.Granted
	}
	// Reserve for the callers counted in the plan.
	part := min(req.Need, o.Granted)
	e.lastNeed = part
	e.reserved.Add(part)
	e.level = e.tokens.Add(o.Granted - part)
	// After the tokens are in, so that lease + remote never reads low.
	e.remote.Store(o.Remaining)
	e.expires.Store(now + int64(z.settings.TTL))
	return 0
}

// Expire takes back the tokens of e's lease when it has expired at now and
// returns them for refunding.
func (e *Entry) Expire(now int64) int64 {
	if now < e.expires.Load() || e.tokens.Load()+e.reserved.Load() <= 0 {
		return 0
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if now < e.expires.Load() {
		return 0
	}
	return e.takeAll()
}

// Drain takes back every leased token of e, expired or not (for Close and
// eviction).
func (e *Entry) Drain() int64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.takeAll()
}

// takeAll empties the lease and its reservation; e.mu must be held.
func (e *Entry) takeAll() int64 {
	t := e.tokens.Swap(0) + e.reserved.Swap(0)
	e.level = 0
	return max(t, 0)
}

func clamp(v, lo, hi int64) int64 {
	if v < lo {
		return lo
	}
	if v > hi {
		return hi
	}
	return v
}
