package lease

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
)

// Leases is the local decision protocol of one limit and its local state:
// the keys of a Table (shared by every limit of one engine) that are under
// this limit, each with a lease of tokens already debited from the
// authority's bucket, a negative cache and a FailLocal bucket. It does no
// I/O and reads no clock: every call takes now, and what the authority must
// be asked comes back as a Refill for the caller to perform.
//
// One decision for n tokens of a key:
//
//	a := Decide(key, n, now)
//	Leased   admitted from the lease; if a.Prefetch, refill a.Ticket in
//	         the background (Plan, Complete), then call Prefetched
//	Cached   denied by the negative cache
//	Exact    a key not seen lately (see doorkeeper): ask the authority for
//	         exactly n outside any lease; a.Ticket is empty, and the key
//	         has no local state until it comes back
//	Miss     Join(a.Ticket), then wait for the refill of the key (one
//	         caller runs it: r := Plan(t, now), ask the authority,
//	         Complete(r, grant, now)); then Collect(t, outcome, now):
//	  Granted   admitted from that refill's tokens
//	  Refused   the authority denied
//	  Cached    the refill went to others and the key is now denied
//	  Miss      the refill went to others: Join again
//	  Exact     the refills went to others too often: ask the authority
//	            for exactly n outside the lease
//
// Tokens that must go back to the authority (an evicted or expired lease, a
// refill that arrived for an evicted key) come back as Returns.
type Leases struct {
	table    *table
	limit    policy.Limit
	local    policy.Limit // FailLocal's per-instance share of limit
	sizer    sizer
	maxShare float64 // a refill takes at most this share of the bucket
	// members, for a multi-limit, are its limits: every lease token was
	// taken from each of their buckets, and goes back to each. limit is
	// then the multi-limit's envelope (see NewGroup).
	members []policy.Limit
	// salt is this limit's, no other's: with a key it names the key's
	// entry in the table, and it keeps its keys and another's apart in
	// the doorkeeper and over the shards.
	salt uint64
	// forgotUntil is when (unix ns) the last FailLocal bucket the table
	// evicted before it refilled would have refilled: until then a new
	// one starts empty (see newLocalBucket).
	forgotUntil atomic.Int64
	forgotIn    atomic.Uint64 // the table's outages count then
	// Every lease hit reads the fields above; the memory allocator may put
	// an entry, written on every hit, right after this struct, sharing its
	// last cache line (measured: +16% on a hot key). The pad keeps them
	// apart.
	_ [64]byte
}

// New returns the protocol for limit in table t, with lease settings s
// (defaults applied) and FailLocal shares for a fleet of fleetSize
// instances. limit and s must be valid. Each limit of an engine has one
// Leases: its keys are its own, apart from those of other limits in t.
func New(t *Table, limit policy.Limit, s policy.Lease, fleetSize int) *Leases {
	s = s.WithDefaults()
	return &Leases{
		limit:    limit,
		local:    Share(limit, fleetSize),
		sizer:    makeSizer(limit, s),
		table:    t.t,
		maxShare: s.MaxShare,
		salt:     salts.Add(0x9E3779B97F4A7C15), // a distinct, well-mixed value per Leases
	}
}

// salts hands each Leases its salt.
var salts atomic.Uint64

// NewGroup returns the protocol for a multi-limit named name in table t:
// leases whose every token was taken from each of members' buckets at
// once. Their envelope sizes them: a limit no looser than any member, so
// that a lease is bounded by every limit.
func NewGroup(t *Table, name string, members []policy.Limit, s policy.Lease, fleetSize int) *Leases {
	ls := New(t, envelope(name, members), s, fleetSize)
	ls.members = members
	ls.sizer.members = members
	return ls
}

// envelope is the limit named name that sizes the leases of members
// together: no looser than any of them (the least burst, the slowest
// refill per token), so that a lease is bounded by every limit.
func envelope(name string, members []policy.Limit) policy.Limit {
	env := policy.Limit{Name: name, Rate: members[0].Rate, Period: members[0].Period, Burst: members[0].Burst}
	for _, l := range members[1:] {
		env.Burst = min(env.Burst, l.Burst)
		// l refills more slowly per token when Period/Rate is larger.
		if float64(l.Period)/float64(l.Rate) > float64(env.Period)/float64(env.Rate) {
			env.Rate, env.Period = l.Rate, l.Period
		}
	}
	return env
}

