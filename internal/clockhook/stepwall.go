package clockhook

import (
	"time"
	"unsafe"
)

// StepWall returns t with its wall clock moved by d, a whole number of
// seconds, and its monotonic reading kept: the reading time.Now gives after
// the system clock was stepped by d (by NTP, or a VM restored from a
// snapshot), which no function of package time makes. ok is false when t
// has no monotonic reading, d is not whole seconds, or time.Time is not
// laid out as this expects (the result is checked through package time).
// For tests of code that must not move with such a step.
func StepWall(t time.Time, d time.Duration) (stepped time.Time, ok bool) {
	// time.Time as Go lays it out: with hasMonotonic set, wall holds the
	// seconds since 1885 in bits 30-62 and ext the monotonic reading.
	type layout struct {
		wall uint64
		ext  int64
		loc  *time.Location
	}
	const hasMonotonic, secShift = 1 << 63, 30
	if d%time.Second != 0 || unsafe.Sizeof(t) != unsafe.Sizeof(layout{}) {
		return t, false
	}
	stepped = t
	p := (*layout)(unsafe.Pointer(&stepped))
	if p.wall&hasMonotonic == 0 {
		return t, false
	}
	p.wall += uint64(int64(d/time.Second) << secShift)
	// Checked: the wall clock moved by d, the monotonic reading did not.
	if !stepped.Round(0).Equal(t.Round(0).Add(d)) || stepped.Sub(t) != 0 {
		return t, false
	}
	return stepped, true
}
