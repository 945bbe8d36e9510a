package policy

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/internal/cowmap"
	"github.com/leaselimit/leaselimit/internal/keybytes"
)

// CalendarUnit is the length of a calendar quota's window (see Quota):
// Hour, Day, Week or Month.
type CalendarUnit int

// Interval is the former name of CalendarUnit.
//
// Deprecated: use CalendarUnit.
type Interval = CalendarUnit

const (
	// noCalendar is the zero CalendarUnit: a token bucket that refills
	// continuously, not a calendar quota.
	noCalendar CalendarUnit = iota
	Hour                    // from one o'clock to the next
	Day                     // from midnight to midnight
	Week                    // from Monday 00:00 to Monday 00:00
	Month                   // from the 1st at 00:00 to the next 1st
)

// String returns "hour", "day", "week" or "month" ("none" for the zero
// CalendarUnit).
func (i CalendarUnit) String() string {
	switch i {
	case noCalendar:
		return "none"
	case Hour:
		return "hour"
	case Day:
		return "day"
	case Week:
		return "week"
	case Month:
		return "month"
	}
	return fmt.Sprintf("CalendarUnit(%d)", int(i))
}

// nominal is a CalendarUnit's usual length, the Period of a Quota: what the
// RateLimit-Policy header's window says (a month counts 30 days there; its
// tokens still reset on the 1st).
func (i CalendarUnit) nominal() time.Duration {
	switch i {
	case Hour:
		return time.Hour
	case Day:
		return 24 * time.Hour
	case Week:
		return 7 * 24 * time.Hour
	case Month:
		return 30 * 24 * time.Hour
	}
	return 0
}

// Calendar makes a Limit a calendar quota: its Burst tokens are all there
// at the start of every window (each hour, day, week or month of the
// calendar in Location) and none come back before the window ends. The
// zero Calendar is none: the Limit is a token bucket.
type Calendar struct {
	Every    CalendarUnit
	Location *time.Location // nil: UTC; else a named zone (the name is its identity, see Canonical)
}

// Quota returns a calendar quota of tokens per window, reset at every
// boundary of every in loc (nil: UTC), on Redis's clock:
//
//	policy.Quota("daily", 10_000, policy.Day, time.UTC)
//
// Its Rate and Burst are tokens and its Period the window's usual length.
// It can be used alone or with a token bucket in one multi-limit
// (leaselimit.Client.Limiter(perSecond, daily)).
func Quota(name string, tokens int64, every CalendarUnit, loc *time.Location) Limit {
	return Limit{Name: name, Rate: tokens, Period: every.nominal(), Burst: tokens,
		Calendar: Calendar{Every: every, Location: loc}}
}

// IsQuota reports whether l is a calendar quota.
func (l Limit) IsQuota() bool { return l.Calendar.Every != noCalendar }

// validate checks a Limit's Calendar against its other fields.
func (c Calendar) validate(l Limit) error {
	if c.Every == noCalendar {
		if c.Location != nil {
			return fmt.Errorf("%w: %s: a Location without a calendar unit", ErrInvalidLimit, l.Name)
		}
		return nil
	}
	if c.Location == time.Local {
		// Every instance must agree on the boundaries, and the name is part
		// of the bucket's Redis key: "Local" is a different zone on each machine.
		return fmt.Errorf("%w: %s: time.Local differs from machine to machine; name the zone (time.LoadLocation)", ErrInvalidLimit, l.Name)
	}
	if err := validateZone(l); err != nil {
		return err
	}
	if l.Rate != l.Burst || l.Period != c.Every.nominal() {
		return fmt.Errorf("%w: %s: a calendar quota has Rate = Burst (the tokens of a window) and Period %v; build it with policy.Quota",
			ErrInvalidLimit, l.Name, c.Every.nominal())
	}
	return nil
}

// Window returns the end of the window of c that holds t, and the end of
// the window after it, in c's Location (so a day ends at that zone's
// midnight, whatever its offset that day).
func (c Calendar) Window(t time.Time) (end, next time.Time) {
	_, end, next = c.Bounds(t)
	return end, next
}

