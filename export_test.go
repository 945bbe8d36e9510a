package leaselimit

// What the root's external tests (package leaselimit_test) use and users
// do not get.

// WithClock runs a Client on a clock the test steps by hand (withClock).
var WithClock = withClock

// DefaultPrefix is the Redis key prefix of a Client without WithPrefix.
const DefaultPrefix = defaultPrefix

// ShutdownOf closes the Client behind l, which a test may no longer hold.
func ShutdownOf(l *Limiter) error { return l.engine.shutdown() }
