package lease

import (
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/leaselimit/leaselimit/authority"
)

// entry is the local state of one key. The fast path (Take, Denied) uses only
// atomics; refills and expiry serialise on the entry's mutex.
type entry struct {
	owner *Leases // the protocol of the entry's limit
	key   string  // the entry's own copy (see ownKey)
	// inKey holds key when it is short: in the entry's first cache line,
	// which a lookup reads anyway, and in room the entry's allocation
	// had spare (360 bytes in a size class of 384).
	inKey [inKeyLen]byte

	tokens    atomic.Int64                    // leased tokens not yet spent
	reserved  atomic.Int64                    // tokens the last refill set aside for the callers that waited on it
	expires   atomic.Int64                    // now at which the lease stops serving
	denyUntil atomic.Int64                    // negative cache: deny until this now
	denyMin   atomic.Int64                    // the request size the negative cache was set for
	availAt   atomic.Int64                    // now at which denyMin tokens are due in the bucket, as Redis last said
	lastUse   atomic.Int64                    // coarse: updated at most once per useGrain
	remote    atomic.Int64                    // tokens the bucket held at the last grant
	size      atomic.Int64                    // target lease size at the last refill
	low       atomic.Int64                    // prefetch when tokens fall below this
	refilling atomic.Bool                     // a prefetch is queued or running
	leading   atomic.Bool                     // a caller runs a refill on its own goroutine (see Leases.Lead)
	removed   atomic.Bool                     // evicted from the table; refills must refund
	fallback  atomic.Pointer[localBucket]     // the FailLocal bucket, made on first use
	parts     atomic.Pointer[authority.Multi] // a multi-limit's buckets at the last grant (see Leases.members)

	// holders is its table's list of entries that hold tokens (nil for an
	// entry made outside a table), listed whether it is on it or being
	// visited by a sweep (see listHolder), and dueSlot and dueIndex its
	// place on it (see holderList: dueSlot is 0 when it is not on it, and
	// is read without the list's lock by listHolder).
	holders  *holderList
	listed   atomic.Bool
	dueSlot  atomic.Int64
	dueIndex int

	hash uint64 // its key's hash in its table (see table.keyHash)
	// Guarded by the shard's lock: the next entry whose key's hash is
	// the same (see shard.m), the position in the shard's ring, and
	// lastUse when the eviction hand last passed.
	next *entry
	slot int
	seen int64

	pendSum atomic.Int64 // tokens wanted by callers waiting on a refill
	pendMin atomic.Int64 // smallest such want (0: none)

	mu         sync.Mutex
	rate       float64 // EWMA of locally served tokens per second
	lastRefill int64   // now of the last refill
	refilled   bool    // lastRefill is set
	level      int64   // tokens right after the last install
	lastNeed   int64   // tokens the last install reserved for waiting callers
	granted    bool    // the last refill was a grant (not a denial)
	// since and window say where the lease's tokens came from (the
	// ledger): since is the server's clock (Unix µs) at or before the
	// grant of every token the lease holds (0: unknown), window the end of
	// a calendar quota's window they belong to (0: none or unknown). Once
	// the lease is empty, the next grant sets them afresh.
	since  int64
	window int64
	// fresh of the lease's tokens were granted at or after freshSince
	// (later than since): the newest grants, kept apart from the older
	// tokens they joined. A prefetch that Redis runs after a Reset lands on
	// a lease still holding the old generation's tokens; stamped with
	// since alone, its tokens would go back as old ones and be dropped
	// (tokens lost to the fresh bucket). Returns give back the fresh part
	// first (see holding): spent tokens count as the older ones.
	fresh, freshSince int64
	// lowered counts the times since went down (a grant older than the
	// lease's tokens joined it, or took an empty lease over): a reader of
	// since before a take and again after it knows the take's tokens are
	// no older than the first reading only if it did not change (see
	// Leases.Stamps).
	lowered int64
	// newest is the latest grant time of any token the lease has held
	// (an upper bound; math.MaxInt64 when a grant's time was unknown): a
	// reservation's excess is charged to the newest generation its tokens
	// may be of (see Stamp.Ceiling). It never goes down, so a reading
	// after a take bounds what the take had.
	newest int64
	// windows, for a multi-limit's lease, are its members' window ends
	// (0 for a token bucket member): fixed for the lease's life, since a
	// grant of another window never joins it (see sizer.Install).
	windows []int64
	grow    int64 // slow-start lease size (see Plan)
	batch   int64 // at its limit: the fewest tokens the next refill takes (see Install)
}

// inKeyLen is the longest key an entry holds in itself.
const inKeyLen = 24

