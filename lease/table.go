package lease

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
)

const numShards = 64

// table is a bounded map from (limit, user key) to entry, split into shards
// with a read-write lock each. A lookup of a present key takes a read lock
// and does not allocate. It holds at most about MaxKeys entries, whatever
// their limits: inserting into a full shard evicts one of that shard's
// entries not used for a while.
type table struct {
	seed   maphash.Seed
	shards [numShards]shard
	door   doorkeeper // the keys lately asked for and not held (see seen)
	// outages counts the outages over (see Table.OutageOver): a FailLocal
	// bucket forgotten in one says nothing of the next.
	outages atomic.Uint64
	// holders lists the entries tokens joined since a sweep last found
	// them empty, by their leases' expiry: a sweep expires the leases
	// due without visiting every entry (see Sweep).
	holders holderList
	// sweepMu serializes sweeps; lastFull is the now of the last sweep
	// that visited every entry, and spare the storage of the entries the
	// last sweep took from holders. Both are guarded by sweepMu.
	sweepMu  sync.Mutex
	lastFull int64
	spare    []*entry
}

type shard struct {
	mu sync.RWMutex
	// m holds the entries by their keys' hashes (see keyHash), entries
	// whose hashes are equal chained through entry.next; a key is its
	// limit's protocol (nil in tests of the table alone), by its salt,
	// and the user key, compared on the entry found. Keyed by the two,
	// the map hashed the key again on every lookup, which Decide hashes
	// anyway: a lookup of 200,000 keys in random order took 1.5 times as
	// long (BenchmarkTableGetLongTail).
	m     map[uint64]*entry
	ring  []*entry // the entries of m, in no order, for the CLOCK hand; its length is their number
	hand  int      // next ring position the eviction hand looks at
	moves int      // entries the hand has passed (for tests of its cost)
	max   int      // entries this shard may hold
	// evicted and declined count the new keys the shard, full, took in
	// by evicting one and declined (see Admit): a table too small for
	// the keys that repeat shows in them (ratelimit.keys.full).
	evicted, declined uint64
	_                 [32]byte // keep shards on separate cache lines
}

// find returns the entry of key under the limit whose salt is salt (see
// saltOf), whose hash is h, or nil. Called with s.mu held (read or write).
func (s *shard) find(h, salt uint64, key string) *entry {
	for e := s.m[h]; e != nil; e = e.next {
		if e.key == key && saltOf(e.owner) == salt {
			return e
		}
	}
	return nil
}

// saltOf is owner's salt, 0 for none: with the key, it names an entry.
func saltOf(owner *Leases) uint64 {
	if owner == nil {
		return 0
	}
	return owner.salt
}

// add puts e, whose hash is set, in s. Called with s.mu held.
func (s *shard) add(e *entry) {
	e.next = s.m[e.hash]
	s.m[e.hash] = e
	e.slot = len(s.ring)
	s.ring = append(s.ring, e)
}

// unlink takes e out of s's map. Called with s.mu held.
func (s *shard) unlink(e *entry) {
	if head := s.m[e.hash]; head == e {
		if e.next == nil {
			delete(s.m, e.hash)
		} else {
			s.m[e.hash] = e.next
		}
	} else {
		for p := head; p != nil; p = p.next {
			if p.next == e {
				p.next = e.next
				break
			}
		}
	}
	e.next = nil
}

// remove takes e out of s and marks it removed. Called with s.mu held.
func (s *shard) remove(e *entry) {
	s.unlink(e)
	last := len(s.ring) - 1
	moved := s.ring[last]
	s.ring[e.slot] = moved
	moved.slot = e.slot
	s.ring[last] = nil
	s.ring = s.ring[:last]
	e.removed.Store(true)
	if e.holders != nil {
		// Off the list of holders too: evicted by a flood of new keys,
		// entries the list kept until their leases' expiry held the
		// heap beyond the table's bound (TestKeyFlood).
		e.holders.remove(e)
	}
}

// victim picks the entry to evict with the CLOCK algorithm, an approximation
// of least recently used in O(1) amortised time: the hand passes over the
// ring; an entry used since the hand last passed it gets another round
// (its use is noted in seen), the first one not used is the victim. Called
// with s.mu held, on a non-empty shard.
func (s *shard) victim() *entry {
	for range 2*len(s.ring) + 1 {
		if s.hand >= len(s.ring) {
			s.hand = 0
		}
		e := s.ring[s.hand]
		s.hand++
		s.moves++
		if use := e.lastUse.Load(); use != e.seen {
			e.seen = use
			continue
		}
		return e
	}
	return s.ring[0] // every entry in use on each pass: any will do
}

// minCapacity is the smallest capacity of a table: one entry per shard.
const minCapacity = numShards