// Limit returns the limit the protocol decides for.
func (ls *Leases) Limit() policy.Limit { return ls.limit }

// Status says what an Answer decided, or what the caller must do next.
type Status uint8

const (
	// Leased: admitted from tokens the lease already held.
	Leased Status = iota
	// Cached: denied by the negative cache, set by an earlier denial.
	Cached
	// Granted: admitted from the tokens of the refill the caller waited for.
	Granted
	// Refused: the authority denied the refill the caller waited for.
	Refused
	// Miss: undecided; Join the Ticket and wait for a refill of the key.
	Miss
	// Exact: undecided; ask the authority for exactly n tokens outside the
	// lease: from Decide, a key not seen lately (no Ticket); from Collect,
	// refills of the key keep going to other callers first.
	Exact
)

// Answer is the protocol's reply to one request.
type Answer struct {
	Status     Status
	Remaining  int64         // tokens left for the key, best knowledge (decided answers)
	RetryAfter time.Duration // denied answers: until the request can be admitted
	// Ticket is the caller's place in a refill of its key (Miss, and Exact
	// from Collect), or the prefetch it claimed (Leased with Prefetch). It
	// is empty otherwise: Exact from Decide has none.
	Ticket Ticket
	// Prefetch asks the caller of a Leased answer to refill Ticket in the
	// background before the lease runs dry, then to call Prefetched.
	Prefetch bool
	// Evicted, if set, holds tokens of another key's lease, evicted to make
	// room for this key: they must be returned to the authority. (A
	// pointer keeps Answer small enough to be returned in registers.)
	Evicted *Return
	// Parts, for a multi-limit, is each member's bucket at the key's last
	// grant, and which one denied (nil before a grant, and for one limit).
	Parts *authority.Multi
}

// Ticket is one caller's place in the refills of its key.
type Ticket struct {
	e     *entry
	n     int64 // tokens the caller needs
	tries int   // refills that went to other callers
}

// Key returns the user key the ticket is for.
func (t Ticket) Key() string { return t.e.key }

// Return is unused tokens of a key's lease, to give back to its bucket.
type Return struct {
	Limit  policy.Limit // the limit of the lease's bucket
	Key    string       // user key
	Tokens int64
	// Limits, for a multi-limit's lease, are its limits: the tokens go
	// back to each of their buckets (Limit is then the envelope, no bucket).
	Limits []policy.Limit
	// Since and Window say where the tokens came from (authority.Refund's
	// fields of the same names): the server's clock at or before their
	// grant, and for a calendar quota the end of their window (for a
	// multi-limit's lease, the soonest of its quotas' ends, which keeps
	// the lease from outliving it).
	Since, Window int64
	// Windows, for a multi-limit's lease with a calendar quota among its
	// Limits, is each member's window end (0 for a token bucket): each
	// quota takes its tokens back only within that window, as a quota's
	// own lease does. Nil when unknown: the quotas then take none back.
	Windows []int64
	// Fresh of the Tokens were granted at or after FreshSince, later than
	// Since (0: none): they go back stamped so (see Stamped), to the
	// bucket's generation they came from though the rest may be older.
	Fresh, FreshSince int64
}

// Stamped splits r into the returns of one stamp each that give it back
// (the first n of parts): its fresh tokens stamped FreshSince, then the
// rest stamped Since. An array, not a slice: a refund queue splits every
// return it takes, and a slice was an allocation each.
func (r Return) Stamped() (parts [2]Return, n int) {
	if r.Fresh <= 0 {
		return [2]Return{r}, 1
	}
	fresh, older := r, r
	fresh.Tokens, fresh.Since = r.Fresh, r.FreshSince
	older.Tokens -= r.Fresh
	fresh.Fresh, fresh.FreshSince, older.Fresh, older.FreshSince = 0, 0, 0, 0
	if older.Tokens <= 0 {
		return [2]Return{fresh}, 1
	}
	return [2]Return{fresh, older}, 2
}

