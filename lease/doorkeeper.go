package lease

import (
	"math/bits"
	"sync/atomic"
)

// doorkeeper remembers, lossily, the keys the table was lately asked for
// and did not hold, so that a key costs an entry and a lease only once it
// repeats. A key's first decision goes to the authority for exactly its
// tokens (Exact), as in exact mode: the cold long tail, keys seen once,
// costs no entry, no eviction and no refill bookkeeping (issue 25: cold
// keys pay nothing for leases; a key earns a lease when it repeats).
//
// It is direct-mapped: each slot holds the hash of the last key that fell
// in it. A key whose slot another key took meanwhile is taken for new
// again (one more exact decision: its lease starts a sight later), and two
// keys with one 63-bit hash (the low bit marks a used slot) are taken for
// one (a lease a sight early).
// Neither changes what is admitted: an exact decision and a lease take
// their tokens from the same bucket. It holds about as many keys as the
// table, 8 bytes each, up to maxDoorkeeperSlots, made when first needed,
// and takes no lock.
type doorkeeper struct {
	size  uint64                          // slots, a power of two; 0: off, every key seen
	slots atomic.Pointer[[]atomic.Uint64] // made at the first look, so a Client that never leases a key pays nothing
}

// maxDoorkeeperSlots bounds a doorkeeper at 8 MiB: a table's bound may be
// far larger than the keys it will ever hold (a larger table forgets first
// sights sooner).
const maxDoorkeeperSlots = 1 << 20

// doorkeeperSize is the slots of a doorkeeper for n keys: at least n, a
// power of two, at most maxDoorkeeperSlots.
func doorkeeperSize(n int) uint64 {
	return uint64(1) << bits.Len64(uint64(min(max(n, 2), maxDoorkeeperSlots)-1))
}

// seen reports whether the key of hash h was seen since its slot last
// changed hands, and marks it seen. A doorkeeper of size 0 (the zero
// value) has seen every key.
func (d *doorkeeper) seen(h uint64) bool {
	if d.size == 0 {
		return true
	}
	p := d.slots.Load()
	if p == nil {
		made := make([]atomic.Uint64, d.size)
		d.slots.CompareAndSwap(nil, &made) // the first made wins
		p = d.slots.Load()
	}
	h |= 1 // 0 is an empty slot
	s := &(*p)[(h>>1)&(d.size-1)]
	old := s.Load()
	if old == h {
		return true
	}
	// One caller marks it: of callers that find a key new at once, one
	// decides exactly and the others take it as seen, so that they share
	// one refill of its lease rather than each making a call.
	if s.CompareAndSwap(old, h) {
		return false
	}
	return s.Load() == h
}
