package lease

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/leaselimit/leaselimit/policy"
)

// keyInShardOf returns a key starting with prefix that lands in the same
// shard of tab as key.
func keyInShardOf(t testing.TB, tab *table, key, prefix string) string {
	t.Helper()
	want := tab.shard(nil, key)
	for i := 0; i < 1_000_000; i++ {
		k := prefix + strconv.Itoa(i)
		if k != key && tab.shard(nil, k) == want {
			return k
		}
	}
	t.Fatalf("no key with prefix %q in the shard of %q", prefix, key)
	return ""
}

// TestShardChainsEqualHashes: entries whose keys' hashes are equal share
// the map's slot in a chain; each is found by its own key and limit, and
// taking one out, first, middle or last, leaves the others found.
func TestShardChainsEqualHashes(t *testing.T) {
	const h = 7
	other := &Leases{salt: 5}
	sh := &shard{m: make(map[uint64]*entry), max: 10}
	a := &entry{key: "a", hash: h}
	b := &entry{key: "b", hash: h}
	c := &entry{key: "c", hash: h}
	a2 := &entry{key: "a", hash: h, owner: other} // a's key under another limit
	all := []*entry{a, b, c, a2}
	for _, e := range all {
		sh.add(e)
	}
	check := func(when string, present ...*entry) {
		t.Helper()
		for _, e := range all {
			want := e
			if !slices.Contains(present, e) {
				want = nil
			}
			if got := sh.find(h, saltOf(e.owner), e.key); got != want {
				t.Errorf("%s: find(%q, salt %d) = %p; want %p", when, e.key, saltOf(e.owner), got, want)
			}
		}
		if got := sh.find(h, 0, "d"); got != nil {
			t.Errorf("%s: find of a key never added = %p", when, got)
		}
		if len(sh.ring) != len(present) {
			t.Errorf("%s: ring of %d; want %d", when, len(sh.ring), len(present))
		}
	}
	check("all added", all...)
	sh.remove(c) // in the middle of the chain a2, c, b, a
	check("c removed", a, b, a2)
	sh.remove(a2) // its head
	check("a2 removed", a, b)
	sh.remove(a) // its tail
	check("a removed", b)
	sh.remove(b)
	check("b removed")
	if len(sh.m) != 0 {
		t.Errorf("map of %d slots with every entry removed; want 0", len(sh.m))
	}
	for _, e := range all {
		if !e.removed.Load() || e.next != nil {
			t.Errorf("%q: removed %v, next %p; want removed and unchained", e.key, e.removed.Load(), e.next)
		}
	}
}

// TestTableChainedEntries: a table counts, sweeps and drains every entry
// of a chain, not only the first (the map holds but that one).
func TestTableChainedEntries(t *testing.T) {
	tab := newTable(minCapacity)
	sh := tab.shardOf(7)
	idle1 := &entry{key: "idle1", hash: 7, holders: &tab.holders}
	idle2 := &entry{key: "idle2", hash: 7, holders: &tab.holders}
	holder := &entry{key: "holder", hash: 7, holders: &tab.holders}
	holder2 := &entry{key: "holder2", hash: 7, holders: &tab.holders}
	for _, e := range []*entry{idle1, holder, idle2, holder2} {
		e.lastUse.Store(1 * s)
		sh.add(e)
	}
	for _, e := range []*entry{holder, holder2} {
		e.tokens.Store(int64(len(e.key)))
		e.expires.Store(100 * s)
	}
	if got := tab.Len(); got != 4 {
		t.Errorf("Len = %d; want 4", got)
	}
	tab.Sweep(10*s, 2*s, func(e *entry, h held) { t.Errorf("Sweep refunded %d of %q", h.tokens, e.key) })
	if got := tab.Len(); got != 2 || !idle1.removed.Load() || !idle2.removed.Load() || holder.removed.Load() || holder2.removed.Load() {
		t.Errorf("after Sweep: Len %d, removed idle1 %v idle2 %v holder %v holder2 %v; want 2, the idle two removed",
			got, idle1.removed.Load(), idle2.removed.Load(), holder.removed.Load(), holder2.removed.Load())
	}
	if tab.Get(nil, "holder") != nil {
		t.Fatal("Get found an entry added under a hash of the test's")
	}
	if sh.find(7, 0, "holder") != holder || sh.find(7, 0, "holder2") != holder2 {
		t.Error("the holders no longer found after the sweep removed the entries chained with them")
	}
	got := map[string]int64{}
	tab.Drain(func(e *entry, h held) { got[e.key] += h.tokens })
	if len(got) != 2 || got["holder"] != 6 || got["holder2"] != 7 {
		t.Errorf("Drain refunded %v; want holder's 6 and holder2's 7", got)
	}
	if tab.Len() != 0 || !holder.removed.Load() || !holder2.removed.Load() {
		t.Errorf("after Drain: Len %d, removed holder %v holder2 %v; want 0, both removed",
			tab.Len(), holder.removed.Load(), holder2.removed.Load())
	}
}

