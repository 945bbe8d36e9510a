package lease

import (
	"math"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
)

// request is what one refill asks of the authority.
type request struct {
	Want int64 // tokens to ask for
	Min  int64 // fewest tokens worth taking (all-or-nothing below it)
	Need int64 // tokens the waiting callers asked for, reserved for them on a grant
	// Whole asks for up to Want whatever the bucket holds (no MaxShare
	// cap): a key at its limit taking the batch it waited for.
	Whole bool
	// At is when the refill was planned (local now): before the
	// authority granted, so a window's end measured from the grant is
	// measured from here, not from a late install (see Install).
	At int64
}

// sizer turns a key's observed demand into a lease size. It is immutable and
// shared by all entries of a table.
type sizer struct {
	limit    policy.Limit
	settings policy.Lease
	horizon  float64 // seconds
	perToken float64 // nanoseconds of refill per token
	// members, for a multi-limit, are its limits (limit is then their
	// envelope): a denial's wait for n tokens is theirs (see extra).
	members []policy.Limit
}

// makeSizer returns a sizer for limit l with settings s (defaults applied).
func makeSizer(l policy.Limit, s policy.Lease) sizer {
	s = s.WithDefaults()
	return sizer{limit: l, settings: s, horizon: s.Horizon.Seconds(),
		perToken: float64(l.Period) / float64(l.Rate)}
}

// Denied reports whether the negative cache denies n tokens of e at now,
// and the request's retry-after. A denial was for denyMin tokens; another
// request waits longer or less by the rule of each limit (see extra): a
// token bucket by its own refill time of the difference, a calendar quota
// not at all (its tokens come back all at once, at its boundary), and a
// smaller request a single quota held enough for is not denied here.
// Without a batch wait (see Install) that is exactly when a central bucket
// would admit it; with one it also waits out the rest of the batch.
//
// The retry-after is not the cache's lifetime (at most DenyCap, an internal
// matter) but when the request can next be admitted here: once the buckets
// hold n tokens, as Redis last said (availAt, with the difference from
// denyMin added or taken off), and not before the cache ends.
func (z sizer) Denied(e *entry, n, now int64) (bool, time.Duration) {
	d := e.denyUntil.Load()
	if now >= d {
		return false, 0
	}
	m := e.denyMin.Load()
	more, fits := z.extra(e.Remote(), e.parts.Load(), m, n)
	if fits {
		return false, 0
	}
	if n < m {
		d += int64(more)
		if now >= d {
			return false, 0
		}
	}
	due := e.availAt.Load() + int64(more)
	return true, time.Duration(max(d, due) - now)
}

// ewmaTau is the time constant of the demand estimate.
const ewmaTau = float64(time.Second)

// Plan starts a refill of e at now: it updates the demand estimate, takes the
// pending wants, and returns what to ask the authority for, and the tokens
// of a lease that expired by now, taken out to be returned: a refill never
// counts them as the live lease nor adds its grant to them (a calendar
// quota's would be revived in the next window). The caller must hold no
// lock; Plan and Install lock e themselves.
func (z sizer) Plan(e *entry, now int64) (request, held) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var expired held
	if now >= e.expires.Load() {
		expired = e.takeAll()
	}
	// Reserved tokens not claimed by now (a waiter gave up) join the lease.
	if r := e.reserved.Swap(0); r > 0 {
		e.tokens.Add(r)
		e.level += r
		// A sweep that read tokens before the move and reserved after it
		// found e empty and unlisted it (see table.sweepHolders).
		e.listHolder()
	}
	cur := e.tokens.Load()
	served := max(e.level-cur+e.lastNeed, 0)
	if e.refilled && now > e.lastRefill {
		dt := float64(now - e.lastRefill)
		inst := float64(served) / (dt / float64(time.Second))
		alpha := 1 - math.Exp(-dt/ewmaTau)
		e.rate += alpha * (inst - e.rate)
	}
	z.slowStart(e, now, served)
	need := e.pendSum.Swap(0)
	minWant := e.pendMin.Swap(0)

	// spare is the lease to keep beyond what the waiting callers need:
	// demand × Horizon or the slow-start size, whichever is larger, capped.
	// A cold key (spare 0) asks for exactly what its callers need, which is
	// exact mode; a key the doorkeeper let in starts slow start at one
	// token (see entry.leaseOnFirstRefill).
	spare := min(max(int64(math.Ceil(e.rate*z.horizon)), e.grow), z.settings.MaxTokens, z.limit.Burst)
	size := max(spare, 1)
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
	// A key at its limit asks for the batch its negative cache waited for
	// (less what has not accrued yet if it asks early) and takes all of it
	// in one call, rather than half of what the bucket holds and then half
	// of the rest. Min stays what the callers need, so a request the bucket
	// can serve is never denied for want of a whole batch.
	whole := false
	if b := e.batch; b > 1 {
		if d := e.denyUntil.Load(); now < d {
			if t := math.Ceil(float64(d-now) / z.perToken); t < float64(b) {
				b -= int64(t)
			} else {
				b = 0
			}
		}
		if b > 1 {
			want = max(need, b)
			whole = true
		}
	}
	want = clamp(want, 1, z.limit.Burst)
	m := clamp(minWant, 1, want)
	return request{Want: want, Min: m, Need: min(need, want), Whole: whole, At: now}, expired
}

