package policy

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"
	"time"
)

func TestCalendarWindow(t *testing.T) {
	ny, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Skip("no time zone database:", err)
	}
	kolkata, err := time.LoadLocation("Asia/Kolkata")
	if err != nil {
		t.Skip("no time zone database:", err)
	}
	utc := func(s string) time.Time {
		v, err := time.Parse("2006-01-02 15:04", s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	at := func(s string, loc *time.Location) time.Time {
		v, err := time.ParseInLocation("2006-01-02 15:04", s, loc)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, tc := range []struct {
		c         Calendar
		t         time.Time
		end, next time.Time
	}{
		{Calendar{Every: Hour}, at("2026-12-01 15:42", time.UTC), at("2026-12-01 16:00", time.UTC), at("2026-12-01 17:00", time.UTC)},
		{Calendar{Every: Day}, at("2026-12-01 15:42", time.UTC), at("2026-12-02 00:00", time.UTC), at("2026-12-03 00:00", time.UTC)},
		// The day summer time ends in New York has 25 hours: midnight to midnight there.
		{Calendar{Every: Day, Location: ny}, at("2026-11-01 10:00", ny), at("2026-11-02 00:00", ny), at("2026-11-03 00:00", ny)},
		{Calendar{Every: Week}, at("2026-12-01 15:42", time.UTC), at("2026-12-07 00:00", time.UTC), at("2026-12-14 00:00", time.UTC)}, // a Tuesday
		{Calendar{Every: Week}, at("2026-12-07 00:00", time.UTC), at("2026-12-14 00:00", time.UTC), at("2026-12-21 00:00", time.UTC)}, // a Monday
		{Calendar{Every: Month}, at("2026-12-31 23:59", time.UTC), at("2027-01-01 00:00", time.UTC), at("2027-02-01 00:00", time.UTC)},
		{Calendar{Every: Month, Location: ny}, at("2027-01-31 22:00", ny), at("2027-02-01 00:00", ny), at("2027-03-01 00:00", ny)},
		// The hour repeated when summer time ends in New York (01:00 EDT
		// to 01:00 EST, 05:00Z to 06:00Z) is two hours, each an hour long.
		{Calendar{Every: Hour, Location: ny}, utc("2026-11-01 05:30"), utc("2026-11-01 06:00"), utc("2026-11-01 07:00")},
		{Calendar{Every: Hour, Location: ny}, utc("2026-11-01 06:30"), utc("2026-11-01 07:00"), utc("2026-11-01 08:00")},
		// The hour skipped when it starts: 01:30 EST ends at 03:00 EDT.
		{Calendar{Every: Hour, Location: ny}, utc("2027-03-14 06:30"), utc("2027-03-14 07:00"), utc("2027-03-14 08:00")},
		// A zone half an hour off UTC: its hours start at half past.
		{Calendar{Every: Hour, Location: kolkata}, utc("2026-12-01 15:42"), utc("2026-12-01 16:30"), utc("2026-12-01 17:30")},
	} {
		end, next := tc.c.Window(tc.t)
		if !end.Equal(tc.end) || !next.Equal(tc.next) {
			t.Errorf("%v Window(%v) = %v, %v; want %v, %v", tc.c.Every, tc.t, end, next, tc.end, tc.next)
		}
		// The window starts where the one before it ends, at or before t.
		start, _, _ := tc.c.Bounds(tc.t)
		if prev, _ := tc.c.Window(start.Add(-time.Nanosecond)); !prev.Equal(start) || start.After(tc.t) {
			t.Errorf("%v Bounds(%v) starts %v; the window before ends %v", tc.c.Every, tc.t, start, prev)
		}
	}
	end, _ := Calendar{Every: Day, Location: ny}.Window(at("2026-11-01 10:00", ny))
	if d := end.Sub(at("2026-11-01 00:00", ny)); d != 25*time.Hour {
		t.Errorf("the day summer time ends lasts %v in New York; want 25h", d)
	}
}

// TestCalendarWindowsTile: in zones whose clocks skip or repeat midnight
// (America/Santiago and America/Havana begin summer time at 00:00,
// America/Scoresbysund has left it at midnight, Asia/Gaza left it at 01:00
// in 2020), as in ordinary ones, every instant of 2020-2027 falls in the
// window Bounds gives it, each window begins where the one before ends,
// and each begins on its own local day. time.Date read a skipped midnight
// as 23:00 the day before: the window of 23:30 ended before it (a review).
func TestCalendarWindowsTile(t *testing.T) {
	var locs []*time.Location
	for _, name := range []string{"America/Santiago", "America/Havana", "America/Scoresbysund", "Asia/Gaza", "Atlantic/Azores", "America/New_York", "Australia/Lord_Howe"} {
		loc, err := time.LoadLocation(name)
		if err != nil {
			t.Skip("no time zone database:", err)
		}
		locs = append(locs, loc)
	}
	// No zone of the database has a gap that ends past midnight, east of
	// UTC, where time.Date reads the missing midnight after the gap (a
	// review): one made from a TZ rule, summer time from 23:30 (+01:30) to
	// 00:30 (+02:30) on the last Sunday of March.
	straddle, err := zoneOfRule("STD-1:30DST,M3.5.0/23:30,M10.5.0/3")
	if err != nil {
		t.Fatal(err)
	}
	locs = append(locs, straddle)
	for _, loc := range locs {
		for _, every := range []CalendarUnit{Day, Week, Month} {
			c := Calendar{Every: every, Location: loc}
			bad := 0
			// Half an hour after and before each local midnight, and noon:
			// where a window that began or ended an hour off would show.
			var ats []time.Time
			for day := time.Date(2020, 1, 1, 12, 0, 0, 0, time.UTC); day.Year() < 2028; day = day.AddDate(0, 0, 1) {
				y, m, d := day.Date()
				ats = append(ats, time.Date(y, m, d, 0, 30, 0, 0, loc), time.Date(y, m, d, 12, 0, 0, 0, loc), time.Date(y, m, d, 23, 30, 0, 0, loc))
			}
			for _, at := range ats {
				if bad >= 3 {
					break
				}
				start, end, next := c.Bounds(at)
				_, nextEnd, _ := c.Bounds(end)
				prevStart, prevEnd, _ := c.Bounds(start.Add(-time.Nanosecond))
				local := start.In(loc)
				ok := !at.Before(start) && at.Before(end) && end.Before(next) && nextEnd.Equal(next) && prevEnd.Equal(start) && prevStart.Before(start)
				switch every {
				case Week:
					ok = ok && local.Weekday() == time.Monday
				case Month:
					ok = ok && local.Day() == 1
				}
				if !ok {
					bad++
					t.Errorf("%v %s: Bounds(%v) = %v, %v, %v; the window before %v to %v, the one after ends %v",
						loc, every, at.In(loc), start.In(loc), end.In(loc), next.In(loc), prevStart.In(loc), prevEnd.In(loc), nextEnd.In(loc))
				}
			}
		}
	}
	// In the made zone, Monday 2026-03-30 begins at 00:30, as the gap ends
	// (Sunday 23:30 +01:30, 22:00 UTC).
	if start, _, _ := (Calendar{Every: Day, Location: straddle}).Bounds(time.Date(2026, 3, 29, 22, 40, 0, 0, time.UTC)); !start.Equal(time.Date(2026, 3, 29, 22, 0, 0, 0, time.UTC)) {
		t.Errorf("a gap from 23:30 to 00:30: the day after begins at %v; want 00:30 +02:30", start.In(straddle))
	}
	// The review's case: 23:30 in Santiago the day before summer time
	// begins (midnight becomes 01:00) is in the day that ends at 01:00.
	santiago := locs[0]
	start, end, _ := Calendar{Every: Day, Location: santiago}.Bounds(time.Date(2026, 9, 6, 3, 30, 0, 0, time.UTC))
	if want := time.Date(2026, 9, 6, 4, 0, 0, 0, time.UTC); !end.Equal(want) || !start.Equal(time.Date(2026, 9, 5, 4, 0, 0, 0, time.UTC)) {
		t.Errorf("Santiago, 2026-09-05 23:30: window %v to %v; want 2026-09-05 00:00 -04 to %v", start.In(santiago), end.In(santiago), want.In(santiago))
	}
}

// zoneOfRule makes a zone whose every offset follows the POSIX TZ rule
// rule: a TZif file with one type and no transitions, the rule in its
// footer.
func zoneOfRule(rule string) (*time.Location, error) {
	block := func(b []byte) []byte {
		// The header's six counts (UT/local, standard/wall, leap,
		// transitions, types, abbreviation bytes), then one type, +00:00,
		// and its abbreviation.
		for _, n := range []uint32{0, 0, 0, 0, 1, 4} {
			b = binary.BigEndian.AppendUint32(b, n)
		}
		return append(b, 0, 0, 0, 0, 0, 0, 'S', 'T', 'D', 0)
	}
	header := append([]byte("TZif2"), make([]byte, 15)...)
	data := block(append([]byte(nil), header...))
	data = block(append(data, header...))
	data = append(data, "\n"+rule+"\n"...)
	return time.LoadLocationFromTZData("Test/Straddle", data)
}

func TestQuotaValidate(t *testing.T) {
	if err := Quota("daily", 10_000, Day, time.UTC).Validate(); err != nil {
		t.Errorf("Quota(daily) = %v", err)
	}
	bad := []Limit{
		Quota("local", 10, Day, time.Local),
		{Name: "half", Rate: 5, Period: 24 * time.Hour, Burst: 10, Calendar: Calendar{Every: Day}},
		{Name: "long", Rate: 10, Period: time.Hour, Burst: 10, Calendar: Calendar{Every: Day}},
		{Name: "zone", Rate: 10, Period: time.Hour, Burst: 10, Calendar: Calendar{Location: time.UTC}},
		{Name: "odd", Rate: 10, Period: time.Hour, Burst: 10, Calendar: Calendar{Every: CalendarUnit(9)}},
		Quota("unnamed", 10, Day, time.FixedZone("", 9*3600)),
		Quota("fake-utc", 10, Day, time.FixedZone("UTC", 3600)),
	}
	for _, l := range bad {
		if err := l.Validate(); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("%+v.Validate() = %v; want ErrInvalidLimit", l, err)
		}
	}
	// The error names what is wrong in Quota's own terms. Regression: an
	// unknown unit was "period 0s must be > 0", and no tokens "rate 0".
	for _, tc := range []struct {
		l    Limit
		want string
	}{
		{Quota("q", 5, CalendarUnit(42), time.UTC), "unknown calendar unit 42"},
		{Quota("q", 0, Day, time.UTC), "a quota's tokens 0 must be > 0"},
		{Quota("q", -3, Month, time.UTC), "a quota's tokens -3 must be > 0"},
	} {
		if err := tc.l.Validate(); !errors.Is(err, ErrInvalidLimit) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v.Validate() = %v; want ErrInvalidLimit saying %q", tc.l, err, tc.want)
		}
	}
}

