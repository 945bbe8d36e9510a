package main

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/benchmarks/internal/design"
)

// keyLog is a decider that records the keys it is asked about and fails
// once it has answered max calls in a slice, which ends the slice.
type keyLog struct {
	max, calls int
	seen       map[string]int // key -> calls on it
}

var errSliceOver = errors.New("slice over")

func (d *keyLog) Allow(_ context.Context, key string) (design.Result, error) {
	if d.calls == d.max {
		return design.Result{}, errSliceOver
	}
	d.calls++
	d.seen[key]++
	return design.Result{Allowed: true}, nil
}

func (d *keyLog) Close() error { return nil }

// TestColdWalkGoesOn: with a walk, each goroutine's second slice goes on
// to keys its first did not use; without one, a lone goroutine walks them
// again (the long tail's keys came back every round). With several, the
// first to reach its decider's last call ends the slice, so the others
// may make none.
func TestColdWalkGoesOn(t *testing.T) {
	const n, perSlice = 1000, 200
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "k" + strconv.Itoa(i)
	}
	for _, tc := range []struct {
		goroutines int
		carried    bool
	}{{1, true}, {3, true}, {1, false}} {
		goroutines, carried := tc.goroutines, tc.carried
		cfg := config{goroutines: goroutines}
		decs := make([]design.Decider, goroutines)
		logs := make([]*keyLog, goroutines)
		for i := range decs {
			logs[i] = &keyLog{max: perSlice, seen: map[string]int{}}
			decs[i] = logs[i]
		}
		var walk []int
		if carried {
			walk = walkStarts(goroutines, n)
		}
		for range 2 {
			for _, l := range logs {
				l.calls = 0
			}
			if _, err := drive(context.Background(), cfg, workload{}, decs, keys, walk, time.Minute, false); !errors.Is(err, errSliceOver) {
				t.Fatalf("carried %v: drive: %v, want the slice's end", carried, err)
			}
		}
		for id, l := range logs {
			again := 0
			for _, c := range l.seen {
				again += c - 1
			}
			if carried && again != 0 {
				t.Errorf("%d goroutines, goroutine %d: %d calls on a key it had used, with the walk carried", goroutines, id, again)
			}
			if !carried && again != perSlice {
				t.Errorf("goroutine %d: %d calls on a key it had used without the walk, want %d: the test shows nothing", id, again, perSlice)
			}
		}
	}
}
