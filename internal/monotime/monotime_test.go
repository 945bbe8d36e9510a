package monotime

import (
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/internal/clockhook"
)

// TestOfIgnoresWallSteps: two readings of time.Now, one with its wall
// clock moved back an hour (as a step of the system clock moves it
// between readings, the monotonic reading going on), order as they were
// taken; UnixNano orders them the other way.
func TestOfIgnoresWallSteps(t *testing.T) {
	before := time.Now()
	// A reading taken after before, whose wall clock was stepped back an
	// hour meanwhile: time.Now's monotonic reading with the wall moved.
	after, ok := clockhook.StepWall(time.Now().Add(time.Millisecond), -time.Hour)
	if !ok {
		t.Fatal("clockhook.StepWall cannot make a stepped reading")
	}
	if after.UnixNano() >= before.UnixNano() {
		t.Fatalf("the stepped reading's wall clock is not before the first's: %v, %v", after, before)
	}
	if Of(after) <= Of(before) {
		t.Errorf("Of(after) = %d, not after Of(before) = %d: the wall clock's step moved it", Of(after), Of(before))
	}
	if got := Of(Time(Of(after))); got != Of(after) {
		t.Errorf("Of(Time(n)) = %d, want n = %d", got, Of(after))
	}
	if !time.Now().Before(Time(Now() + int64(time.Hour))) {
		t.Error("a time an hour after Now is not after time.Now()")
	}
}

// TestOfWithoutMonotonicReading: a test clock's readings (no monotonic
// part) order by their wall times.
func TestOfWithoutMonotonicReading(t *testing.T) {
	base := time.Now().Round(0) // Round(0) strips the monotonic reading
	later := base.Add(time.Second)
	if d := Of(later) - Of(base); d != int64(time.Second) {
		t.Errorf("Of(base+1s) - Of(base) = %v, want 1s", time.Duration(d))
	}
	if got := Time(Of(later)).Sub(later); got != 0 {
		t.Errorf("Time(Of(t)).Sub(t) = %v for a reading without a monotonic part, want 0", got)
	}
}