// Refill is one refill of a key's lease: what to ask the authority for.
// Acquire between Min and Want tokens, at most max(Min, Share × the
// bucket's tokens), all or nothing below Min.
type Refill struct {
	Want, Min int64
	Share     float64
	// Expired is the tokens of a lease that expired before this refill,
	// taken out so that the refill does not count them (nor revive them:
	// a calendar quota's may be of an ended window): to return. Nil when
	// none did: a Refill lives on the heap for every refill (the value
	// its callers share), and a Return is 160 bytes.
	Expired *Return
	e       *entry
	req     request
}

// maxTries is how many refills a caller waits for before it asks the
// authority for exactly its n (Exact): a busy key never denies a request
// the bucket can serve because concurrent callers took each refill first.
const maxTries = 4

// Decide answers a request for n tokens of key at now: admitted from the
// lease, denied by the negative cache, Exact for a key not seen lately (see
// doorkeeper), or a Miss to be refilled. It never blocks; a lease hit does
// not allocate.
func (ls *Leases) Decide(key string, n, now int64) Answer {
	h := ls.table.keyHash(ls, key) // for the table, and for the doorkeeper on a miss
	e := ls.table.getHashed(h, ls, key)
	if e != nil {
		if ok, left := e.Take(n, now); ok {
			a := Answer{Status: Leased, Remaining: ls.remaining(e, left), Parts: ls.parts(e)}
			if e.NeedsPrefetch(left) {
				a.Prefetch, a.Ticket = true, Ticket{e: e}
			}
			return a
		}
		// The last use before this decision, for the lapse below: Take
		// touched the entry only if its lease was live, and the lapse
		// applies only to a lease that is over, so it is read here, off
		// the lease hit's path, and before the Touch.
		used := e.lastUse.Load()
		// A use, whether denied from the cache or refilled: the eviction
		// hand and the doorkeeper (see table.GetOrCreate) read it.
		e.Touch(now)
		// A request larger than the lease that the bucket and the lease
		// could serve together (a Settle surplus joined the lease) is not
		// denied from the cache: it goes to the authority, whose denial
		// the caller then pools with the lease (see Surrender).
		if denied, wait := ls.sizer.Denied(e, n, now); denied && !pooled(e, n, now) {
			return Answer{Status: Cached, Remaining: e.Remote(), RetryAfter: wait, Parts: ls.parts(e)}
		}
		if now >= e.expires.Load() && !e.Removed() && ls.table.lapsed(used, now, int64(ls.sizer.settings.TTL)) {
			// Its lease over and the key not used within a lease's life:
			// new again, as a key the table does not hold (see
			// table.lapsed).
			return Answer{Status: Exact}
		}
	}
	if e == nil && !ls.table.seen(h, now, int64(ls.sizer.settings.TTL)) {
		// A key not seen within a lease's life: exactly n from the
		// authority, and no entry until it comes back within one (see
		// doorkeeper).
		return Answer{Status: Exact}
	}
	a := Answer{Status: Miss, Ticket: Ticket{e: e, n: n}}
	if e == nil || e.Removed() {
		var ev Return
		a.Ticket.e, ev = ls.admit(h, key, now)
		if a.Ticket.e == nil {
			// A full shard whose keys hold live leases declined it (see
			// table.Admit).
			return Answer{Status: Exact}
		}
		a.Evicted = evicted(ev)
		if ls.table.door.size != 0 {
			// The doorkeeper let the key in: it came back within a
			// lease's life, the demand a lease serves.
			a.Ticket.e.leaseOnFirstRefill()
		}
	}
	return a
}

// Cached reports whether Decide would deny one token of key at now from
// the negative cache (the lease holding none), and the retry-after it
// would say; it changes nothing. Peek asks it, so that it agrees with the
// next Allow here.
func (ls *Leases) Cached(key string, now int64) (bool, time.Duration) {
	e := ls.table.Get(ls, key)
	if e == nil || (e.tokens.Load() >= 1 && now < e.expires.Load()) {
		return false, 0
	}
	return ls.sizer.Denied(e, 1, now)
}