// TestTableFullByEntries: a shard is full when it holds its share of
// entries, however few slots of its map they take: entries whose hashes
// are equal share one.
func TestTableFullByEntries(t *testing.T) {
	tab := newTable(3 * numShards) // three entries per shard
	sh := tab.shardOf(7)
	for _, k := range []string{"a", "b", "c"} {
		sh.add(&entry{key: k, hash: 7, holders: &tab.holders})
	}
	var key string
	for i := 0; key == ""; i++ {
		if k := "k" + strconv.Itoa(i); tab.shard(nil, k) == sh {
			key = k
		}
	}
	e, evicted := tab.GetOrCreate(nil, key, 1*s)
	if evicted == nil || !evicted.removed.Load() {
		t.Errorf("GetOrCreate in a shard of three chained entries evicted %v; want one of them", evicted)
	}
	if tab.Get(nil, key) != e || len(sh.ring) != 3 {
		t.Errorf("after GetOrCreate: %q found %v, ring of %d; want found, 3", key, tab.Get(nil, key) == e, len(sh.ring))
	}
}

func TestTableCapacity(t *testing.T) {
	for _, tc := range []struct{ maxKeys, want int }{
		{-5, numShards},
		{0, numShards},
		{1, numShards},
		{numShards, numShards},
		{numShards + 1, numShards + 1},
		{1000, 1000},
		{10000, 10000},
	} {
		got := capacity(newTable(tc.maxKeys))
		if got != tc.want {
			t.Errorf("capacity(newTable(%d)) = %d; want %d", tc.maxKeys, got, tc.want)
		}
		if got != max(tc.maxKeys, minCapacity) {
			t.Errorf("capacity(newTable(%d)) = %d; want exactly max(maxKeys, minCapacity)", tc.maxKeys, got)
		}
	}
}

func TestTableGetOrCreate(t *testing.T) {
	tab := newTable(1000)
	const t0, t1 = 1 * s, 2 * s
	if e := tab.Get(nil, "a"); e != nil {
		t.Fatalf("Get on an empty table = %v", e)
	}
	if tab.Len() != 0 {
		t.Fatalf("Len() = %d on an empty table", tab.Len())
	}
	a, ev := tab.GetOrCreate(nil, "a", t0)
	if a == nil || ev != nil {
		t.Fatalf("GetOrCreate(a) = %v, %v", a, ev)
	}
	if a.Key() != "a" || a.removed.Load() {
		t.Errorf("new entry: key %q, removed %v", a.Key(), a.removed.Load())
	}
	if got := tab.Get(nil, "a"); got != a {
		t.Errorf("Get(a) = %p; want %p", got, a)
	}
	if got, ev := tab.GetOrCreate(nil, "a", t1); got != a || ev != nil {
		t.Errorf("second GetOrCreate(a) = %p, %v; want the same entry", got, ev)
	}
	b, _ := tab.GetOrCreate(nil, "b", t1)
	if b == a {
		t.Errorf("distinct keys share an entry")
	}
	if tab.Len() != 2 {
		t.Errorf("Len() = %d; want 2", tab.Len())
	}
	// Keys are compared as bytes: odd keys are distinct entries.
	for _, k := range []string{"", "{a}", "a\x00", "A", "ä", "a "} {
		e, _ := tab.GetOrCreate(nil, k, t1)
		if e == a || tab.Get(nil, k) != e || e.Key() != k {
			t.Errorf("key %q: entry confused with another key", k)
		}
	}
}

func TestTableConcurrentGetOrCreate(t *testing.T) {
	tab := newTable(100000)
	const keys = 500
	got := make([][]*entry, 16)
	var wg sync.WaitGroup
	for w := range got {
		got[w] = make([]*entry, keys)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < keys; i++ {
				e, ev := tab.GetOrCreate(nil, "k"+strconv.Itoa(i), int64(i))
				if ev != nil {
					t.Errorf("eviction in a table far below capacity")
				}
				got[w][i] = e
			}
		}()
	}
	wg.Wait()
	for i := 0; i < keys; i++ {
		for w := range got {
			if got[w][i] != got[0][i] {
				t.Fatalf("key %d: goroutines got different entries", i)
			}
		}
	}
	if tab.Len() != keys {
		t.Errorf("Len() = %d; want %d", tab.Len(), keys)
	}
}

