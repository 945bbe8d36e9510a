// Package clockhook lets the tests of leaselimit's own packages run a
// Client on a clock they step by hand. The option that sets a Client's
// clock is not part of leaselimit's API; package leaselimit hands it out
// here, and nothing outside leaselimit's tests should use it.
package clockhook

import "time"

// Clock is a source of time: the system clock, or a test's.
type Clock interface {
	Now() time.Time
}

// WithClock returns the leaselimit.Option (as an any, since this package
// cannot name leaselimit's types) that makes a Client read clk for its
// local state: leases, the negative cache, demand estimates, FailLocal
// buckets and the breaker's open-until. Package leaselimit sets it when it
// is initialised; it is nil in a program that does not link leaselimit.
var WithClock func(clk Clock) any
