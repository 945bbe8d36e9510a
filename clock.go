package leaselimit

import (
	"errors"
	"time"

	"github.com/leaselimit/leaselimit/internal/clockhook"
)

// clockSource is the source of time for the local state of a Client (lease
// expiry, the negative cache, demand estimates). The bucket itself runs on
// Redis's clock. The default is the system clock; tests step one by hand
// (withClock).
type clockSource interface {
	Now() time.Time
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

// withClock sets the clock used for local state: leases, the negative
// cache, demand estimates, FailLocal buckets and the breaker's open-until
// (so a fallback's RetryAfter is on this clock too). WaitN still compares
// with ctx's deadline, and sleeps, on the real clock, as contexts do.
// Default: the system clock. For tests: the root's own through
// export_test.go, other packages' through internal/clockhook.
func withClock(clk clockSource) Option {
	return engineOption{"withClock", func(c *config) error {
		if clk == nil {
			return errors.New("leaselimit: nil clock")
		}
		c.clock = clk
		return nil
	}}
}

func init() {
	clockhook.WithClock = func(clk clockhook.Clock) any { return withClock(clk) }
}

// localClock reads a clockSource as the lease protocol's monotonic
// nanoseconds since the Client was made.
type localClock struct {
	src    clockSource
	origin time.Time
}

func newLocalClock(src clockSource) localClock { return localClock{src: src, origin: src.Now()} }

// wall returns the clock's reading.
func (c localClock) wall() time.Time { return c.src.Now() }

// now returns the local monotonic time in nanoseconds.
func (c localClock) now() int64 { return c.mono(c.src.Now()) }

// mono converts a reading of the clock to local monotonic time.
func (c localClock) mono(t time.Time) int64 { return int64(t.Sub(c.origin)) }