// TestTableFlood: a flood of distinct keys never grows the table beyond its
// capacity, and every eviction hands back a removed entry.
func TestTableFlood(t *testing.T) {
	for _, maxKeys := range []int{1, 100, 1000} {
		tab := newTable(maxKeys)
		c := capacity(tab)
		evicted := 0
		const n = 50000
		for i := 0; i < n; i++ {
			now := int64(i) * ms
			key := "flood-" + strconv.Itoa(i)
			e, ev := tab.GetOrCreate(nil, key, now)
			if e == nil || e.Key() != key {
				t.Fatalf("GetOrCreate(%q) = %v", key, e)
			}
			if ev != nil {
				evicted++
				if !ev.removed.Load() {
					t.Fatalf("evicted entry %q has removed unset", ev.Key())
				}
				if tab.Get(nil, ev.Key()) != nil {
					t.Fatalf("evicted entry %q still in the table", ev.Key())
				}
				if ev == e {
					t.Fatalf("GetOrCreate evicted the entry it returned")
				}
			}
			if i%997 == 0 {
				if l := tab.Len(); l > c {
					t.Fatalf("maxKeys %d: Len() = %d > Capacity() %d after %d keys", maxKeys, l, c, i+1)
				}
			}
		}
		if l := tab.Len(); l > c || l+evicted != n {
			t.Errorf("maxKeys %d: Len() = %d, %d evicted, %d inserted (capacity %d)", maxKeys, l, evicted, n, c)
		}
	}
}

// TestTableEvictsLeastRecentlyUsed: a full shard evicts its least recently
// used entry (use as recorded by Take and Touch, which are coarse to
// useGrain, so uses here are further apart).
func TestTableEvictsLeastRecentlyUsed(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{})
	tab := newTable(2 * numShards) // two entries per shard
	a := "a"
	b := keyInShardOf(t, tab, a, "b")
	c := keyInShardOf(t, tab, a, "c")
	d := keyInShardOf(t, tab, a, "d")
	other := "zz"
	for tab.shard(nil, other) == tab.shard(nil, a) {
		other += "z"
	}
	const (
		t0 = 1 * s
		t1 = t0 + 100*ms
		t2 = t0 + 200*ms
		t3 = t0 + 300*ms
		t4 = t0 + 400*ms
		t5 = t0 + 500*ms
	)
	ea, _ := tab.GetOrCreate(nil, a, t0)
	eb, _ := tab.GetOrCreate(nil, b, t1)
	// A key in another shard does not evict from this one.
	if _, ev := tab.GetOrCreate(nil, other, t1); ev != nil {
		t.Fatalf("insert into another shard evicted %q", ev.Key())
	}
	// Use a (by Take) after b was created: b is now the least recently used.
	z.Install(ea, request{Want: 1, Min: 1}, Outcome{Granted: 1}, t2)
	if ok, _ := ea.Take(1, t2); !ok {
		t.Fatal("Take failed")
	}
	ec, ev := tab.GetOrCreate(nil, c, t3)
	if ev != eb {
		t.Fatalf("inserting %q evicted %v; want %q (least recently used)", c, ev, b)
	}
	if !eb.removed.Load() || tab.Get(nil, b) != nil || tab.Get(nil, a) != ea || tab.Get(nil, c) != ec {
		t.Fatalf("table after eviction: a %v, b %v, c %v", tab.Get(nil, a), tab.Get(nil, b), tab.Get(nil, c))
	}
	// Touch c (a denial served from the negative cache counts as a use):
	// now a is the oldest.
	ec.Touch(t4)
	_, ev = tab.GetOrCreate(nil, d, t5)
	if ev != ea {
		t.Fatalf("inserting %q evicted %v; want %q", d, ev, a)
	}
	if tab.Get(nil, other) == nil {
		t.Errorf("entry in another shard was evicted")
	}
	if !ea.removed.Load() || ec.removed.Load() {
		t.Errorf("removed flags: a %v (want true), c %v (want false)", ea.removed.Load(), ec.removed.Load())
	}
}

// TestTableEvictedLeaseDrains: the caller refunds an evicted entry's lease
// with Drain, and a refill racing the eviction refunds through Install.
func TestTableEvictedLeaseDrains(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{})
	tab := newTable(1)
	const t0, t1 = 1 * s, 1*s + 50*ms
	ea, _ := tab.GetOrCreate(nil, "a", t0)
	z.Install(ea, request{Want: 5, Min: 1}, Outcome{Granted: 5}, t0)
	_, ev := tab.GetOrCreate(nil, keyInShardOf(t, tab, "a", "x"), t1)
	if ev != ea {
		t.Fatalf("evicted %v; want a", ev)
	}
	if got := ev.Drain(); got != 5 {
		t.Errorf("Drain of evicted lease = %d; want 5", got)
	}
	if ok, _ := ea.Take(1, t1); ok {
		t.Errorf("Take from a drained, evicted entry succeeded")
	}
}

