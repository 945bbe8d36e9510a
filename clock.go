package leaselimit

import "time"

// Clock is the source of time for the local state of a Client (lease
// expiry, the negative cache, demand estimates). The bucket itself runs on
// Redis's clock. The default is the system clock; tests can step one by hand.
type Clock interface {
	Now() time.Time
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

// localClock reads a Clock as the lease protocol's monotonic nanoseconds
// since the Client was made.
type localClock struct {
	src    Clock
	origin time.Time
}

func newLocalClock(src Clock) localClock { return localClock{src: src, origin: src.Now()} }

// wall returns the clock's reading.
func (c localClock) wall() time.Time { return c.src.Now() }

// now returns the local monotonic time in nanoseconds.
func (c localClock) now() int64 { return c.mono(c.src.Now()) }

// mono converts a reading of the clock to local monotonic time.
func (c localClock) mono(t time.Time) int64 { return int64(t.Sub(c.origin)) }
