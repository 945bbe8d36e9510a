// Package policy is for everyone who configures leaselimit: the plain data
// of a limit (a token-bucket Limit from PerSecond … PerDay, or a calendar
// quota from Quota), the FailureMode used while Redis is unavailable, and
// the Lease settings that tune local leases. It has no Redis imports;
// every type validates itself and returns errors that wrap ErrInvalidLimit.
package policy

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"time"
)

// ErrInvalidLimit is wrapped by every error returned by Limit.Validate,
// Lease.Validate and FailureMode.Validate.
var ErrInvalidLimit = errors.New("policy: invalid limit")

// settingError is an invalid Lease or FailureMode: it wraps ErrInvalidLimit,
// as the package promises, but says what it is. Its text had been "policy:
// invalid limit: unknown failure mode 7", under an option that has no
// limit in it (leaselimit.WithFailureMode).
type settingError struct{ msg string }

func (e *settingError) Error() string { return e.msg }
func (e *settingError) Unwrap() error { return ErrInvalidLimit }

// invalidSetting returns a settingError of format and args.
func invalidSetting(format string, args ...any) error {
	return &settingError{msg: "policy: invalid setting: " + fmt.Sprintf(format, args...)}
}

// maxNameLen is the longest Limit.Name accepted.
const maxNameLen = 64

// Limit is a token bucket: it holds at most Burst tokens and refills
// continuously at Rate tokens per Period. A request for n tokens is admitted
// when the bucket holds at least n, and then takes them; a denial takes
// nothing.
//
// Name identifies the limit in Redis keys and telemetry: two Limiters with the
// same Name and prefix share buckets, so give every distinct limit its own
// Name. It may hold ASCII letters, digits, '-', '_' and '.', at most 64
// bytes.
type Limit struct {
	Name   string
	Rate   int64         // tokens added per Period; > 0
	Period time.Duration // > 0, a whole number of microseconds
	Burst  int64         // bucket capacity; > 0
	// Calendar, if set, makes the limit a quota whose tokens come back
	// all at once at fixed boundaries (see Quota) rather than continuously.
	Calendar Calendar
}

// PerSecond returns a limit of n tokens per second with Burst n and Name "default".
func PerSecond(n int64) Limit { return Limit{Name: "default", Rate: n, Period: time.Second, Burst: n} }

// PerMinute returns a limit of n tokens per minute with Burst n and Name "default".
func PerMinute(n int64) Limit { return Limit{Name: "default", Rate: n, Period: time.Minute, Burst: n} }

// PerHour returns a limit of n tokens per hour with Burst n and Name "default".
func PerHour(n int64) Limit { return Limit{Name: "default", Rate: n, Period: time.Hour, Burst: n} }

// PerDay returns a limit of n tokens per day with Burst n and Name "default".
func PerDay(n int64) Limit { return Limit{Name: "default", Rate: n, Period: 24 * time.Hour, Burst: n} }

// WithBurst returns a copy of l with the given Burst.
func (l Limit) WithBurst(b int64) Limit { l.Burst = b; return l }

// WithName returns a copy of l with the given Name.
func (l Limit) WithName(name string) Limit { l.Name = name; return l }

// PeriodMicros returns Period in whole microseconds.
func (l Limit) PeriodMicros() int64 { return int64(l.Period / time.Microsecond) }

// Validate reports whether l can be enforced exactly: a Name, Rate and
// Burst in [1, MaxRate], Period in whole microseconds in [1µs, MaxPeriod].
// The error wraps ErrInvalidLimit and names the offending field.
func (l Limit) Validate() error {
	if l == (Limit{}) {
		// Said apart from an empty name: a Limit looked up in a map that
		// does not hold it (plans[user.Plan]) arrives as the zero value,
		// and "name is empty" sent its caller looking at names.
		return fmt.Errorf("%w: the zero Limit (no name, rate, period or burst), as a map lookup of a missing key returns", ErrInvalidLimit)
	}
	if err := validateName(l.Name); err != nil {
		return err
	}
	// A quota's unit first: Quota gives an unknown unit a period of 0,
	// which the period's check would report instead.
	if u := l.Calendar.Every; u != noCalendar && (u < Hour || u > Month) {
		return fmt.Errorf("%w: %s: unknown calendar unit %d", ErrInvalidLimit, l.Name, int(u))
	}
	switch {
	case l.IsQuota() && l.Rate <= 0:
		return fmt.Errorf("%w: %s: a quota's tokens %d must be > 0", ErrInvalidLimit, l.Name, l.Rate)
	case l.Rate <= 0:
		return fmt.Errorf("%w: %s: rate %d must be > 0", ErrInvalidLimit, l.Name, l.Rate)
	case l.Burst <= 0:
		return fmt.Errorf("%w: %s: burst %d must be > 0", ErrInvalidLimit, l.Name, l.Burst)
	case l.Period <= 0:
		return fmt.Errorf("%w: %s: period %v must be > 0", ErrInvalidLimit, l.Name, l.Period)
	case l.Period%time.Microsecond != 0:
		return fmt.Errorf("%w: %s: period %v must be a whole number of microseconds", ErrInvalidLimit, l.Name, l.Period)
	}
	if l.Rate > MaxRate || l.Burst > MaxRate {
		return fmt.Errorf("%w: %s: rate and burst must be at most %d", ErrInvalidLimit, l, int64(MaxRate))
	}
	if l.Period > MaxPeriod {
		return fmt.Errorf("%w: %s: period must be at most %v (ten years)", ErrInvalidLimit, l, MaxPeriod)
	}
	return l.Calendar.validate(l)
}