func TestTableSweep(t *testing.T) {
	z := newSizer(policy.PerSecond(10000), policy.Lease{TTL: time.Second, IdleTTL: 5 * time.Second, DenyCap: 10 * time.Second})
	tab := newTable(1000)
	const idle = 5 * s
	const (
		tw = 1 * s  // warm-up of the prefetching key starts
		t0 = 10 * s // everything else starts
		t1 = t0 + 500*ms
		t2 = t0 + 2*s
		t3 = t0 + 6*s
		t4 = t0 + 8*s
		t5 = t4 + idle/8 // the next sweep that visits every entry (see Sweep)
	)
	type refund struct {
		key    string
		tokens int64
	}
	var refunds []refund
	sweep := func(now int64) {
		refunds = refunds[:0]
		tab.Sweep(now, idle, func(e *entry, h held) {
			n := h.tokens
			if n <= 0 {
				t.Errorf("refund callback with %d tokens for %q", n, e.Key())
			}
			refunds = append(refunds, refund{e.Key(), n})
		})
	}
	wantRefunds := func(at string, want ...refund) {
		t.Helper()
		got := map[string]int64{}
		for _, r := range refunds {
			got[r.key] += r.tokens
		}
		if len(refunds) != len(want) {
			t.Errorf("%s: refunds %v; want %v", at, refunds, want)
			return
		}
		for _, w := range want {
			if got[w.key] != w.tokens {
				t.Errorf("%s: refunds %v; want %v", at, refunds, want)
				return
			}
		}
	}

	// prefetching: a hot key whose prefetch is claimed and never finishes.
	pre, _ := tab.GetOrCreate(nil, "prefetching", tw)
	drive(t, z, pre, tw, 500*us, 6000)
	pre.Drain()
	if !pre.NeedsPrefetch(0) {
		t.Fatal("could not claim a prefetch")
	}
	// expired: a lease of 10, 2 spent, expires at t1+1s.
	exp, _ := tab.GetOrCreate(nil, "expired", t0)
	z.Install(exp, request{Want: 10, Min: 1}, Outcome{Granted: 10}, t1)
	exp.Take(2, t1)
	// idle: never used after creation.
	idl, _ := tab.GetOrCreate(nil, "idle", t0)
	// denied: negative cache until t0+7s.
	den, _ := tab.GetOrCreate(nil, "denied", t0)
	z.Install(den, request{Want: 1, Min: 1}, Outcome{Granted: 0, RetryAfter: 7 * time.Second}, t0)
	// fresh: created now, with a live lease.
	var fresh *entry

	// t1: nothing expired, nothing idle.
	sweep(t1)
	wantRefunds("t1")
	if tab.Len() != 4 {
		t.Fatalf("t1: Len() = %d; want 4", tab.Len())
	}

	// t2: expired's lease is refunded; nothing is idle for 5s yet.
	fresh, _ = tab.GetOrCreate(nil, "fresh", t2)
	z.Install(fresh, request{Want: 3, Min: 1}, Outcome{Granted: 3}, t2)
	sweep(t2)
	wantRefunds("t2", refund{"expired", 8})
	if exp.Tokens() != 0 || tab.Get(nil, "expired") != exp || exp.removed.Load() {
		t.Errorf("t2: expired entry: tokens %d, present %v, removed %v", exp.Tokens(), tab.Get(nil, "expired") != nil, exp.removed.Load())
	}
	sweep(t2)
	wantRefunds("t2 again") // refunded only once

	// t3 (6s after t0): idle and expired are removed (idle > 5s, empty);
	// denied stays (negative cache until t0+7s); fresh is refunded (its lease
	// expired at t2+1s) but stays (used 4s ago); prefetching stays
	// (refill claimed).
	sweep(t3)
	wantRefunds("t3", refund{"fresh", 3})
	for _, gone := range []*entry{idl, exp} {
		if tab.Get(nil, gone.Key()) != nil || !gone.removed.Load() {
			t.Errorf("t3: %q not removed", gone.Key())
		}
	}
	for _, kept := range []*entry{den, fresh, pre} {
		if tab.Get(nil, kept.Key()) != kept || kept.removed.Load() {
			t.Errorf("t3: %q removed", kept.Key())
		}
	}

	// t4: denied's negative cache has ended: removed. fresh used at t2,
	// 6s ago: removed. prefetching still claimed.
	sweep(t4)
	wantRefunds("t4")
	for _, gone := range []*entry{den, fresh} {
		if tab.Get(nil, gone.Key()) != nil || !gone.removed.Load() {
			t.Errorf("t4: %q not removed", gone.Key())
		}
	}
	if tab.Get(nil, "prefetching") != pre {
		t.Errorf("t4: entry with a claimed prefetch removed")
	}
	pre.PrefetchDone()
	sweep(t5)
	if tab.Get(nil, "prefetching") != nil || !pre.removed.Load() {
		t.Errorf("t5: idle entry not removed after PrefetchDone")
	}
	if tab.Len() != 0 {
		t.Errorf("t5: Len() = %d; want 0", tab.Len())
	}
}