// newTable returns a table bounded at maxKeys entries, or minCapacity if
// that is larger. The bound is split evenly over the shards, so a shard that
// gets more than its share of keys evicts before the table as a whole is full.
func newTable(maxKeys int) *table {
	maxKeys = max(maxKeys, minCapacity)
	t := &table{seed: maphash.MakeSeed(), door: doorkeeper{size: doorkeeperSize(maxKeys)}}
	for i := range t.shards {
		t.shards[i].m = make(map[uint64]*entry)
		t.shards[i].max = maxKeys / numShards
		if i < maxKeys%numShards {
			t.shards[i].max++
		}
	}
	return t
}

// shard returns the shard of key under owner's limit. The limit's salt is
// part of the hash, as in the doorkeeper: one key under many limits (a
// user's id under per-endpoint or per-tenant limits) spreads over the
// shards. Regression: shards were chosen by the key alone, so 1000 limits
// of one key shared a shard of WithMaxKeys/64 entries (16 of 1024 held).
func (t *table) shard(owner *Leases, key string) *shard {
	return t.shardOf(t.keyHash(owner, key))
}

// shardOf returns the shard of a key whose hash is h (see keyHash).
func (t *table) shardOf(h uint64) *shard { return &t.shards[h%numShards] }

// seen reports whether the key whose hash is h (see keyHash), which the
// table does not hold, was asked for within window of now (see
// doorkeeper), and marks it asked for at now.
func (t *table) seen(h uint64, now, window int64) bool { return t.door.seen(h, now, window) }

// lapsed reports whether a key the table holds, last used at used, was
// not used within window (a lease's life) of now: new again, as the
// doorkeeper takes a key it does not hold whose last sight is that old,
// so that its decision is exact rather than a refill (a lease taken now
// would expire unused as the last did, and go back as a refund). With the
// doorkeeper off every key counts as seen. Regression: a held key was
// refilled on every sight, so on the comparison harness's cold long tail,
// whose keys come back every 2-3 s against a TTL of 2 s, the half of them
// that once came back within the TTL paid a refill and a refund on every
// sight after.
func (t *table) lapsed(used, now, window int64) bool {
	return t.door.size != 0 && now-used > window
}

// keyHash is key's hash under owner's limit: its slot in the doorkeeper,
// and its shard (see shard).
func (t *table) keyHash(owner *Leases, key string) uint64 {
	return maphash.String(t.seed, key) ^ saltOf(owner)
}

// Get returns the entry of key under owner's limit, or nil.
func (t *table) Get(owner *Leases, key string) *entry {
	return t.getHashed(t.keyHash(owner, key), owner, key)
}

// getHashed is Get, given key's hash under owner's limit (see keyHash): a
// caller that also asks the doorkeeper about the key hashes it once.
func (t *table) getHashed(h uint64, owner *Leases, key string) *entry {
	s := t.shardOf(h)
	s.mu.RLock()
	e := s.find(h, saltOf(owner), key)
	s.mu.RUnlock()
	return e
}

// GetOrCreate returns the entry of key, creating it at now if needed. When
// the shard is full it evicts an entry not used for a while (CLOCK, see
// victim: O(1) amortised, never a scan of the shard) and returns it as
// evicted (with removed set), so the caller can refund its tokens with Drain.
func (t *table) GetOrCreate(owner *Leases, key string, now int64) (e, evicted *entry) {
	return t.getOrCreate(t.keyHash(owner, key), owner, key, now, false)
}

// Admit is GetOrCreate for a key the doorkeeper let in, of hash h (see
// keyHash: Decide has it already), which the table may decline: when
// the shard is full and the entry to evict holds a live lease, the key
// is not taken in and Admit returns nil (the caller decides exactly, as
// for a key not seen lately). Both keys came back within a lease's
// life; evicting the one the table holds would send its lease back to
// Redis as a refund and lose the decisions it would serve, for a lease
// of the newcomer's that a later newcomer evicts in turn. On the
// comparison's cold long tail (200,000 keys, twice the default bound)
// the table churned so: a key evicted with a live lease for one
// decision in 40, and leases ran at 0.88-0.94x exact mode's rate
// (median 0.92x, seven runs); declining, at 0.90-0.98x (median 0.95x,
// eleven runs the same day), with 4.3-4.5 allocations per decision
// against 4.8-4.9. A newcomer waits at most until the victims' leases
// end (one TTL; the janitor takes expired tokens out): the hand moves
// on at each try.
func (t *table) Admit(h uint64, owner *Leases, key string, now int64) (e, evicted *entry) {
	return t.getOrCreate(h, owner, key, now, true)
}