// growHeadroom is how many leases of the slow-start size the bucket must
// still hold after a grant for the size to keep growing: slow start only
// runs while a key is far from its limit, so near the limit (where what
// instances hold back is what a fleet under-admits) leases follow measured
// demand alone and shrink towards one token with the bucket.
const growHeadroom = 16

// slowStart updates e.grow, the lease size that measured demand cannot see.
// Served demand underestimates a key whose callers wait on every refill: a
// caller blocked on Redis makes no requests, so a key whose lease is one
// token shows the rate Redis round trips allow, and a lease sized from that
// rate stays one token. Like TCP slow start, a lease used up to its refill
// point in under half its TTL, most of it spent, doubles the next one; a
// lease that reached its TTL halves it, once per TTL that passed. The size
// never exceeds 1/growHeadroom of what the bucket held at the last grant, so
// it is zero for a key near its limit. e.mu must be held.
func (z sizer) slowStart(e *entry, now, served int64) {
	if !e.refilled {
		return
	}
	ttl := int64(z.settings.TTL)
	switch exp := e.expires.Load(); {
	case !e.granted:
		// After a denial the key is at its limit: no growth.
		e.grow = 0
		return
	case now >= exp:
		e.grow >>= min(1+(now-exp)/ttl, 62)
	case now > e.lastRefill && now-e.lastRefill < ttl/2 && 2*served >= e.level+e.lastNeed:
		// Most of the last grant was used: a refill asked for again at
		// once (a prefetch that found the lease still low, or callers
		// that lost a refill's tokens to others) is no sign of demand.
		e.grow = 2 * max(e.grow, e.size.Load(), 1)
	}
	e.grow = min(e.grow, e.remote.Load()/growHeadroom, z.settings.MaxTokens, z.limit.Burst)
}

// Outcome is the authority's answer to a request.
type Outcome struct {
	Granted    int64
	Remaining  int64
	RetryAfter time.Duration // when Granted == 0: until Min tokens are available
	Min        int64         // the request's Min
	// Expire, if set, caps the lease's life: a calendar quota's tokens are
	// good until its window ends, however long the lease TTL.
	Expire time.Duration
	// At and Window stamp the granted tokens (see Return).
	At, Window int64
	// Parts, for a multi-limit, is each member's bucket as the authority
	// read it (see extra); nil for one limit.
	Parts *authority.Multi
}

// maxBatchWait caps how long a key at its limit waits to gather a batch
// (beyond RetryAfter): long enough that a key far over its limit asks Redis
// a few times a second, short enough that tokens do not sit unclaimed in
// Redis for long (what is left there when demand stops is under-admission).
const maxBatchWait = 250 * time.Millisecond

// batchDiv keeps a batch at most 1/batchDiv of the burst, so that while
// every instance of a fleet waits for its batch the bucket cannot fill up
// and lose refill: the first instance to ask claims the tokens long before.
const batchDiv = 4

// batchFor returns the tokens a key at its limit with lease size size waits
// to gather: the size, capped by what accrues in maxBatchWait and by
// Burst/batchDiv.
func (z sizer) batchFor(size int64) int64 {
	b := min(size, z.limit.Burst/batchDiv)
	if t := float64(maxBatchWait) / z.perToken; t < float64(b) {
		b = int64(t)
	}
	return max(b, 1)
}

