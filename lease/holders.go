package lease

import "sync"

// dueShift sets the width of the time slots of a holderList, 2^24 ns
// (about 17 ms): a sweep takes the slots wholly due, so a lease is
// visited at the first sweep at or after its slot's end, at most one slot
// after its expiry, whatever the sweeps' interval.
const dueShift = 24

// holderList lists the entries that hold or held tokens, each by the
// slot of its lease's expiry, so that a sweep visits a lease once, when
// it is due, and not on every sweep of its life. Before it was ordered
// (one list, each entry visited and listed again on every sweep), on the
// comparison harness's cold long tail, with leases of 2 s and a sweep
// every 250 ms, each lease was visited about eight times: the sweeps took
// about 0.22 us of client CPU per decision, 0.05 since (CPU profiles).
//
// An entry is listed at most once, under a slot no later than its
// expiry's; an entry the table lets go of leaves the list with it (see
// remove), so that the list never holds more than the table.
type holderList struct {
	mu sync.Mutex
	// due holds the listed entries by slot: an entry whose lease expires
	// at x is under dueSlot(x), the first slot that ends at or after x.
	// An entry knows its place: entry.dueSlot (0: not listed) and
	// entry.dueIndex, both guarded by mu.
	due map[int64][]*entry
	// swept is the last slot a sweep took (0: none yet); an entry listed
	// under it or an earlier one goes under the next (see add).
	swept int64
	spare [][]*entry // the storage of taken slots, for new ones
}

// dueSlot is the slot of an expiry at x: the first whose end, slot <<
// dueShift, is at or after x.
func dueSlot(x int64) int64 {
	return (x + 1<<dueShift - 1) >> dueShift
}

// add lists e under the slot of expires, or the first slot no sweep took
// yet when that one was. An entry already listed moves only to a sooner
// slot.
func (h *holderList) add(e *entry, expires int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	// Slot 0 means "not listed" (entry.dueSlot): an expiry at or before
	// the clock's zero (a test's) goes under slot 1.
	slot := max(dueSlot(expires), 1)
	if h.swept != 0 {
		slot = max(slot, h.swept+1)
	}
	if cur := e.dueSlot.Load(); cur != 0 {
		if cur <= slot {
			return
		}
		h.unlink(e)
	}
	if h.due == nil {
		h.due = make(map[int64][]*entry)
	}
	list, ok := h.due[slot]
	if !ok && len(h.spare) > 0 {
		list = h.spare[len(h.spare)-1]
		h.spare = h.spare[:len(h.spare)-1]
	}
	e.dueSlot.Store(slot)
	e.dueIndex = len(list)
	h.due[slot] = append(list, e)
	if e.removed.Load() {
		// The table let go of e while it was being listed: remove, which
		// stores removed before it reads dueSlot, found it unlisted (a
		// sweep that saw its tokens before the evicting caller drained
		// them lists it). Kept, it would stay referenced until its slot.
		h.unlink(e)
	}
}

// remove takes e off the list, if it is on it: the table let go of it.
func (h *holderList) remove(e *entry) {
	if e.dueSlot.Load() == 0 {
		return // not listed; read again under the lock only if it may be
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if e.dueSlot.Load() != 0 {
		h.unlink(e)
	}
}

// unlink takes listed e out of its slot, moving the slot's last entry to
// its place. h.mu is held.
func (h *holderList) unlink(e *entry) {
	slot := e.dueSlot.Load()
	list := h.due[slot]
	last := len(list) - 1
	moved := list[last]
	list[e.dueIndex] = moved
	moved.dueIndex = e.dueIndex
	list[last] = nil
	h.due[slot] = list[:last]
	e.dueSlot.Store(0)
}

// takeDue appends to into the entries of every slot that has ended by
// now, takes those slots out, and returns into. A sweep that follows
// another goes through the slots between the two, or through the listed
// ones when they are fewer (the first sweep, or one after a long pause).
func (h *holderList) takeDue(now int64, into []*entry) []*entry {
	h.mu.Lock()
	defer h.mu.Unlock()
	last := now >> dueShift // the last slot whose end is at or before now
	if h.swept != 0 && last-h.swept <= int64(len(h.due)) {
		for slot := h.swept + 1; slot <= last; slot++ {
			into = h.takeSlot(slot, into)
		}
	} else {
		for slot := range h.due {
			if slot <= last {
				into = h.takeSlot(slot, into)
			}
		}
	}
	h.swept = max(h.swept, last)
	return into
}

// takeSlot appends slot's entries to into, unlisted, and keeps its
// storage for a later slot. h.mu is held.
func (h *holderList) takeSlot(slot int64, into []*entry) []*entry {
	list, ok := h.due[slot]
	if !ok {
		return into
	}
	delete(h.due, slot)
	for _, e := range list {
		e.dueSlot.Store(0)
	}
	into = append(into, list...)
	if len(h.spare) < maxSpareSlots {
		clear(list)
		h.spare = append(h.spare, list[:0])
	}
	return into
}

// reset unlists every entry (the table let go of them all).
func (h *holderList) reset() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, list := range h.due {
		for _, e := range list {
			e.dueSlot.Store(0)
		}
	}
	h.due = nil
}

// maxSpareSlots bounds the taken slots' storage kept for new ones.
const maxSpareSlots = 256

// listed reports the entries listed, over every slot (for tests).
func (h *holderList) listed() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, l := range h.due {
		n += len(l)
	}
	return n
}

// listHolder puts e on its table's list of entries that hold tokens, if
// it is not on it, so that a sweep expires its lease (see table.Sweep):
// it is called after tokens joined e, and by a refill after it set the
// lease's expiry. A sweep that unlists e reads its tokens after doing so,
// so tokens that join meanwhile are seen by one of the two.
//
// An entry listed under a slot that ends after its expiry (a refill of a
// calendar quota's lease ends it at the window's end, sooner than the
// last) moves to the sooner slot: its tokens go back when its lease ends,
// not a lease's life later. (Were it not, no token would be spent past
// its expiry, which Take checks: the tokens would go back late.)
func (e *entry) listHolder() {
	if e.holders == nil {
		return
	}
	exp := e.expires.Load()
	if e.listed.Swap(true) {
		if slot := e.dueSlot.Load(); slot != 0 && slot <= dueSlot(exp) {
			return
		}
	}
	e.holders.add(e, exp)
}