// Bounds returns the start of the window of c that holds t (the end of the
// one before it), its end, and the end of the window after it, in c's
// Location.
func (c Calendar) Bounds(t time.Time) (start, end, next time.Time) {
	loc := c.location()
	t = t.In(loc)
	if c.Every == Hour {
		// From the start of t's local hour, in absolute time: t less its
		// minutes and seconds past the hour. time.Date would read the
		// next o'clock in one of the two offsets of the hour repeated at
		// the end of summer time, which made that hour's window two
		// hours long (01:30 EDT ended at 02:00 EST).
		start = t.Add(-(time.Duration(t.Minute())*time.Minute + time.Duration(t.Second())*time.Second + time.Duration(t.Nanosecond())))
		return start, start.Add(time.Hour), start.Add(2 * time.Hour)
	}
	if c.Every < Day || c.Every > Month {
		return // not a calendar quota's unit (Validate refuses it)
	}
	if w := lastWindow[c.Every].Load(); w != nil && w.loc == loc && !t.Before(w.start) && t.Before(w.end) {
		return w.start, w.end, w.next
	}
	y, m, d := t.Date()
	switch c.Every {
	case Day:
		start = dayStart(y, m, d, loc)
		end = dayStart(y, m, d+1, loc)
		next = dayStart(y, m, d+2, loc)
	case Week:
		sinceMonday := (int(t.Weekday()) + 6) % 7
		start = dayStart(y, m, d-sinceMonday, loc)
		end = dayStart(y, m, d-sinceMonday+7, loc)
		next = dayStart(y, m, d-sinceMonday+14, loc)
	case Month:
		start = dayStart(y, m, 1, loc)
		end = dayStart(y, m+1, 1, loc)
		next = dayStart(y, m+2, 1, loc)
	}
	lastWindow[c.Every].Store(&window{loc: loc, start: start, end: end, next: next})
	return start, end, next
}

// window is one window of a calendar unit in a zone, and the next one's
// end, as Bounds returns them.
type window struct {
	loc              *time.Location
	start, end, next time.Time
}

// lastWindow keeps, per calendar unit, the window Bounds computed last: a
// quota's decisions (a lease hit's included) ask for the window of now,
// which is nearly always the one asked for last, and computing a day's
// start where the clocks may skip midnight (see dayStart) took a quota's
// lease hit from about 400 to 500-650 ns (a review). Locations are
// compared by pointer: Canonical gives one per zone name.
var lastWindow [Month + 1]atomic.Pointer[window]

// dayStart returns the first instant of the local day y-m-d in loc (the
// date normalised as time.Date does: d 0 is the last of the month
// before). That is its midnight, but for a zone whose clocks skip or
// repeat midnight, where time.Date's reading of a midnight is not
// guaranteed: in America/Santiago summer time begins at 00:00, which
// becomes 01:00, and time.Date read the missing midnight as 23:00 the day
// before, so that the window of a daily quota ended before the times it
// held (23:30 fell past its end; a review, in four zones of 2020-2027).
// There the day begins where the gap ends; where midnight comes twice (a
// zone that leaves summer time at 01:00), at the first.
func dayStart(y int, m time.Month, d int, loc *time.Location) time.Time {
	y, m, d = time.Date(y, m, d, 12, 0, 0, 0, time.UTC).Date()
	t := time.Date(y, m, d, 0, 0, 0, 0, loc)
	if !sameDay(t, y, m, d) {
		// A missing midnight read before the gap, on the day before:
		// the day begins as the gap ends.
		_, end := t.ZoneBounds()
		return end
	}
	begun, _ := t.ZoneBounds()
	switch {
	case begun.IsZero():
	case sameDay(begun.Add(-time.Nanosecond), y, m, d):
		// A midnight that came twice, read as the second: the first
		// was the same wall time on the offset before the change.
		_, before := begun.Add(-time.Nanosecond).Zone()
		_, after := t.Zone()
		return t.Add(time.Duration(after-before) * time.Second)
	case begun.Before(t) && sameDay(begun, y, m, d):
		// A missing midnight read after a gap that ended past it (from
		// 23:30 to 00:30, say): the day begins as the gap ends.
		return begun
	}
	return t
}

// sameDay reports whether t falls on the local day y-m-d of its Location.
func sameDay(t time.Time, y int, m time.Month, d int) bool {
	ty, tm, td := t.Date()
	return ty == y && tm == m && td == d
}

