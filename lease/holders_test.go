package lease

import (
	"slices"
	"strconv"
	"testing"
	"time"
)

// TestHolderListTakesLeasesWhenDue: a sweep takes a listed entry once the
// slot of its lease's expiry has ended, not before, and only once; an entry
// listed under a slot a sweep already took goes under the next one.
func TestHolderListTakesLeasesWhenDue(t *testing.T) {
	const slot = int64(1) << dueShift
	var h holderList
	base := 1000 * slot
	list := func(key string, expires int64) *entry {
		e := &entry{key: key, holders: &h}
		e.expires.Store(expires)
		e.listHolder()
		return e
	}
	keys := func(es []*entry) []string {
		var out []string
		for _, e := range es {
			out = append(out, e.key)
		}
		slices.Sort(out)
		return out
	}
	take := func(now int64, want ...string) {
		t.Helper()
		if got := keys(h.takeDue(now, nil)); !slices.Equal(got, want) {
			t.Errorf("takeDue(base%+d slots) = %v; want %v", (now-base)/slot, got, want)
		}
	}
	list("soon", base+1)      // ends within the slot ending at base+slot
	list("edge", base+slot)   // the same slot's end
	list("late", base+5*slot) // five slots later
	take(base)                // the first sweep: nothing has ended
	take(base + slot - 1)
	take(base+slot, "edge", "soon")
	take(base + 2*slot)
	// An expiry before the last sweep's slot: under the next slot.
	list("past", base)
	take(base + 2*slot + slot/2)
	take(base+3*slot, "past")
	take(base+5*slot, "late")
	if n := h.listed(); n != 0 {
		t.Errorf("%d entries left listed; want none", n)
	}

	// A long pause between sweeps takes every ended slot, through the
	// listed slots rather than every slot between the two sweeps.
	list("a", base+10*slot)
	list("b", base+1_000_000*slot)
	list("c", base+2_000_000*slot)
	take(base+1_500_000*slot, "a", "b")
	take(base+3_000_000*slot, "c")
}

// TestListHolderOnce: an entry is listed once however often tokens join
// it, and moves to a sooner slot when its expiry went down.
func TestListHolderOnce(t *testing.T) {
	const slot = int64(1) << dueShift
	var h holderList
	base := 1000 * slot
	e := &entry{key: "k", holders: &h}
	e.expires.Store(base + 8*slot)
	e.listHolder()
	e.listHolder()
	e.expires.Store(base + 9*slot) // a refill's later expiry
	e.listHolder()
	if n := h.listed(); n != 1 || e.dueSlot.Load() != 1008 {
		t.Fatalf("listed %d times, under slot %d; want once, under 1008", n, e.dueSlot.Load())
	}
	e.expires.Store(base + 3*slot) // a quota's lease cut at its window's end
	e.listHolder()
	if n := h.listed(); n != 1 || e.dueSlot.Load() != 1003 {
		t.Fatalf("after the expiry went down: listed %d times, under slot %d; want once, under 1003", n, e.dueSlot.Load())
	}
	if got := h.takeDue(base+3*slot, nil); len(got) != 1 || got[0] != e {
		t.Errorf("the sweep at the sooner slot's end took %d entries; want e", len(got))
	}
}

// TestTableUnlistsWhatItLetsGo: an entry the table evicts or forgets
// leaves the list of holders at once, not at its lease's expiry: under a
// flood of new keys the list kept every evicted entry for a lease's life,
// beyond the table's bound.
func TestTableUnlistsWhatItLetsGo(t *testing.T) {
	tab := newTable(minCapacity) // one entry per shard
	now := int64(1000) << dueShift
	var listed []*entry
	for i := 0; len(listed) < 4*numShards; i++ {
		e, _ := tab.GetOrCreate(nil, strconv.Itoa(i), now)
		e.tokens.Store(1)
		e.expires.Store(now + 1_000_000*int64(time.Millisecond))
		e.listHolder()
		listed = append(listed, e)
	}
	if n, l := tab.holders.listed(), tab.Len(); n != l {
		t.Errorf("after a flood of %d keys: %d entries listed, the table holds %d; want as many", len(listed), n, l)
	}
	for _, e := range listed {
		if e.removed.Load() && e.dueSlot.Load() != 0 {
			t.Fatalf("evicted entry %q still listed", e.key)
		}
	}
	tab.Drain(func(*entry, held) {})
	if n := tab.holders.listed(); n != 0 {
		t.Errorf("after Drain: %d entries listed; want none", n)
	}
}

// TestHolderListDropsARemovedEntry: an entry the table let go of is not
// kept on the list by a listing that raced with its removal (a sweep that
// saw its tokens before the evicting caller drained them), and an expiry
// at the clock's zero is listed under a slot of its own, not as unlisted.
func TestHolderListDropsARemovedEntry(t *testing.T) {
	var h holderList
	e := &entry{key: "evicted", holders: &h}
	e.expires.Store(int64(1000) << dueShift)
	e.tokens.Store(1)
	e.removed.Store(true) // remove found it unlisted
	e.listHolder()
	if n := h.listed(); n != 0 || e.dueSlot.Load() != 0 {
		t.Errorf("a removed entry listed %d times, under slot %d; want none", n, e.dueSlot.Load())
	}
	z := &entry{key: "zero", holders: &h}
	z.listHolder() // expires 0
	z.listHolder()
	if n := h.listed(); n != 1 || z.dueSlot.Load() == 0 {
		t.Errorf("an expiry at 0 listed %d times, under slot %d; want once, under a slot of its own", n, z.dueSlot.Load())
	}
}
