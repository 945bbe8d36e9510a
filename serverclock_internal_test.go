package leaselimit

import (
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/internal/clockhook"
)

// TestServerClock: before any reply the estimate of Redis's clock is the
// instance's; after one, Redis's time in it carried on by the monotonic
// clock, whatever the instance's wall clock says; a reply a little later
// than the last stored (its latency) leaves it, one that moves it further
// (Redis's clock changed: a failover) replaces it; a reply with no time
// changes nothing.
func TestServerClock(t *testing.T) {
	var c serverClock
	now := time.Now()
	if got := c.at(now); !got.Equal(now) {
		t.Fatalf("before any reply: at(now) = %v; want now, %v", got, now)
	}
	c.observe(0, now)
	if got := c.at(now); !got.Equal(now) {
		t.Fatalf("after a reply with no time: at(now) = %v; want now", got)
	}
	redis := now.Add(-90 * time.Second) // Redis's clock 90 s behind this one
	c.observe(redis.UnixMicro(), now)
	later := now.Add(time.Second)
	if got := c.at(later); got.Sub(redis.Add(time.Second)).Abs() > time.Microsecond {
		t.Errorf("a second after the reply: at = %v; want Redis's %v", got, redis.Add(time.Second))
	}
	// The instance's wall clock stepped back an hour: the estimate does
	// not move with it.
	stepped, ok := clockhook.StepWall(later, -time.Hour)
	if !ok {
		t.Fatal("clockhook.StepWall cannot make a stepped reading")
	}
	if got := c.at(stepped); got.Sub(redis.Add(time.Second)).Abs() > time.Microsecond {
		t.Errorf("after a step of the wall clock: at = %v; want Redis's %v", got, redis.Add(time.Second))
	}
	// A reply read 1 ms later than the first's (its latency) is within
	// the jitter: kept as it was.
	c.observe(redis.UnixMicro(), now.Add(time.Millisecond))
	if got := c.at(later); got.Sub(redis.Add(time.Second)).Abs() > time.Microsecond {
		t.Errorf("after a reply 1 ms slower: at = %v; want %v unchanged", got, redis.Add(time.Second))
	}
	// Redis's clock a minute later than it was (another node after a
	// failover): replaced.
	c.observe(redis.Add(time.Minute).UnixMicro(), now)
	if got := c.at(later); got.Sub(redis.Add(time.Minute+time.Second)).Abs() > time.Microsecond {
		t.Errorf("after Redis's clock moved a minute: at = %v; want %v", got, redis.Add(time.Minute+time.Second))
	}
}