// zones maps a time zone's name to the one *time.Location Canonical gives
// for it.
var zones cowmap.Map[string, *time.Location]

// Canonical returns l with its calendar Location replaced by the one
// *time.Location this package keeps for a zone of that name, so that two
// quotas in one zone compare equal (with ==, and as map keys) even when
// each loaded its own Location (time.LoadLocation returns a new one every
// time); other limits are returned as they are. leaselimit canonicalises
// every limit it is given.
//
// A limit Validate refuses is returned as it is, and its zone's name is
// not kept. A Location without a name, or whose name this package already
// keeps for a zone of other offsets, is returned as it is, and Validate
// refuses it:
// the name is the zone's identity here and in the bucket's Redis key, so
// two zones under one name would share windows and buckets.
func (l Limit) Canonical() Limit {
	loc := l.Calendar.Location
	if loc == nil || badZoneName(loc.String()) >= 0 {
		return l // Validate refuses it; nothing is kept
	}
	if l.IsQuota() && (loc == time.UTC || loc.String() == "UTC" && sameOffsets(loc, time.UTC)) {
		// nil, as a nil Location is: the bucket's Redis key says UTC for
		// both, and as two Limits they had a FailLocal share each.
		l.Calendar.Location = nil
		return l
	}
	kept, ok := zones.Load(loc.String())
	if !ok {
		if l.Validate() != nil {
			// Only a limit Validate takes may name a zone for good: a
			// refused one (a quota of 0 tokens, say) kept its zone's
			// name, and every later quota of the true zone by that name
			// was refused, on every Client, for the life of the process
			// (a review).
			return l
		}
		kept = zones.LoadOrMake(loc.String(), func() *time.Location { return loc })
	}
	if kept != loc && !sameOffsets(kept, loc) {
		return l
	}
	l.Calendar.Location = kept
	return l
}

// validateZone refuses a Location that cannot name its zone: one without a
// name (time.Parse of a numeric offset gives one, as does
// time.FixedZone("", offset)), one whose name cannot go into a Redis key
// (see badZoneName), and one whose name this package keeps for a
// zone of other offsets (see Canonical).
func validateZone(l Limit) error {
	loc := l.Calendar.Location
	if loc == nil {
		return nil
	}
	name := loc.String()
	if name == "" {
		return fmt.Errorf("%w: %s: the calendar's Location has no name, and the name is the zone's identity in the bucket's Redis key; name it (time.FixedZone(\"UTC+9\", 9*3600), or time.LoadLocation)", ErrInvalidLimit, l.Name)
	}
	if i := badZoneName(name); i >= 0 {
		return fmt.Errorf("%w: %s: the zone name %q holds %q; it goes into the bucket's Redis key: use printable ASCII without spaces or braces (a brace would make a Cluster hash tag)", ErrInvalidLimit, l.Name, name, name[i])
	}
	if name == "UTC" && !sameOffsets(loc, time.UTC) {
		// The name of a nil Location's key (see Canonical).
		return fmt.Errorf("%w: %s: a zone named UTC must be UTC", ErrInvalidLimit, l.Name)
	}
	if kept, ok := zones.Load(name); ok && kept != loc && !sameOffsets(kept, loc) {
		return fmt.Errorf("%w: %s: the zone name %q already names a zone of other offsets in this process; one name must mean one zone on every instance", ErrInvalidLimit, l.Name, name)
	}
	return nil
}

// badZoneName returns the index of the first byte of a zone name that has
// no place in a Redis key (beyond printable ASCII, a space, a brace), or
// -1 if there is none; 0 for an empty name.
func badZoneName(name string) int {
	if name == "" {
		return 0
	}
	return keybytes.FirstBad(name)
}

// sameOffsets reports whether a and b have the same UTC offset at a few
// instants over the coming year (quarterly, which meets both sides of a
// summer time): enough to tell two zones apart that merely share a name.
func sameOffsets(a, b *time.Location) bool {
	t := time.Now()
	for range 4 {
		_, oa := t.In(a).Zone()
		_, ob := t.In(b).Zone()
		if oa != ob {
			return false
		}
		t = t.Add(91 * 24 * time.Hour)
	}
	return true
}

// location is c's Location, UTC for nil.
func (c Calendar) location() *time.Location {
	if c.Location == nil {
		return time.UTC
	}
	return c.Location
}
