package lease

import (
	"testing"

	"github.com/leaselimit/leaselimit/policy"
)

// TestDoorkeeperFirstSightIsExact: a key's first decision goes to the
// authority for exactly its tokens and leaves nothing in the table; when
// it comes back it is a Miss with an entry, so it earns a lease. Another
// limit's first sight of the same user key is a first sight too.
func TestDoorkeeperFirstSightIsExact(t *testing.T) {
	tab := NewTable(1000, policy.Lease{})
	ls := New(tab, policy.PerSecond(100).WithName("a"), policy.Lease{}, 1)
	other := New(tab, policy.PerSecond(100).WithName("b"), policy.Lease{}, 1)
	if a := ls.Decide("k", 1, 0); a.Status != Exact || a.Ticket.e != nil {
		t.Fatalf("first Decide = %+v; want Exact, no ticket", a)
	}
	if n := tab.Len(); n != 0 {
		t.Fatalf("table holds %d keys after a first sight; want 0", n)
	}
	a := ls.Decide("k", 1, 0)
	if a.Status != Miss || a.Ticket.e == nil {
		t.Fatalf("second Decide = %+v; want a Miss with its entry", a)
	}
	if n := tab.Len(); n != 1 {
		t.Fatalf("table holds %d keys after the second sight; want 1", n)
	}
	if a := other.Decide("k", 1, 0); a.Status != Exact {
		t.Fatalf("another limit's first Decide of k = %+v; want Exact", a)
	}
}

// TestDoorkeeperSlots: a slot holds the last key that fell in it; a key
// whose slot another took is new again; the zero doorkeeper has seen
// every key.
func TestDoorkeeperSlots(t *testing.T) {
	d := doorkeeper{size: doorkeeperSize(3)} // 4 slots
	if d.size != 4 {
		t.Fatalf("%d slots for 3; want 4", d.size)
	}
	const h1, h2 = 1<<40 | 1, 2<<40 | 1 // one slot (h & 3 is 1), two tags
	const now, window = 5e9, 2e9
	for i, tc := range []struct {
		h    uint64
		want bool
	}{{h1, false}, {h1, true}, {h2, false}, {h2, true}, {h1, false}, {4, false}, {h1, true}} {
		if got := d.seen(tc.h, now, window); got != tc.want {
			t.Errorf("step %d: seen(%d) = %v; want %v", i, tc.h, got, tc.want)
		}
	}
	if d.slots.Load() == nil || len(*d.slots.Load()) != 4 {
		t.Error("the slots were not made at the first look")
	}
	if n := doorkeeperSize(1 << 40); n != maxDoorkeeperSlots {
		t.Errorf("%d slots for a table of 2^40 keys; want the bound, %d", n, maxDoorkeeperSlots)
	}
	var zero doorkeeper
	for _, h := range []uint64{h1, h1, h2} {
		if !zero.seen(h, now, window) {
			t.Errorf("the zero doorkeeper took %d for new", h)
		}
	}
}

// TestDoorkeeperWindow: a key is seen again only within the window of
// its last sight (a lease's life): one back later is new, and a key
// back within each window stays seen however long it goes on.
func TestDoorkeeperWindow(t *testing.T) {
	d := doorkeeper{size: doorkeeperSize(16)}
	const h = 7<<40 | 3
	const window = int64(2e9)
	now := int64(1e12) // any start: the stamps wrap
	for i, tc := range []struct {
		after int64
		want  bool
	}{
		{0, false},            // first sight
		{window / 2, true},    // back within the window
		{window, true},        // back at its end, counted from the last sight
		{window + 5e6, false}, // back just after it: new again
		{1, true},             // and now seen
		{10 * window, false},  // long gone
		{window - 2e6, true},  // kept warm sight after sight
		{window - 2e6, true},
		{window - 2e6, true},
	} {
		now += tc.after
		if got := d.seen(h, now, window); got != tc.want {
			t.Errorf("step %d (+%v): seen = %v; want %v", i, tc.after, got, tc.want)
		}
	}
	// Across the stamps' wrap (2^52 ns): still measured right.
	now = 1<<52 - window/4
	if d.seen(h+(1<<41), now, window) || !d.seen(h+(1<<41), now+window/2, window) {
		t.Error("a sight across the stamps' wrap was not measured right")
	}
}