// pooled reports whether e's live lease and what its bucket held at the
// last answer could serve n tokens together, though the lease alone
// cannot (see Surrender, which gives such a lease back).
func pooled(e *entry, n, now int64) bool {
	t := e.tokens.Load()
	return n > 1 && t > 0 && t < n && t+e.Remote() >= n && now < e.expires.Load()
}

// Pooled reports whether key's live lease and its bucket, as the authority
// last said, could serve n tokens together though neither alone can: a
// request the authority denied that the caller can serve by giving the
// lease back first (Surrender), then asking for all of it.
func (ls *Leases) Pooled(key string, n, now int64) bool {
	e := ls.table.Get(ls, key)
	return e != nil && pooled(e, n, now)
}

// evicted returns r as an Answer's Evicted: nil when it holds no tokens.
// The copy is made only then: returning &r moved r to the heap on every
// call, an allocation of 160 bytes for each key the table took in (on the
// comparison's cold long tail, one decision in six), tokens or not.
func evicted(r Return) *Return {
	if r.Tokens <= 0 {
		return nil
	}
	p := new(Return)
	*p = r
	return p
}

// Join counts t's caller in the next refill of its key: call it before
// waiting for that refill. A caller that stops waiting leaves its count in;
// the tokens it would have taken then join the lease.
func (ls *Leases) Join(t Ticket) { t.e.AddPending(t.n) }

// Lead claims the refill of t's key for t's caller, to run on its own
// goroutine: it reports false while another caller holds the claim (that
// caller's refill is running, and t's caller waits for it). Led releases
// the claim. The claim is a hint for whoever coalesces the refills (it
// saves a goroutine for the one caller of a cold key), not a lock: two
// refills of one key at once are still correct.
func (ls *Leases) Lead(t Ticket) bool { return t.e.leading.CompareAndSwap(false, true) }

// Led releases the claim Lead took.
func (ls *Leases) Led(t Ticket) { t.e.leading.Store(false) }

// Plan starts the refill that the callers joined to t's key wait for: the
// one caller that performs it calls Plan once, asks the authority, and
// hands the grant to Complete.
func (ls *Leases) Plan(t Ticket, now int64) Refill {
	req, expired := ls.sizer.Plan(t.e, now)
	share := ls.maxShare
	if req.Whole {
		share = 1
	}
	r := Refill{Want: req.Want, Min: req.Min, Share: share, e: t.e, req: req}
	if expired.tokens > 0 {
		back := t.e.back(expired)
		r.Expired = &back
	}
	return r
}

// Complete installs the authority's grant for r at now: granted tokens go
// to the lease (reserved for the callers counted in the plan), a denial
// starts the negative cache. It returns the outcome each waiting caller
// collects, and the tokens to return to the bucket: the grant's, if the key
// was evicted meanwhile, and those of a calendar quota's lease of an
// earlier window, which the grant's must not join. A refill that failed is
// not completed.
func (ls *Leases) Complete(r Refill, g authority.Grant, now int64) (o Outcome, back []Return) {
	if g.Multi != nil {
		r.e.parts.Store(g.Multi)
	}
	o = Outcome{Granted: g.Granted, Remaining: g.Remaining, RetryAfter: g.RetryAfter, Min: r.req.Min,
		Expire: ls.windowEnd(g), At: g.At, Window: ls.window(g), Parts: g.Multi}
	evicted, stale := ls.sizer.Install(r.e, r.req, o, now)
	if stale.tokens > 0 {
		back = append(back, r.e.back(stale))
	}
	if evicted > 0 {
		back = append(back, r.e.back(held{tokens: evicted, since: g.At, window: o.Window, windows: ls.sizer.memberWindows(o)}))
	}
	return o, back
}

// window is the Window stamp of a grant g's tokens: for a calendar quota,
// the end of its window on the server's clock (the grant's time plus the
// time to the boundary); for a multi-limit with quota members, the soonest
// such end (its lease must not outlive it: see Install); 0 for token
// buckets and for a grant whose time is unknown.
func (ls *Leases) window(g authority.Grant) int64 {
	if g.At == 0 {
		return 0
	}
	if end := ls.windowEnd(g); end > 0 {
		return g.At + end.Microseconds()
	}
	return 0
}