// ownKey sets e's key to a copy of key, never key itself: a caller's key
// may be a slice of a larger string (a request's path or header), which
// an entry holding it would keep alive as long as the table holds the
// key. A key of up to inKeyLen bytes is copied into the entry, no
// allocation; a longer one into a string of its own. Called once, before
// e is in the table.
func (e *entry) ownKey(key string) {
	if len(key) > len(e.inKey) {
		e.key = strings.Clone(key)
		return
	}
	n := copy(e.inKey[:], key)
	e.key = unsafe.String(&e.inKey[0], n)
}

// useGrain is how stale entry.lastUse may be; it keeps hot keys from writing
// a shared cache line on every hit.
const useGrain = int64(10 * time.Millisecond)

// leaseOnFirstRefill has e's first refill lease one token beyond what its
// callers need, for a key that came back within a lease's life (see
// doorkeeper): no demand is measured before that refill, and a first
// refill for exactly the callers' need spent a Redis call on a key that
// had already shown the repeat a lease serves, so its lease came a sight
// later. It starts slow start at one token, which the first refill's
// outcome then doubles or halves (see sizer.slowStart). On the comparison
// harness's cold long tail (200,000 keys, each back about every 2 s
// against a TTL of 2 s; compare -lead-in), leases made 0.85-0.90x exact
// mode's decisions/s with it and 0.74-0.82x without, in four alternated
// pairs of runs: a spare token that expires costs a refund, which goes in
// one script call with the others of its flush, and one that is used
// saves a Redis call.
func (e *entry) leaseOnFirstRefill() {
	e.mu.Lock()
	if !e.refilled && e.grow == 0 {
		e.grow = 1
	}
	e.mu.Unlock()
}

// Key returns the user key of e.
func (e *entry) Key() string { return e.key }

// Tokens returns the leased tokens not yet spent.
func (e *entry) Tokens() int64 { return e.tokens.Load() }

// fallbackBucket returns e's FailLocal bucket, creating it on first use.
func (e *entry) fallbackBucket(make func() *localBucket) *localBucket {
	if b := e.fallback.Load(); b != nil {
		return b
	}
	e.fallback.CompareAndSwap(nil, make())
	return e.fallback.Load()
}

// Reserved returns the tokens set aside for callers waiting on a refill.
func (e *entry) Reserved() int64 { return e.reserved.Load() }

// Remote returns how many tokens the bucket held at the last grant.
func (e *entry) Remote() int64 { return e.remote.Load() }

// Removed reports whether e was evicted from its table; a caller holding it
// should look the key up again.
func (e *entry) Removed() bool { return e.removed.Load() }

// holdsTokens reports whether e holds leased tokens, for its callers or
// reserved for waiting ones, expired or not: tokens debited from the
// bucket that must be spent or go back.
func (e *entry) holdsTokens() bool { return e.tokens.Load()+e.reserved.Load() > 0 }

// leaseLive reports whether e holds leased tokens that are still good at
// now (see holdsTokens).
func (e *entry) leaseLive(now int64) bool { return e.holdsTokens() && now < e.expires.Load() }

// Take spends n tokens (n >= 1) of a live lease. It reports whether it did and how
// many leased tokens are left. It never blocks and never allocates.
func (e *entry) Take(n, now int64) (ok bool, left int64) {
	if now >= e.expires.Load() {
		return false, 0
	}
	e.Touch(now)
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

// upperOf is a grant time as an upper bound: at, or math.MaxInt64 for an
// unknown time (0).
func upperOf(at int64) int64 {
	if at == 0 {
		return math.MaxInt64
	}
	return at
}

// Give adds n tokens to a live lease; it reports false for an expired one,
// and for tokens that may be older than the lease's own or of another
// calendar window (since and window are their stamps, see entry.since):
// tokens taken before a Reset must not join a lease of the fresh bucket,
// where they would be spent, not dropped. e.mu orders it against expiry,
// which takes the tokens back.
func (e *entry) Give(n, since, newest, window, now int64) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if now >= e.expires.Load() || e.removed.Load() || since == 0 || since < e.since || window != e.window {
		return false
	}
	e.newest = max(e.newest, upperOf(newest))
	// The fresh part is what is left of it before the surplus joins the
	// older tokens (see stampGrant: read after the add, a lower bound).
	before := e.tokens.Add(n) - n + e.reserved.Load()
	e.fresh = min(e.fresh, max(before, 0))
	e.level += n
	e.listHolder()
	return true
}

// Charge takes n tokens out of a live lease, for an excess settled against
// it; it reports false, taking nothing, for an expired lease, fewer tokens,
// and for an excess whose tokens are all older than the lease's (since is
// the newest grant time they may be of: see Stamp.Ceiling): a reservation
// taken before a Reset must not be charged to a lease of the fresh bucket,
// which would charge the fresh bucket (the authority drops such a charge). The excess of a reservation
// no older than the lease's older tokens is paid here even when those are
// spent and it comes out of the fresh part (see entry.fresh), which keeps a
// settlement against a live lease off Redis: should a Reset lie between
// the two, the fresh bucket pays that excess (under-admission by at most
// the excess, never more tokens).
func (e *entry) Charge(n, since, now int64) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if now >= e.expires.Load() || e.removed.Load() || since == 0 || since < e.since {
		return false
	}
	ok, _ := e.Take(n, now)
	return ok
}

