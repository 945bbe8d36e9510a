// Package breaker is for users who tune the circuit breaker that guards
// leaselimit's Redis calls: pass Settings to leaselimit.WithBreaker, read
// a State from Client.BreakerState, and recognise ErrOpen in the error of a
// call that needs Redis (Peek, Reset) while the breaker holds calls back.
// The breaker itself is the Client's own.
//
// Counted as failures: network errors, timeouts (including the Client's own
// time budget, once the Client has found that its own process was keeping
// up; a budget miss while the process was behind is not Redis's),
// connection refused or reset, a closed pool, and Redis replies that mean
// the server cannot serve now (LOADING, BUSY, READONLY, MASTERDOWN,
// CLUSTERDOWN, TRYAGAIN, MISCONF, NOREPLICAS, OOM). Not counted: success, a
// caller's context.Canceled, NOSCRIPT (the script is reloaded and the call
// retried), and errors that are leaselimit's own bugs, which are returned
// to the caller instead of being hidden behind the failure policy.
package breaker

import (
	"errors"
	"fmt"
	"strconv"
	"time"
)

// State is the breaker's state.
type State int32

// The breaker's states.
const (
	Closed State = iota
	HalfOpen
	Open
)

// String returns "closed", "half-open" or "open".
func (s State) String() string {
	switch s {
	case Closed:
		return "closed"
	case HalfOpen:
		return "half-open"
	case Open:
		return "open"
	}
	return "unknown state: " + strconv.Itoa(int(s))
}

// ErrOpen is wrapped by the error of a call that needs Redis (Peek, Reset)
// made while the breaker is open or its half-open probes are all in
// flight: no Redis call was made.
var ErrOpen = errors.New("breaker: open")

// Settings configures the circuit breaker (leaselimit.WithBreaker). Zero
// fields take the documented defaults.
type Settings struct {
	// Failures is the number of consecutive failures that opens the breaker.
	// Default 5.
	Failures uint32
	// OpenFor is how long the breaker stays open before it lets probes
	// through (half-open). Default 250ms: after a short stall decisions
	// return to Redis within about OpenFor of Redis answering again. The
	// price, during a long outage, is up to Probes calls per node every
	// OpenFor (plus the budget each probe waits), each making its caller
	// wait up to the time budget; a longer OpenFor saves those waits and
	// keeps the failure policy deciding longer after Redis is back. At
	// most MaxOpenFor.
	OpenFor time.Duration
	// Probes is how many calls may run while half-open; that many successes
	// in a row close the breaker, one failure opens it again. Default 1:
	// each probe's caller waits up to the time budget while Redis is down,
	// and one success says as much as three (gobreaker's default too).
	Probes uint32
	// Interval clears the failure counts periodically while closed, so
	// sparse failures never add up to a trip. Default 10s.
	Interval time.Duration
	// OnStateChange, if set, is called on every transition. It runs under the
	// breaker's lock: it may only record (an atomic store, a metric), never
	// call back into the Client, a Limiter or the breaker.
	OnStateChange func(from, to State)
}

// MaxOpenFor is the longest OpenFor Validate takes. However short the
// outage that opened it, the breaker lets no call reach Redis for OpenFor,
// and the failure policy decides every one: FailOpen admits all, without
// bound, FailClosed denies all. An OpenFor of hours (a review gave
// math.MaxInt64) turned a blip into as long an outage of the limit, while
// Redis answered and Check said all was well.
const MaxOpenFor = time.Minute

// Validate reports whether s is usable.
func (s Settings) Validate() error {
	if s.OpenFor < 0 || s.Interval < 0 {
		return errors.New("breaker: OpenFor and Interval must be >= 0")
	}
	if s.OpenFor > MaxOpenFor {
		return fmt.Errorf("breaker: OpenFor %v is above MaxOpenFor (%v): the failure policy would decide every call for that long after Redis answers again", s.OpenFor, MaxOpenFor)
	}
	return nil
}