// Collect answers t's caller once the refill it waited for completed with
// o: admitted from the tokens reserved for it (or any left in the lease),
// denied as the authority said, or, when the refill's tokens went to
// others, Cached, Miss (Join t again) or Exact.
func (ls *Leases) Collect(t Ticket, o Outcome, now int64) Answer {
	e, n := t.e, t.n
	// A calendar quota's tokens set aside for this caller are of the
	// window the refill was granted in: once the lease that window bounds
	// has expired (the reply came after the boundary), they must not admit
	// a request of the next window; they go back with the lease.
	if !(ls.quota() && now >= e.expires.Load()) && e.TakeReserved(n) {
		return Answer{Status: Granted, Remaining: ls.remaining(e, e.Tokens()), Parts: ls.parts(e)}
	}
	if ok, left := e.Take(n, now); ok {
		return Answer{Status: Granted, Remaining: ls.remaining(e, left), Parts: ls.parts(e)}
	}
	if o.Granted == 0 && o.Min <= n {
		// The authority said when Min tokens are due; n may need longer,
		// by each limit's own rule (see extra).
		more, _ := ls.sizer.extra(o.Remaining, o.Parts, o.Min, n)
		retry := o.RetryAfter + more
		// And not before the negative cache the denial set ends (a key
		// at its limit waits for a batch): retrying at the authority's
		// time alone would only be denied again, from the cache.
		if denied, wait := ls.sizer.Denied(e, n, now); denied && wait > retry {
			retry = wait
		}
		return Answer{Status: Refused, Remaining: o.Remaining, RetryAfter: retry, Parts: ls.parts(e)}
	}
	// Past here the refill's tokens went to others, or it was denied for
	// more than n (a caller that joined a refill already planned without
	// it): the negative cache it set says what it says of n, or the caller
	// asks again.
	if denied, wait := ls.sizer.Denied(e, n, now); denied {
		return Answer{Status: Cached, Remaining: e.Remote(), RetryAfter: wait, Parts: ls.parts(e)}
	}
	t.tries++
	if t.tries >= maxTries {
		return Answer{Status: Exact, Ticket: t}
	}
	a := Answer{Status: Miss, Ticket: t}
	if e.Removed() {
		var ev Return
		a.Ticket.e, ev = ls.getOrCreate(e.key, now)
		a.Evicted = evicted(ev)
	}
	return a
}

// Prefetched releases the prefetch claimed by a Leased answer once its
// refill has run, failed or been skipped.
func (ls *Leases) Prefetched(t Ticket) { t.e.PrefetchDone() }

// AllowLeased admits n tokens of key from a lease it still holds at now, without
// the authority: while the authority is unavailable, leases keep serving
// until they expire.
func (ls *Leases) AllowLeased(key string, n, now int64) (Answer, bool) {
	e := ls.table.Get(ls, key)
	if e == nil {
		return Answer{}, false
	}
	ok, left := e.Take(n, now)
	if !ok {
		return Answer{}, false
	}
	return Answer{Status: Leased, Remaining: ls.remaining(e, left), Parts: ls.parts(e)}, true
}

// Local is a decision of the FailLocal bucket: this instance's share of
// the limit, enforced alone while the authority is unavailable.
type Local struct {
	Allowed    bool
	Remaining  int64
	RetryAfter time.Duration // denied: until n tokens are due, or Never above the share's burst
	Evicted    *Return       // as in Answer
}

// AllowLocal takes n tokens of key's FailLocal bucket at now, all or
// nothing (see Share for the bucket's limit).
func (ls *Leases) AllowLocal(key string, n, now int64) Local {
	e, ev := ls.getOrCreate(key, now)
	e.Touch(now)
	ok, rem, retry := e.fallbackBucket(func() *localBucket { return ls.newLocalBucket(now) }).Allow(ls.local, n, now)
	if e.Removed() {
		// Evicted while this call took from its bucket (or made it): the
		// eviction may have found it full, and the key made anew. Noted
		// now, the next new buckets start empty; a key made anew in
		// between is over by at most the calls in flight at the eviction.
		ls.forgetFallback(e, now)
	}
	return Local{Allowed: ok, Remaining: rem, RetryAfter: retry, Evicted: evicted(ev)}
}

