// Package latency records decision latencies in a fixed-size log-linear
// histogram: recording is an index computation and an increment, with no
// allocation and no locks. Give each goroutine its own Hist and Merge them
// afterwards.
package latency

import (
	"math/bits"
	"time"
)

// subBits sets the precision: each power of two is split into 2^subBits
// buckets, so a bucket spans at most 1/32 (~3%) of its values.
const subBits = 5

const (
	sub     = 1 << subBits    // buckets per power of two
	linear  = 2 * sub         // values below this have a bucket each
	buckets = linear + 58*sub // enough for any uint64
	// Sample is how often the benchmarks time a decision: one in Sample, per
	// goroutine. Reading the clock twice costs tens of nanoseconds (more on
	// virtual machines), as much as a whole lease hit, so timing every
	// decision would measure the clock.
	Sample = 16
)

// Hist is a histogram of durations. The zero value is empty and ready.
type Hist struct {
	counts [buckets]uint64
	n      uint64
}

func index(v uint64) int {
	if v < linear {
		return int(v)
	}
	shift := bits.Len64(v) - (subBits + 1) // >= 1
	return linear + (shift-1)*sub + int(v>>uint(shift)) - sub
}

// lower returns the smallest value of bucket i and its width.
func lower(i int) (uint64, uint64) {
	if i < linear {
		return uint64(i), 1
	}
	shift := (i-linear)/sub + 1
	top := uint64((i-linear)%sub + sub)
	return top << uint(shift), 1 << uint(shift)
}

// Record adds one duration (negative durations count as 0).
func (h *Hist) Record(d time.Duration) {
	if d < 0 {
		d = 0
	}
	h.counts[index(uint64(d))]++
	h.n++
}

// Count returns the number of recorded durations.
func (h *Hist) Count() uint64 { return h.n }

// Merge adds the counts of o to h.
func (h *Hist) Merge(o *Hist) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
}

// Quantile returns the q-quantile (0 < q <= 1), or 0 when h is empty: its
// bucket's values taken as evenly spread over the bucket, so that a
// quantile moves by less than a bucket's width (about 3%) when its rank
// does. A lone caller's p50 is judged against a target 10% above the
// baseline's, and as the middle of its bucket it could only move in steps
// of 2-4 µs.
func (h *Hist) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(q * float64(h.n))
	if rank < 1 {
		rank = 1
	}
	if rank > h.n {
		rank = h.n
	}
	var seen uint64
	for i, c := range h.counts {
		if seen+c >= rank {
			lo, w := lower(i)
			// the (rank - seen)-th of c values, each in the middle of its
			// own c-th of the bucket
			return time.Duration(float64(lo) + float64(w)*(float64(rank-seen)-0.5)/float64(c))
		}
		seen += c
	}
	return 0 // unreachable
}