// TestTableSweepVisitsHolders: between the sweeps that visit every entry
// (at most every idle/8), a sweep expires the leases of the entries tokens
// joined, and leaves the others alone.
func TestTableSweepVisitsHolders(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{TTL: 500 * time.Millisecond, IdleTTL: 16 * time.Second})
	tab := newTable(1000) // many entries per shard: "idle" and "held" may share one
	const (
		idle = 16 * s // every entry is visited at most every 2s
		t0   = 100 * s
	)
	var got map[string]int64
	refund := func(e *entry, h held) { got[e.Key()] += h.tokens }
	sweep := func(now int64) {
		got = map[string]int64{}
		tab.Sweep(now, idle, refund)
	}
	sweep(t0) // the first sweep visits every entry
	// idle: unused for 20s, more than idle, made after that sweep.
	idl, _ := tab.GetOrCreate(nil, "idle", t0-20*s)
	// held: a lease of 4 granted at t0, expiring at t0+500ms.
	held, _ := tab.GetOrCreate(nil, "held", t0)
	z.Install(held, request{Want: 4, Min: 1}, Outcome{Granted: 4}, t0)
	sweep(t0 + 1*s)
	if got["held"] != 4 || len(got) != 1 {
		t.Fatalf("t0+1s: refunds %v; want held's 4 tokens, from the list of holders", got)
	}
	if tab.Get(nil, "idle") != idl {
		t.Fatalf("t0+1s: a sweep between full sweeps removed an idle entry")
	}
	if held.listed.Load() {
		t.Errorf("t0+1s: an empty entry is still listed as a holder")
	}
	z.Install(held, request{Want: 2, Min: 1}, Outcome{Granted: 2, At: 1_000}, t0+1*s)
	if !held.listed.Load() {
		t.Fatalf("an install did not list the entry as a holder")
	}
	sweep(t0 + 1100*ms) // live: nothing, and it stays listed
	if len(got) != 0 || !held.listed.Load() {
		t.Fatalf("t0+1.1s: refunds %v, listed %v; want none, listed", got, held.listed.Load())
	}
	// The lease spent: a sweep before its expiry leaves it listed, not
	// visited; a Settle surplus that joins it then (Give) expires with it.
	if ok, _ := held.Take(2, t0+1100*ms); !ok {
		t.Fatal("Take of the lease's 2 tokens failed")
	}
	sweep(t0 + 1200*ms)
	if len(got) != 0 || !held.listed.Load() || tab.holders.listed() != 1 {
		t.Fatalf("t0+1.2s: refunds %v, listed %v (%d); want none, listed once", got, held.listed.Load(), tab.holders.listed())
	}
	if !held.Give(3, 1_000, 1_000, 0, t0+1200*ms) || held.Tokens() != 3 || tab.holders.listed() != 1 {
		t.Fatalf("Give to a live lease: %d tokens, listed %d times; want 3, once", held.Tokens(), tab.holders.listed())
	}
	sweep(t0 + 1600*ms) // expired at t0+1.5s, before the next full sweep
	if got["held"] != 3 || len(got) != 1 {
		t.Fatalf("t0+1.6s: refunds %v; want the 3 tokens Give added", got)
	}
	if held.listed.Load() || tab.holders.listed() != 0 {
		t.Errorf("t0+1.6s: the expired, empty lease is still listed (%d)", tab.holders.listed())
	}
	if tab.Get(nil, "idle") != idl {
		t.Fatalf("t0+1.6s: a sweep between full sweeps removed an idle entry")
	}
	sweep(t0 + 2*s) // idle/8 after the first: every entry
	if len(got) != 0 {
		t.Errorf("t0+2s: refunds %v; want none", got)
	}
	if tab.Get(nil, "idle") != nil || !idl.removed.Load() {
		t.Errorf("t0+2s: the full sweep kept an idle entry")
	}
}