// TestCanonical: quotas in one zone, each with a Location of its own
// loading, compare equal once canonical; other limits are untouched.
func TestCanonical(t *testing.T) {
	a, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Skip("no time zone database:", err)
	}
	b, _ := time.LoadLocation("America/New_York")
	if a == b {
		t.Skip("time.LoadLocation returned one Location twice")
	}
	qa, qb := Quota("daily", 10, Day, a), Quota("daily", 10, Day, b)
	if qa == qb {
		t.Fatal("quotas with Locations of their own compare equal before Canonical")
	}
	if ca, cb := qa.Canonical(), qb.Canonical(); ca != cb || ca.Calendar.Location.String() != "America/New_York" {
		t.Errorf("Canonical: %v and %v differ", ca, cb)
	}
	// UTC, however written, is nil, as its Redis key says: two Limits of
	// one bucket had a FailLocal share each (20 admitted of 10).
	for _, utc := range []*time.Location{time.UTC, time.FixedZone("UTC", 0)} {
		if c := Quota("utc", 10, Hour, utc).Canonical(); c != Quota("utc", 10, Hour, nil) {
			t.Errorf("Canonical of a quota in %v = %v; want the nil Location's", utc, c)
		}
	}
	for _, l := range []Limit{PerSecond(5), Quota("utc", 10, Hour, nil)} {
		if c := l.Canonical(); c != l {
			t.Errorf("Canonical(%v) = %v; want it unchanged", l, c)
		}
	}
}

