package deadline

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestEnded(t *testing.T) {
	if err := Ended(context.Background()); err != nil {
		t.Errorf("Ended(Background) = %v", err)
	}
	live, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	if err := Ended(live); err != nil {
		t.Errorf("Ended(an hour to go) = %v", err)
	}
	cancelled, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if err := Ended(cancelled); !errors.Is(err, context.Canceled) {
		t.Errorf("Ended(cancelled) = %v; want context.Canceled", err)
	}
	// A deadline in the past, its timer not run: WithDeadline ends such a
	// context at once, so a context of our own stands for one whose timer
	// has not run yet.
	if err := Ended(pastDeadline{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Ended(deadline passed, Err nil) = %v; want context.DeadlineExceeded", err)
	}
}

// pastDeadline is a context whose deadline has passed and whose Err is
// still nil, as a context's is until its timer runs.
type pastDeadline struct{ context.Context }

func (pastDeadline) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }
func (pastDeadline) Err() error                  { return nil }
func (pastDeadline) Done() <-chan struct{}       { return nil }
func (pastDeadline) Value(any) any               { return nil }