// TakeReserved spends n of the tokens the last refill set aside for the
// callers that waited on it (see Install), so that callers on the fast path
// cannot take them first. It reports whether it did.
func (e *entry) TakeReserved(n int64) bool {
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
// refilled ahead of time, and claims the refill when it is (Decide hands
// the claim to its caller as Answer.Prefetch; Prefetched releases it).
func (e *entry) NeedsPrefetch(left int64) bool {
	if left >= e.low.Load() || e.refilling.Load() {
		return false
	}
	return e.refilling.CompareAndSwap(false, true)
}

// PrefetchDone releases the claim taken by NeedsPrefetch.
func (e *entry) PrefetchDone() { e.refilling.Store(false) }

// Touch records a use of e at now.
func (e *entry) Touch(now int64) {
	if now-e.lastUse.Load() > useGrain {
		e.lastUse.Store(now)
	}
}

// AddPending registers a caller that waits for a refill and needs n tokens.
// The next Plan includes it.
func (e *entry) AddPending(n int64) {
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

// held is tokens taken out of a lease, with the ledger stamps of the
// lease (see entry.since): where they go back to.
type held struct {
	tokens, since, window int64
	windows               []int64 // a multi-limit's: each member's window end (see entry.windows)
	fresh, freshSince     int64   // of tokens, fresh were granted at or after freshSince (see entry.fresh)
}

// Expire takes back the tokens of e's lease when it has expired at now and
// returns how many, for refunding.
func (e *entry) Expire(now int64) int64 { return e.expireHeld(now).tokens }

// expireHeld is Expire, with the tokens' stamps.
func (e *entry) expireHeld(now int64) held {
	if now < e.expires.Load() || !e.holdsTokens() {
		return held{}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if now < e.expires.Load() {
		return held{}
	}
	return e.takeAll()
}

// Drain takes back every leased token of e, expired or not (for Close and
// eviction).
func (e *entry) Drain() int64 { return e.drainHeld().tokens }

// drainHeld is Drain, with the tokens' stamps.
func (e *entry) drainHeld() held {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.takeAll()
}

// takeAll empties the lease and its reservation, and returns what it held
// with the stamps read under the same lock (a refill that installs after
// it stamps the lease anew); e.mu must be held.
func (e *entry) takeAll() held {
	t := e.tokens.Swap(0) + e.reserved.Swap(0)
	e.level = 0
	h := e.holding(max(t, 0))
	e.fresh, e.freshSince = 0, 0
	return h
}

// holding is n tokens taken out of e's lease, stamped as the lease is: as
// many of its fresh tokens as there are (see entry.fresh), the rest as its
// older ones. e.mu must be held.
func (e *entry) holding(n int64) held {
	h := held{tokens: n, since: e.since, window: e.window, windows: e.windows}
	if f := min(n, e.fresh); f > 0 {
		h.fresh, h.freshSince = f, e.freshSince
		e.fresh -= f
	}
	return h
}

// stampGrant records the stamps of granted tokens that joined the lease
// (see entry.since and entry.fresh); before is what the lease held just
// before they joined, or less. The ledger counts spent tokens as the
// older ones first: of the tokens held before, the fresh part is what is
// left of it (at most before). A lease that held nothing takes the
// grant's stamps. One still holding tokens keeps the earlier since (a
// lower bound of them all) and, for a calendar quota, must be of the same
// window (see sizer.Install); a later grant becomes its fresh part, or
// joins it. Once the lease held no more than its fresh part (the older
// tokens are spent), that part becomes the older one and the grant the
// fresh one. e.mu must be held.
//
// before is a lower bound because takes run without the lock: reading it
// after the grant joined counts every take before that moment, and a
// take after it spends the older tokens first. Read before the grant
// joined, it could count tokens spent meanwhile as still in the lease,
// and the fresh part would claim them (tokens of an older generation
// given back to the fresh bucket).
func (e *entry) stampGrant(at, granted, before, window int64, windows []int64) {
	if at < e.since {
		e.lowered++
	}
	e.newest = max(e.newest, upperOf(at))
	if before <= 0 {
		e.since, e.window, e.windows = at, window, windows
		e.fresh, e.freshSince = 0, 0
		return
	}
	e.fresh = min(e.fresh, before)
	switch {
	case at <= e.since:
		// An unknown time (0), or no later than the older tokens: a
		// lower bound of them all.
		e.since = at
	case e.fresh <= 0:
		e.fresh, e.freshSince = granted, at
	case before <= e.fresh && at > e.freshSince:
		e.since = e.freshSince
		e.fresh, e.freshSince = granted, at
	default:
		e.fresh += granted
		e.freshSince = min(e.freshSince, at)
	}
}