// Install puts granted tokens into e's lease at now, or, on a denial, starts
// the negative cache. It returns the tokens e must refund because it was
// evicted while the refill ran (stamped as the grant), and the tokens of a
// lease of another calendar window taken out first (stale): tokens of
// an ended window never join the next one's.
//
// A key at its limit is refilled in batches. On a denial the key is denied
// locally until a batch is available: RetryAfter plus the refill time of the
// rest of a batch (see batchFor), capped by DenyCap; the next refill then
// asks for the batch and takes all of it (request.Whole). While the key stays
// at its limit (a grant leaves the bucket less than a batch), the negative
// cache is set again at the grant, to when the next batch will have accrued;
// it only denies once the lease is spent. A key far over its limit so costs
// one Redis call per batch, not one per token. For a cold key the batch is 1
// and the cache lasts exactly RetryAfter; a wait cut short by DenyCap ends
// batching. A calendar quota is never batched: its tokens come back all at
// once, at its boundary, which RetryAfter names.
func (z sizer) Install(e *entry, req request, o Outcome, now int64) (refund int64, stale held) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.lastRefill, e.refilled = now, true
	e.granted = o.Granted > 0
	if o.Granted <= 0 {
		e.remote.Store(o.Remaining)
		var wait time.Duration
		if z.quotaDenied(o) {
			// A quota's tokens all come back at its boundary: no batch
			// to wait for past it (Interval would be a token bucket's
			// refill time).
			e.batch, wait = 0, o.RetryAfter
		} else {
			e.batch = z.batchFor(e.size.Load())
			wait = o.RetryAfter + z.limit.Interval(e.batch-req.Min)
		}
		if wait > z.settings.DenyCap {
			wait = z.settings.DenyCap
			e.batch = 0
		}
		if wait > 0 {
			// availAt and denyMin before denyUntil: a caller that sees
			// the cache set reads the values it was set with.
			e.availAt.Store(now + int64(o.RetryAfter))
			e.denyMin.Store(req.Min)
			e.denyUntil.Store(now + int64(wait))
		}
		e.level = e.tokens.Load()
		e.lastNeed = 0
		return 0, held{}
	}
	e.denyUntil.Store(0)
	var rearm time.Duration
	if e.batch > 0 {
		// At its limit: stay in batches while the bucket holds less than
		// one.
		b := z.batchFor(e.size.Load())
		if short := b - o.Remaining; short > 0 && b > 1 {
			e.batch = b
			rearm = min(z.limit.Interval(short), z.settings.DenyCap)
		} else {
			e.batch = 0
		}
	}
	if e.removed.Load() {
		e.level = 0
		return o.Granted, held{}
	}
	// Tokens still in the lease that have expired since the plan (a slow
	// call), or that are of another calendar window than the grant's (the
	// call crossed the boundary), go back rather than join the grant's.
	if e.holdsTokens() && (now >= e.expires.Load() || e.window != o.Window) {
		stale = e.takeAll()
	}
	// Reserve for the callers counted in the plan.
	part := min(req.Need, o.Granted)
	e.lastNeed = part
	e.reserved.Add(part)
	e.level = e.tokens.Add(o.Granted - part)
	// What the lease held before, at most: takes run without the lock
	// (see entry.stampGrant).
	e.stampGrant(o.At, o.Granted, e.level+e.reserved.Load()-o.Granted, o.Window, z.memberWindows(o))
	// After the tokens are in, so that lease + remote never reads low.
	e.remote.Store(o.Remaining)
	exp := now + int64(z.settings.TTL)
	if o.Expire > 0 {
		// From the plan, which came before the grant: a reply that
		// arrives late (after the window's end) must not give the
		// window's tokens a fresh life after it. An install without a
		// plan time (tests) counts from now.
		from := now
		if req.At != 0 {
			from = min(req.At, now)
		}
		exp = min(exp, from+int64(o.Expire))
	}
	e.expires.Store(exp)
	// After the expiry: the entry is listed by it (see listHolder).
	e.listHolder()
	if rearm > 0 {
		// After the tokens too: a caller must not find the cache set and
		// the lease still empty.
		e.availAt.Store(now + int64(z.oneDue(o)))
		e.denyMin.Store(1)
		e.denyUntil.Store(now + int64(rearm))
		// No prefetch: before the cache ends it could only be denied.
		e.low.Store(0)
	}
	return 0, stale
}

// quotaDenied reports whether the denial o was a calendar quota's: the
// limit's, or for a multi-limit the member's that made the call wait
// longest.
func (z sizer) quotaDenied(o Outcome) bool {
	if z.members == nil {
		return z.limit.IsQuota()
	}
	if p := o.Parts; p != nil && p.Denied >= 0 && p.Denied < len(z.members) {
		return z.members[p.Denied].IsQuota()
	}
	return false
}

// memberWindows is, for a multi-limit grant o with a quota among its
// members, each member's window end on the server's clock (0 for a token
// bucket member); nil otherwise, and when the grant's time is unknown.
func (z sizer) memberWindows(o Outcome) []int64 {
	if z.members == nil || o.At == 0 || o.Parts == nil || len(o.Parts.Parts) != len(z.members) {
		return nil
	}
	var ws []int64
	for i, m := range z.members {
		if m.IsQuota() {
			if ws == nil {
				ws = make([]int64, len(z.members))
			}
			ws[i] = o.At + o.Parts.Parts[i].ResetAfter.Microseconds()
		}
	}
	return ws
}

// oneDue is how long after a grant o the buckets hold a token again, by
// each limit's rule (see extra): none if the bucket holds one already; a
// calendar quota's at its boundary (o.Expire, the time to it); a token
// bucket's by its own refill; a multi-limit's when every member holds one.
func (z sizer) oneDue(o Outcome) time.Duration {
	switch {
	case z.members != nil && o.Parts != nil && len(o.Parts.Parts) == len(z.members):
		return z.wait(o.Parts, 1)
	case o.Remaining >= 1:
		return 0
	case z.members == nil && z.limit.IsQuota():
		return o.Expire
	}
	return z.limit.Interval(1 - o.Remaining)
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