// TestPlanListsMovedReservation: a refill's plan moves a reservation no
// caller claimed into the lease, and lists the entry, so that a sweep that
// had found it empty (it read the tokens before the move and the
// reservation after it) still expires those tokens before the next full
// visit.
func TestPlanListsMovedReservation(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{TTL: 500 * time.Millisecond, IdleTTL: 16 * time.Second})
	tab := newTable(64)
	const idle, t0 = 16 * s, 100 * s
	var got int64
	tab.Sweep(t0, idle, func(*entry, held) {}) // a full visit
	e, _ := tab.GetOrCreate(nil, "k", t0)
	z.Install(e, request{Want: 4, Min: 1, Need: 2}, Outcome{Granted: 4}, t0)
	if ok, _ := e.Take(2, t0); !ok || e.Tokens() != 0 || e.reserved.Load() != 2 {
		t.Fatalf("setup: tokens %d, reserved %d; want 0 and 2", e.Tokens(), e.reserved.Load())
	}
	e.listed.Store(false) // as that sweep leaves it
	tab.holders.reset()
	z.Plan(e, t0+100*ms)
	if !e.listed.Load() || e.Tokens() != 2 {
		t.Fatalf("after the plan: listed %v, tokens %d; want listed, 2", e.listed.Load(), e.Tokens())
	}
	tab.Sweep(t0+1*s, idle, func(_ *entry, h held) { got += h.tokens }) // expired, before the next full visit
	if got != 2 {
		t.Errorf("refunded %d of the moved reservation's 2 tokens", got)
	}
}

// TestTableSweepIdleWithLiveLease: an idle entry still holding a live lease
// is kept until the lease expires, then refunded and removed together.
func TestTableSweepIdleWithLiveLease(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{TTL: 10 * time.Second, IdleTTL: 10 * time.Second})
	tab := newTable(64)
	const (
		t0 = 1 * s
		t1 = t0 + 5*s  // idle for 5s (> idle 2s), lease live
		t2 = t0 + 10*s // lease expired
	)
	e, _ := tab.GetOrCreate(nil, "k", t0)
	z.Install(e, request{Want: 4, Min: 1}, Outcome{Granted: 4}, t0)
	var got int64
	refund := func(_ *entry, h held) { got += h.tokens }
	tab.Sweep(t1, 2*s, refund)
	if got != 0 || tab.Get(nil, "k") != e {
		t.Fatalf("t1: refunded %d, present %v; want 0, true", got, tab.Get(nil, "k") != nil)
	}
	tab.Sweep(t2, 2*s, refund)
	if got != 4 || tab.Get(nil, "k") != nil || !e.removed.Load() {
		t.Errorf("t2: refunded %d, present %v, removed %v; want 4, false, true", got, tab.Get(nil, "k") != nil, e.removed.Load())
	}
	// A refill that was running when the entry was swept refunds its grant.
	if back, _ := z.Install(e, request{Want: 2, Min: 1}, Outcome{Granted: 2}, t2); back != 2 {
		t.Errorf("Install after sweep removal refund = %d; want 2", back)
	}
}

func TestTableDrain(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{TTL: time.Second})
	tab := newTable(1000)
	const t0, t1 = 1 * s, 3 * s
	live, _ := tab.GetOrCreate(nil, "live", t0)
	z.Install(live, request{Want: 5, Min: 1}, Outcome{Granted: 5}, t1)
	stale, _ := tab.GetOrCreate(nil, "stale", t0)
	z.Install(stale, request{Want: 3, Min: 1}, Outcome{Granted: 3}, t0) // expired by t1, not yet swept
	empty, _ := tab.GetOrCreate(nil, "empty", t0)
	spent, _ := tab.GetOrCreate(nil, "spent", t0)
	z.Install(spent, request{Want: 2, Min: 1}, Outcome{Granted: 2}, t1)
	spent.Take(2, t1)
	for i := 0; i < 100; i++ {
		tab.GetOrCreate(nil, "more"+strconv.Itoa(i), t1)
	}

	got := map[string]int64{}
	calls := 0
	tab.Drain(func(e *entry, h held) {
		n := h.tokens
		calls++
		got[e.Key()] += n
	})
	if calls != 2 || got["live"] != 5 || got["stale"] != 3 {
		t.Errorf("Drain refunds %v in %d calls; want live 5, stale 3", got, calls)
	}
	if tab.Len() != 0 {
		t.Errorf("Len() = %d after Drain", tab.Len())
	}
	for _, e := range []*entry{live, stale, empty, spent} {
		if !e.removed.Load() || tab.Get(nil, e.Key()) != nil || e.Tokens() != 0 {
			t.Errorf("%q after Drain: removed %v, present %v, tokens %d", e.Key(), e.removed.Load(), tab.Get(nil, e.Key()) != nil, e.Tokens())
		}
	}
	// A refill finishing after Drain refunds.
	if back, _ := z.Install(live, request{Want: 1, Min: 1}, Outcome{Granted: 1}, t1); back != 1 {
		t.Errorf("Install after Drain refund = %d; want 1", back)
	}
	// The table still works.
	if e, _ := tab.GetOrCreate(nil, "live", t1); e == live || e == nil {
		t.Errorf("GetOrCreate after Drain returned the drained entry")
	}
	tab.Drain(func(e *entry, h held) { t.Errorf("second Drain refunded %d for %q", h.tokens, e.Key()) })
}