func TestResetAfter(t *testing.T) {
	now := time.Date(2026, 12, 1, 15, 30, 0, 0, time.UTC)
	daily := Quota("daily", 100, Day, time.UTC)
	for _, tc := range []struct {
		l         Limit
		remaining int64
		want      time.Duration
	}{
		{PerMinute(60), 58, 2 * time.Second}, // two tokens to refill
		{PerMinute(60), 60, 0},               // full
		{PerMinute(60).WithBurst(120), 0, 2 * time.Minute},
		{daily, 40, 8*time.Hour + 30*time.Minute}, // until midnight
		{daily, 100, 0},                           // full: nothing to wait for
	} {
		if got := tc.l.ResetAfter(tc.remaining, now); got != tc.want {
			t.Errorf("%v: ResetAfter(%d) = %v; want %v", tc.l, tc.remaining, got, tc.want)
		}
	}
}

// TestZoneNameIsItsIdentity: the zone's name is its identity (in the
// bucket's Redis key, and in Canonical), so a Location without a name
// (time.Parse of a numeric offset gives one) is refused, and so is a
// second zone of other offsets under a name already kept. Both were
// taken for whichever zone of that name came first: a -05:00 day
// enforced as a +09:00 one, 14 hours off.
func TestZoneNameIsItsIdentity(t *testing.T) {
	ts, err := time.Parse(time.RFC3339, "2026-12-03T10:00:00+09:00")
	if err != nil {
		t.Fatal(err)
	}
	if err := Quota("parsed", 10, Day, ts.Location()).Canonical().Validate(); !errors.Is(err, ErrInvalidLimit) {
		t.Errorf("a quota in time.Parse's unnamed zone: Validate = %v; want ErrInvalidLimit", err)
	}
	// A zone's name goes into the bucket's Redis key: a brace there would
	// make every key of the limit one Cluster hash tag (one slot).
	for _, name := range []string{"Zone{tag}", "Zone }", "Zone\n", "Zoné"} {
		if err := Quota("odd", 10, Day, time.FixedZone(name, 3600)).Canonical().Validate(); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("a quota in a zone named %q: Validate = %v; want ErrInvalidLimit", name, err)
		}
	}
	first := Quota("named", 10, Day, time.FixedZone("TestZone+9", 9*3600)).Canonical()
	if err := first.Validate(); err != nil {
		t.Fatalf("a quota in a named fixed zone: %v", err)
	}
	same := Quota("named", 10, Day, time.FixedZone("TestZone+9", 9*3600)).Canonical()
	if same != first || same.Validate() != nil {
		t.Errorf("the same zone under the same name: %v (%v); want %v", same, same.Validate(), first)
	}
	other := Quota("named", 10, Day, time.FixedZone("TestZone+9", -5*3600)).Canonical()
	if _, off := time.Now().In(other.Calendar.Location).Zone(); off != -5*3600 {
		t.Errorf("Canonical swapped a -05:00 zone for the +09:00 one of its name (offset %d)", off)
	}
	if err := other.Validate(); !errors.Is(err, ErrInvalidLimit) {
		t.Errorf("another zone under a name kept: Validate = %v; want ErrInvalidLimit", err)
	}

	// A limit Validate refuses names no zone: the true zone of that name
	// is taken afterwards (a refused quota of 0 tokens kept its fake
	// zone's name for the process's life).
	if err := Quota("refused", 0, Day, time.FixedZone("TestZone-3", 5*3600)).Canonical().Validate(); !errors.Is(err, ErrInvalidLimit) {
		t.Fatalf("a quota of 0 tokens: Validate = %v; want ErrInvalidLimit", err)
	}
	if err := Quota("taken", 10, Day, time.FixedZone("TestZone-3", -3*3600)).Canonical().Validate(); err != nil {
		t.Errorf("a zone whose name only a refused limit used: %v", err)
	}
}