func (t *table) getOrCreate(h uint64, owner *Leases, key string, now int64, mayDecline bool) (e, evicted *entry) {
	s := t.shardOf(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.find(h, saltOf(owner), key); e != nil {
		return e, nil
	}
	if len(s.ring) >= s.max {
		evicted = s.victim()
		if mayDecline && evicted.leaseLive(now) {
			s.declined++
			return nil, nil
		}
		s.evicted++
		s.remove(evicted)
		// Its last use was a sight the doorkeeper never saw (a key held
		// is not asked about): marked now, a busy key pushed out by
		// others comes back to a refill, not to an exact decision.
		t.door.mark(evicted.hash, evicted.lastUse.Load())
		if evicted.owner != nil {
			// Before the key can be made anew (this shard's lock is
			// released after this call), so that its new FailLocal bucket
			// sees the old one; after remove, so that a caller taking
			// from the old one later sees it removed (see AllowLocal).
			evicted.owner.forgetFallback(evicted, now)
		}
	}
	e = &entry{owner: owner, hash: h, seen: now, holders: &t.holders} // not used since it was made
	e.ownKey(key)
	e.lastUse.Store(now)
	s.add(e)
	return e, evicted
}

// Remove takes key's entry under owner's limit out of the table, if there
// is one, and returns it (marked removed).
func (t *table) Remove(owner *Leases, key string) *entry {
	h := t.keyHash(owner, key)
	s := t.shardOf(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.find(h, saltOf(owner), key)
	if e != nil {
		s.remove(e)
	}
	return e
}

// Len returns the number of entries.
func (t *table) Len() int {
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.RLock()
		n += len(s.ring)
		s.mu.RUnlock()
	}
	return n
}

// Full returns how many new keys full shards took in by evicting a key,
// and how many they declined (see Admit), since the table was made.
func (t *table) Full() (evicted, declined uint64) {
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.RLock()
		evicted += s.evicted
		declined += s.declined
		s.mu.RUnlock()
	}
	return evicted, declined
}

// Sweep expires leases at now (calling refund with the tokens taken back)
// and removes entries idle for longer than idle whose lease is empty and
// whose negative cache has ended (and, for an entry with an owner, whose
// FailLocal bucket has refilled: see holdsFallback). refund is called
// without any shard's lock held, under the sweeps' own (sweepMu): it must
// not sweep.
//
// Leases expire on every sweep, but a sweep visits only the entries
// tokens joined since it last found them empty, and those only once their
// leases are due (see holderList): a table of many keys that hold no
// lease, as a long tail of keys leaves it, cost a visit to each of them on
// every sweep (4 a second, with the default lease TTL). Every entry is
// visited at most every idle/8, to forget idle keys and to expire any
// lease the list missed.
func (t *table) Sweep(now, idle int64, refund func(e *entry, h held)) {
	t.sweepMu.Lock()
	defer t.sweepMu.Unlock()
	t.sweepHolders(now, refund)
	if since := now - t.lastFull; since >= 0 && since < idle/8 && t.lastFull != 0 {
		return
	}
	t.lastFull = now
	t.sweepAll(now, idle, refund)
}

// sweepHolders expires the leases of the listed entries that are due,
// and lists again those that still hold tokens (their lease lives on, by
// a refill since they were listed). sweepMu is held.
func (t *table) sweepHolders(now int64, refund func(e *entry, h held)) {
	due := t.holders.takeDue(now, t.spare)
	for i, e := range due {
		// Unlisted before the look: tokens that join from now on list
		// it again (see listHolder), and so does the look if it finds
		// some left.
		e.listed.Store(false)
		if h := e.expireHeld(now); h.tokens > 0 {
			refund(e, h)
		}
		if !e.removed.Load() && e.holdsTokens() {
			e.listHolder()
		}
		due[i] = nil
	}
	t.spare = due[:0]
}

// sweepAll visits every entry: it expires leases, lists the entries that
// still hold tokens, and removes idle ones. sweepMu is held.
func (t *table) sweepAll(now, idle int64, refund func(e *entry, h held)) {
	var batch []*entry
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.RLock()
		batch = append(batch[:0], s.ring...)
		s.mu.RUnlock()
		var stale []*entry
		for _, e := range batch {
			if h := e.expireHeld(now); h.tokens > 0 {
				refund(e, h)
			}
			if e.holdsTokens() {
				e.listHolder()
			}
			if now-e.lastUse.Load() > idle && e.tokens.Load() == 0 && now >= e.denyUntil.Load() && !e.refilling.Load() &&
				(e.owner == nil || !e.owner.holdsFallback(e, now)) {
				stale = append(stale, e)
			}
		}
		clear(batch)
		if len(stale) == 0 {
			continue
		}
		s.mu.Lock()
		for _, e := range stale {
			if s.find(e.hash, saltOf(e.owner), e.key) == e && now-e.lastUse.Load() > idle && e.tokens.Load() == 0 {
				s.remove(e)
			}
		}
		s.mu.Unlock()
		for _, e := range stale {
			if e.removed.Load() {
				if h := e.drainHeld(); h.tokens > 0 {
					refund(e, h)
				}
			}
		}
	}
}

// Drain removes every entry and calls refund for each non-empty lease.
func (t *table) Drain(refund func(e *entry, h held)) {
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		ring := s.ring // every entry: the map holds but the first of a chain
		s.m = make(map[uint64]*entry)
		s.ring, s.hand = nil, 0
		s.mu.Unlock()
		for _, e := range ring {
			e.removed.Store(true)
			if h := e.drainHeld(); h.tokens > 0 {
				refund(e, h)
			}
		}
	}
	t.holders.reset()
}