// LocalShare returns the limit of the FailLocal buckets: this instance's
// share of the fleet's limit.
func (ls *Leases) LocalShare() policy.Limit { return ls.local }

// LastKnown returns the best local knowledge of key's remaining tokens:
// what the authority last said plus the lease, or a full bucket for a key
// it has not been asked about.
func (ls *Leases) LastKnown(key string) int64 {
	if e := ls.table.Get(ls, key); e != nil && e.Remote() > 0 {
		return min(e.Remote()+e.Tokens(), ls.limit.Burst)
	}
	return ls.limit.Burst
}

// Outstanding returns the tokens this instance holds for key at now: its live
// lease and the tokens set aside for callers waiting on a refill. They are
// debited from the bucket already, so a reader of the bucket counts them as
// available.
func (ls *Leases) Outstanding(key string, now int64) int64 {
	e := ls.table.Get(ls, key)
	if e == nil || now >= e.expires.Load() {
		return 0
	}
	return max(e.Tokens(), 0) + e.Reserved()
}

// Give puts n tokens (taken from the bucket already and not used, such as
// the surplus of a settled reservation) into key's live lease at now, to be
// spent here or returned with the lease. since and window stamp them (see
// Return), and newest bounds their grant times from above (see
// Stamp.Ceiling): tokens of another calendar window than the lease's do
// not join it. It reports false, changing nothing, when they cannot join.
func (ls *Leases) Give(key string, n, since, newest, window, now int64) bool {
	e := ls.table.Get(ls, key)
	if e == nil || n <= 0 {
		return false
	}
	if ls.members != nil {
		// A multi-limit's tokens are named by no one window: they join a
		// lease whose Window is 0 (no quota member), never one that ends
		// with a quota's window (see Leases.window).
		window = 0
	}
	return e.Give(n, since, newest, window, now)
}