func TestTableGetNoAllocs(t *testing.T) {
	tab := newTable(1000)
	keys := make([]string, 100)
	for i := range keys {
		keys[i] = "user-" + strconv.Itoa(i)
		tab.GetOrCreate(nil, keys[i], 1*s)
	}
	i := 0
	if a := testing.AllocsPerRun(1000, func() {
		if tab.Get(nil, keys[i%len(keys)]) == nil {
			panic("missing key")
		}
		i++
	}); a != 0 {
		t.Errorf("table.Get of a present key allocates %v times per call", a)
	}
	// A present key through GetOrCreate does not allocate either.
	if a := testing.AllocsPerRun(1000, func() {
		tab.GetOrCreate(nil, keys[3], 2*s)
	}); a != 0 {
		t.Errorf("GetOrCreate of a present key allocates %v times per call", a)
	}
	// A miss does not allocate.
	if a := testing.AllocsPerRun(1000, func() {
		if tab.Get(nil, "absent") != nil {
			panic("present")
		}
	}); a != 0 {
		t.Errorf("table.Get of an absent key allocates %v times per call", a)
	}
}

// TestTableConservationConcurrent: workers serving random keys of a small
// table race eviction, Sweep and a final Drain; every granted token is
// either spent by a Take or handed back for refunding, exactly once.
func TestTableConservationConcurrent(t *testing.T) {
	z := newSizer(policy.PerSecond(100000).WithBurst(50), policy.Lease{TTL: time.Millisecond, IdleTTL: 2 * time.Millisecond})
	tab := newTable(numShards) // one entry per shard: constant eviction
	var clock, granted, spent, refunded atomic.Int64
	clock.Store(1 * s)
	tick := func() int64 { return clock.Add(50 * us) }

	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			tab.Sweep(tick(), 5*ms, func(_ *entry, h held) { refunded.Add(h.tokens) })
		}
	}()
	const workers, ops = 8, 20000
	var work sync.WaitGroup
	for w := 0; w < workers; w++ {
		work.Add(1)
		go func() {
			defer work.Done()
			r := rand.New(rand.NewPCG(uint64(w), 99))
			for i := 0; i < ops; i++ {
				key := "k" + strconv.Itoa(r.IntN(200))
				now := tick()
				e := tab.Get(nil, key)
				if e == nil {
					var ev *entry
					e, ev = tab.GetOrCreate(nil, key, now)
					if ev != nil {
						refunded.Add(ev.Drain())
					}
				}
				n := 1 + r.Int64N(3)
				if ok, _ := e.Take(n, now); ok {
					spent.Add(n)
					continue
				}
				e.AddPending(n)
				req, expired := z.Plan(e, now)
				refunded.Add(expired.tokens)
				g := req.Want
				if r.IntN(5) == 0 {
					g = 0 // a denial now and then
				}
				granted.Add(g)
				back, stale := z.Install(e, req, Outcome{Granted: g, RetryAfter: 100 * time.Microsecond, Min: req.Min}, tick())
				refunded.Add(back + stale.tokens)
				if ok, _ := e.Take(n, now); ok {
					spent.Add(n)
				}
			}
		}()
	}
	work.Wait()
	close(stop)
	wg.Wait()
	tab.Drain(func(_ *entry, h held) { refunded.Add(h.tokens) })
	if tab.Len() != 0 {
		t.Errorf("Len() = %d after Drain", tab.Len())
	}
	if granted.Load() != spent.Load()+refunded.Load() {
		t.Errorf("granted %d != spent %d + refunded %d (difference %d)",
			granted.Load(), spent.Load(), refunded.Load(), granted.Load()-spent.Load()-refunded.Load())
	}
	if spent.Load() == 0 || refunded.Load() == 0 {
		t.Errorf("spent %d, refunded %d: the test did not exercise both", spent.Load(), refunded.Load())
	}
}

