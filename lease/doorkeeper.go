package lease

import (
	"math/bits"
	"sync/atomic"
)

// doorkeeper remembers, lossily, the keys the table was lately asked for
// and did not hold, and when, so that a key costs an entry and a lease only
// once it repeats within a lease's life. A key's first decision goes to the
// authority for exactly its tokens (Exact), as in exact mode: the cold long
// tail, keys seen once, costs no entry, no eviction and no refill
// bookkeeping (issue 25: cold keys pay nothing for leases; a key earns a
// lease when it repeats). A key that comes back only after a lease would
// have expired (its window, the lease TTL) is new again: a lease taken for
// it would expire unused and go back to Redis as a refund, costing it a
// refill, an entry, an eviction and a refund per sight (on the cold long
// tail of the comparison harness, 200,000 keys each back every 2-3 s
// against a TTL of 2 s, leases ran at 0.83× exact mode's rate).
//
// It is direct-mapped: each slot holds the top 32 bits of the hash of the
// last key that fell in it (bit 32 set: 31 of them tell keys apart) and
// the time of its last sight. A key the table evicts is marked at its
// last use, which the doorkeeper was not asked about while the table held
// it. A key whose slot another key took meanwhile is taken for new again
// (one more exact decision: its lease starts a sight later), and two keys
// of one slot and one tag are taken for one (a lease a sight early).
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

// seen reports whether the key of hash h was seen within window (ns) of
// now (ns), and marks it seen at now. A doorkeeper of size 0 (the zero
// value) has seen every key.
func (d *doorkeeper) seen(h uint64, now, window int64) bool {
	if d.size == 0 {
		return true
	}
	p := d.slots.Load()
	if p == nil {
		made := make([]atomic.Uint64, d.size)
		d.slots.CompareAndSwap(nil, &made) // the first made wins
		p = d.slots.Load()
	}
	s, tag, stamped := d.slot(p, h, now)
	old := s.Load()
	if sightWithin(old, tag, now, window) {
		if later(stamped, old) {
			s.CompareAndSwap(old, stamped) // kept warm; a lost race left a sight as recent
		}
		return true
	}
	// One caller marks it: of callers that find a key new at once, one
	// decides exactly and the others take it as seen, so that they share
	// one refill of its lease rather than each making a call.
	if s.CompareAndSwap(old, stamped) {
		return false
	}
	return sightWithin(s.Load(), tag, now, window)
}

// mark records a sight of the key of hash h at now, as seen does, without
// asking: for a key the table held, whose sights the doorkeeper was not
// asked about (see table.GetOrCreate). A later sight already in its slot,
// of this key or another, stays.
func (d *doorkeeper) mark(h uint64, now int64) {
	p := d.slots.Load()
	if d.size == 0 || p == nil {
		return // off, or no key asked about yet: nothing to keep apart
	}
	s, _, stamped := d.slot(p, h, now)
	if old := s.Load(); old == 0 || later(stamped, old) {
		s.CompareAndSwap(old, stamped) // the later sight keeps the slot
	}
}

// slot returns the slot of hash h in slots p, h's tag (its top 32 bits,
// bit 32 forced on so that no stamped slot is 0, the empty one: 31 bits
// tell keys apart) and the slot's value for a sight of it at now.
func (d *doorkeeper) slot(p *[]atomic.Uint64, h uint64, now int64) (s *atomic.Uint64, tag, stamped uint64) {
	tag = h | 1<<32
	return &(*p)[h&(d.size-1)], tag, tag&^stampMask | uint64(stampOf(now))
}

// A slot's low 32 bits are the time of its key's last sight, in units of
// 2^20 ns (about 1 ms), compared as a signed difference: callers read the
// clock before they ask, so a sight stamped a little after a caller's now
// (another caller's later reading) is within, and a stamp never moves
// back. The difference wraps at 26 days: windows are lease TTLs, far
// shorter (a TTL of 26 days or more takes every sight of a key whose tag
// its slot still holds as within, as does a sight 26-52 days old).
const (
	stampMask  = 1<<32 - 1
	stampShift = 20
)

func stampOf(now int64) uint32 { return uint32(now >> stampShift) }

// sightWithin reports whether slot holds the key of tag, seen within
// window of now, to a stamp's unit: both times round down to one, so up
// to a unit more is taken as within.
func sightWithin(slot, tag uint64, now, window int64) bool {
	if slot == 0 || slot&^stampMask != tag&^stampMask {
		return false
	}
	age := int32(stampOf(now) - uint32(slot&stampMask))
	return age < 0 || int64(age) <= window>>stampShift+1
}

// later reports whether slot value a's stamp is after b's.
func later(a, b uint64) bool { return int32(uint32(a&stampMask)-uint32(b&stampMask)) > 0 }