// The range of a Limit: Rate and Burst from 1 to MaxRate, Period from 1 µs
// to MaxPeriod in whole microseconds. Within it the bucket's arithmetic is
// exact integer arithmetic (whole tokens and the fraction of the next one
// kept apart, the rate and period reduced by their gcd), on Redis and in
// the FailLocal buckets; a day of 10^12 tokens is as exact as a second of
// one. Durations the bucket reports (RetryAfter, ResetAfter) are exact up to
// 2^52 µs (about 142 years) and saturate there.
const (
	MaxRate   = 1 << 50 // about 1.1e15
	MaxPeriod = 3660 * 24 * time.Hour
)

// validateName reports whether name is usable as a limit name in Redis keys.
func validateName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: name is empty", ErrInvalidLimit)
	}
	if len(name) > maxNameLen {
		return fmt.Errorf("%w: name is %d bytes, longer than %d", ErrInvalidLimit, len(name), maxNameLen)
	}
	for i := 0; i < len(name); i++ {
		if !safeByte(name[i]) {
			return fmt.Errorf("%w: name %q holds %q; use ASCII letters, digits, '-', '_' and '.'", ErrInvalidLimit, name, name[i])
		}
	}
	return nil
}

func safeByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.'
}

// Interval returns the time in which the bucket gains n tokens, rounded up to
// a whole microsecond, exactly (128-bit arithmetic); durations past
// time.Duration's range saturate at its maximum.
func (l Limit) Interval(n int64) time.Duration {
	if n <= 0 || l.Rate <= 0 || l.Period <= 0 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(n), uint64(l.PeriodMicros()))
	rate := uint64(l.Rate)
	if hi >= rate {
		return time.Duration(math.MaxInt64)
	}
	q, rem := bits.Div64(hi, lo, rate)
	if rem > 0 {
		q++
	}
	if q == 0 && l.PeriodMicros() == 0 {
		return 0
	}
	if q > uint64(math.MaxInt64/int64(time.Microsecond)) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(q) * time.Microsecond
}

// ResetAfter returns how long after now a bucket of l that holds remaining
// tokens is full again: the refill time of the missing tokens (Interval),
// or, for a calendar quota that is not full, the time to the end of the
// window that holds now.
func (l Limit) ResetAfter(remaining int64, now time.Time) time.Duration {
	if !l.IsQuota() || remaining >= l.Burst {
		return l.Interval(l.Burst - remaining)
	}
	end, _ := l.Calendar.Window(now)
	return end.Sub(now)
}

func (l Limit) String() string {
	if l.IsQuota() {
		return l.Name + ": " + strconv.FormatInt(l.Burst, 10) + " per " + l.Calendar.Every.String() + " in " + l.Calendar.location().String()
	}
	return l.Name + ": " + strconv.FormatInt(l.Rate, 10) + "/" + l.Period.String() + " burst=" + strconv.FormatInt(l.Burst, 10)
}

// FailureMode says what a Limiter decides while Redis is unavailable (the
// circuit breaker is open, or an authority call failed or ran out of time).
type FailureMode int

const (
	// FailOpen admits every request. Use it for limits that protect
	// capacity, where an outage of the limiter must not become an outage of
	// the service. It is the default.
	FailOpen FailureMode = iota
	// FailClosed denies every request. Use it for security limits (login
	// attempts, password resets) where over-admission is worse than refusal.
	FailClosed
	// FailLocal runs a local token bucket per key with 1/FleetSize of the
	// limit, so the fleet as a whole stays near the limit during an outage.
	FailLocal
)

// String returns "open", "closed" or "local".
func (m FailureMode) String() string {
	switch m {
	case FailOpen:
		return "open"
	case FailClosed:
		return "closed"
	case FailLocal:
		return "local"
	}
	return "FailureMode(" + strconv.Itoa(int(m)) + ")"
}

// Validate reports whether m is one of the defined modes.
func (m FailureMode) Validate() error {
	if m < FailOpen || m > FailLocal {
		return invalidSetting("unknown failure mode %d: want FailOpen, FailClosed or FailLocal", int(m))
	}
	return nil
}