// TestEvictionCost: once the table is full, an insert looks at a couple of
// entries, not the whole shard. Regression: GetOrCreate scanned its shard
// under the write lock (about 1,560 entries per insert at the default size).
func TestEvictionCost(t *testing.T) {
	const maxKeys = 100_000
	tab := newTable(maxKeys)
	now := int64(s)
	for i := range maxKeys {
		tab.GetOrCreate(nil, fmt.Sprint("old-", i), now)
	}
	// Some old keys stay busy; they must survive.
	busy := map[string]*entry{}
	for i := range 100 {
		k := fmt.Sprint("old-", i)
		busy[k] = tab.Get(nil, k)
	}
	evictions, moves := 0, 0
	for i := range 20_000 {
		now += int64(useGrain) + 1
		for _, e := range busy {
			if e != nil {
				e.Touch(now)
			}
		}
		if _, ev := tab.GetOrCreate(nil, fmt.Sprint("new-", i), now); ev != nil {
			evictions++
		}
	}
	for i := range tab.shards {
		moves += tab.shards[i].moves
	}
	if evictions == 0 {
		t.Fatal("no eviction from a full table")
	}
	per := float64(moves) / float64(evictions)
	t.Logf("%d evictions, %d entries looked at: %.2f per eviction", evictions, moves, per)
	if per > 4 {
		t.Errorf("%.1f entries looked at per eviction; want a handful (O(1) amortised)", per)
	}
	for k, e := range busy {
		if e != nil && e.removed.Load() {
			t.Errorf("busy key %s was evicted", k)
		}
	}
}

// TestTableSpreadsOneKeyOverLimits: one key under many limits (a user's id
// under per-tenant or per-endpoint limits) spreads over the shards as many
// keys do, so a table of 1024 holds it under 1000 limits. Regression: the
// shard was chosen by the key alone, and the 1000 entries shared one shard
// of 16.
func TestTableSpreadsOneKeyOverLimits(t *testing.T) {
	settings := policy.Lease{TTL: time.Minute, IdleTTL: time.Hour}
	tb := NewTable(1024, settings)
	for i := range 1000 {
		ls := New(tb, policy.PerSecond(1000), settings, 1)
		if _, ev := tb.t.GetOrCreate(ls, "k", 1); ev != nil {
			t.Fatalf("limit %d: GetOrCreate(k) evicted an entry with %d of 1024 held; want no eviction", i+1, tb.Len())
		}
	}
	if n := tb.Len(); n != 1000 {
		t.Errorf("Len = %d after one key under 1000 limits; want 1000", n)
	}
}

// TestTableOwnsItsKeys: an entry holds its own copy of its key, never
// the caller's string: a key sliced from a larger string (a request's
// path or header) does not keep that string alive while the table holds
// the key. A key of up to inKeyLen bytes lives in the entry itself, no
// allocation; a longer one in a string of its own.
func TestTableOwnsItsKeys(t *testing.T) {
	tab := newTable(1000)
	for _, n := range []int{1, inKeyLen, inKeyLen + 1, 200} {
		want := strings.Repeat("k", n-1) + string(rune('a'+n%26))
		freed := make(chan struct{})
		e := takeSlicedKey(tab, want, freed)
		for i := 0; i < 100; i++ {
			runtime.GC()
			select {
			case <-freed:
				i = 100
			case <-time.After(time.Millisecond):
				continue
			}
		}
		select {
		case <-freed:
		default:
			t.Errorf("key of %d bytes: the string it was sliced from is still alive: the entry holds it", n)
		}
		if e.key != want || tab.Get(nil, want) != e {
			t.Errorf("key of %d bytes: entry's key %q, found %v; want %q, found", n, e.key, tab.Get(nil, want) != nil, want)
		}
	}
	for _, tc := range []struct {
		n      int
		allocs float64
	}{{inKeyLen, 1}, {inKeyLen + 1, 2}} {
		key := strings.Repeat("s", tc.n)
		if allocs := testing.AllocsPerRun(100, func() {
			e := new(entry)
			e.ownKey(key)
			ownedSink = e
		}); allocs != tc.allocs {
			t.Errorf("an entry owning a key of %d bytes: %v allocations; want %v", tc.n, allocs, tc.allocs)
		}
	}
}

// ownedSink keeps TestTableOwnsItsKeys's entries on the heap, as the
// table's are.
var ownedSink *entry

// takeSlicedKey takes into tab a key equal to key, sliced from a larger
// string whose freeing closes freed, and returns its entry: the larger
// string is unreachable once it returns, unless the table keeps it.
func takeSlicedKey(tab *table, key string, freed chan struct{}) *entry {
	big := strings.Repeat("x", 1<<20) + key
	runtime.AddCleanup(unsafe.StringData(big), func(c chan struct{}) { close(c) }, freed)
	e, _ := tab.GetOrCreate(nil, big[len(big)-len(key):], 1)
	return e
}