// Surrender takes the unspent tokens of key's live lease out at now, to go
// back to the bucket, and ends its negative cache: for a request larger
// than the lease that the bucket and the lease could serve together (the
// caller returns the tokens, then asks for the whole request). Tokens set
// aside for callers waiting on a refill stay theirs.
func (ls *Leases) Surrender(key string, now int64) Return {
	e := ls.table.Get(ls, key)
	if e == nil {
		return Return{}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if now >= e.expires.Load() {
		return Return{}
	}
	n := max(e.tokens.Swap(0), 0)
	e.level -= n
	e.denyUntil.Store(0)
	return e.back(e.holding(n))
}

// Stamp is what key's lease says of where its tokens came from (see
// Return), read under its lock: Since, at or before the grant of every
// token it holds now (it grows, but for a grant older than the lease's
// tokens, a late reply or one of unknown time 0, which Lowered counts);
// Window, the calendar window of its tokens (a lease's Window only moves
// forward); Windows, for a multi-limit, its members' window ends (see
// entry.windows; read-only). A reader before and after a take brackets
// the taken tokens' stamps.
type Stamp struct {
	Since, Window int64
	Windows       []int64
	// Lowered counts the times the lease's Since went down (a grant
	// older than its tokens joined it): readings before and after a take
	// with the same Lowered and no lower Since after bound the taken
	// tokens by the first Since.
	Lowered int64
	// Newest is the latest grant time of any token the lease has held
	// (math.MaxInt64 when unknown); it never goes down (see Ceiling).
	Newest int64
	e      *entry // the entry read: a key evicted and seen again has a new one, whose Lowered starts afresh
}

// Ceiling is what bounds from above the grant times of tokens taken from a
// lease between reading s and reading after: the lease's newest grant by
// the second reading, or math.MaxInt64 (unknown, the current generation's)
// when the key's lease was made anew meanwhile. A reservation's excess is
// charged to the newest generation its tokens may be of: charged to a
// fresh bucket for tokens of an older one, it under-admits; forgiven for
// tokens of the fresh one, it would over-admit.
func (s Stamp) Ceiling(after Stamp) int64 {
	if after.e != s.e || after.e == nil {
		return math.MaxInt64
	}
	return max(s.Newest, after.Newest)
}

// Floor is what bounds from below the grant times of tokens taken from a
// lease between reading s and reading after: s.Since, unless the lease's
// Since went down meanwhile (a grant older than its tokens joined it, and
// the take may have had some of them) or the key's lease was made anew (it
// was evicted, taking that count with it): 0, unknown.
func (s Stamp) Floor(after Stamp) int64 {
	if after.e != s.e || after.Lowered != s.Lowered || after.Since < s.Since {
		return 0
	}
	return s.Since
}

// Stamps returns key's lease's Stamp, and whether key has a lease that
// was ever stamped and is live at now: the stamps of an expired lease say
// nothing of the tokens its next refill brings (a calendar quota's, of the
// next window).
func (ls *Leases) Stamps(key string, now int64) (Stamp, bool) {
	e := ls.table.Get(ls, key)
	if e == nil {
		return Stamp{}, false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return Stamp{Since: e.since, Window: e.window, Windows: e.windows, Lowered: e.lowered, Newest: e.newest, e: e}, e.since != 0 && now < e.expires.Load()
}

// Charge takes n tokens of key's live lease at now, for a reservation's
// excess, when that is the same as charging the bucket: the lease's
// unused tokens all go back to it, and they are of the reservation's
// generation (since, the newest grant time its tokens may be of, is no
// older than the lease's: see entry.Charge). A lease that holds a calendar quota's
// tokens never pays a charge: what it holds when its window ends is not
// given back (the next window started full), so a charge paid from it
// would cost the quota nothing.
func (ls *Leases) Charge(key string, n, since, now int64) bool {
	e := ls.table.Get(ls, key)
	if e == nil || n <= 0 || ls.quota() {
		return false
	}
	return e.Charge(n, since, now)
}

// quota reports whether a calendar quota is among the limits.
func (ls *Leases) quota() bool {
	if ls.limit.IsQuota() {
		return true
	}
	for _, m := range ls.members {
		if m.IsQuota() {
			return true
		}
	}
	return false
}

// Forget drops key's local state at once: its lease (the tokens are not
// returned: the bucket they came from is gone), its negative cache and its
// FailLocal bucket. A refill in flight for key installs into nothing and
// returns its tokens, as for an evicted key.
func (ls *Leases) Forget(key string) {
	if e := ls.table.Remove(ls, key); e != nil {
		e.Drain()
	}
}

// parts returns e's multi-limit state at its last grant (nil for one limit).
func (ls *Leases) parts(e *entry) *authority.Multi {
	if ls.members == nil {
		return nil
	}
	return e.parts.Load()
}

// extra returns how much longer (negative: shorter) a request for n
// tokens waits than one for m, from the buckets as an authority's denial
// of m read them (remaining, a single limit's whole tokens; p, a
// multi-limit's members), by the rule of each limit: a token bucket's own
// refill of the difference; nothing for a calendar quota, whose tokens
// come back all at once at its boundary, and fits for a smaller request a
// single quota held enough for (its denial says nothing of that request).
// A multi-limit waits until every member holds n (see wait). Never the
// envelope's refill: it is the slowest member's, and a quota's Period/Rate
// refills nothing.
func (z sizer) extra(remaining int64, p *authority.Multi, m, n int64) (more time.Duration, fits bool) {
	switch {
	case n == m:
		return 0, false
	case z.members == nil && z.limit.IsQuota():
		return 0, n < m && n <= remaining
	case z.members == nil || p == nil || len(p.Parts) != len(z.members):
		// One token bucket (or, had a multi-limit's denial no parts, its
		// envelope, which is never faster than a member).
		if n > m {
			return z.limit.Interval(n - m), false
		}
		return -z.limit.Interval(m - n), false
	}
	return z.wait(p, n) - z.wait(p, m), false
}

// wait is how long after p's reading every member of a multi-limit holds k
// tokens, each by its own rule: a calendar quota short of k until its
// window ends (its ResetAfter); a token bucket short of k until its refill
// brings it there (full at its ResetAfter, it holds k the refill time of
// Burst-k before).
func (z sizer) wait(p *authority.Multi, k int64) time.Duration {
	var w time.Duration
	for i, l := range z.members {
		part := p.Parts[i]
		if part.Remaining >= k {
			continue
		}
		t := part.ResetAfter
		if !l.IsQuota() {
			t -= l.Interval(l.Burst - k)
		}
		w = max(w, t)
	}
	return w
}

// windowEnd is how long a grant g's tokens are good for when a calendar
// quota is among the limits: until the soonest quota window ends (its
// bucket's ResetAfter, the time to the boundary); 0 when none is.
func (ls *Leases) windowEnd(g authority.Grant) time.Duration {
	if ls.limit.IsQuota() {
		return max(g.ResetAfter, 1)
	}
	var end time.Duration
	if g.Multi != nil && len(g.Multi.Parts) == len(ls.members) {
		for i, m := range ls.members {
			if r := g.Multi.Parts[i].ResetAfter; m.IsQuota() && (end == 0 || r < end) {
				end = max(r, 1)
			}
		}
	}
	return end
}

// remaining is a lease decision's Remaining: what the bucket held at the
// last grant plus what this instance holds, at most a burst.
func (ls *Leases) remaining(e *entry, left int64) int64 {
	return min(left+e.Reserved()+e.Remote(), ls.limit.Burst)
}

// getOrCreate returns key's entry, and the tokens of an entry evicted to
// make room.
func (ls *Leases) getOrCreate(key string, now int64) (*entry, Return) {
	return drained(ls.table.GetOrCreate(ls, key, now))
}

// admit is getOrCreate for a key the doorkeeper let in, of hash h (see
// table.Admit): a nil entry when the table declined it.
func (ls *Leases) admit(h uint64, key string, now int64) (*entry, Return) {
	return drained(ls.table.Admit(h, ls, key, now))
}

// drained returns e, and the tokens of ev, an entry evicted for it, to
// give back.
func drained(e, ev *entry) (*entry, Return) {
	if ev == nil {
		return e, Return{}
	}
	return e, ev.back(ev.drainHeld())
}

// holdsFallback reports whether e's FailLocal bucket has not refilled by
// now: forgetting it would hand the key a fresh burst.
func (ls *Leases) holdsFallback(e *entry, now int64) bool {
	b := e.fallback.Load()
	return b != nil && !b.Full(ls.local, now)
}

// forgetFallback notes that the table evicted e at now (called with e's
// shard locked, and again by a call that took from e's bucket after): a FailLocal bucket
// it held that had not refilled is forgotten, and its key may come back
// with a new one. The table is bounded, and during an outage every key
// asked holds one, so the eviction cannot be refused.
func (ls *Leases) forgetFallback(e *entry, now int64) {
	b := e.fallback.Load()
	if b == nil {
		return
	}
	if d := b.untilFull(ls.local, now); d > 0 {
		ls.forgotIn.Store(ls.table.outages.Load())
		until := now + int64(min(d, time.Duration(math.MaxInt64-now)))
		for last := ls.forgotUntil.Load(); until > last && !ls.forgotUntil.CompareAndSwap(last, until); last = ls.forgotUntil.Load() {
		}
	}
}

// newLocalBucket returns a key's new FailLocal bucket at now: full, unless
// a bucket the table forgot before it refilled would not have refilled by
// now, in the same outage (see Table.OutageOver), when it starts empty
// and fills at the share's rate. Which key's
// bucket was forgotten is not known, and a full one for that key would
// hand it a fresh burst per eviction: a fleet cycling keys through a small
// table admitted thousands of times its share on one key. A doubt costs
// under-admission: keys first seen while the table thrashes in an outage
// start with nothing.
func (ls *Leases) newLocalBucket(now int64) *localBucket {
	if now < ls.forgotUntil.Load() && ls.forgotIn.Load() == ls.table.outages.Load() {
		return emptyBucket(now)
	}
	return new(localBucket)
}
