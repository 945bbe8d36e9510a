package overload

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func spawn(wg *sync.WaitGroup) func(func()) bool {
	return func(f func()) bool {
		wg.Add(1)
		go func() { defer wg.Done(); f() }()
		return true
	}
}

// probes runs n probes against the default budget's threshold, one after
// another, and returns how many found the process behind.
func probes(n int) (behind int) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for range n {
		if Measure(spawn(&wg), Threshold(100*time.Millisecond)) {
			behind++
		}
	}
	return behind
}

// TestProbeIdle: on a process with nothing else to run, a probe comes back
// far within an eighth of the default budget.
func TestProbeIdle(t *testing.T) {
	behind := probes(20)
	// A noisy machine may delay one probe or two; not most of them.
	if behind > 5 {
		t.Errorf("%d of 20 probes found an idle process behind", behind)
	}
}

// TestProbeSaturated: with goroutines that never block holding both
// processors, a ready goroutine waits many scheduler slices: behind.
func TestProbeSaturated(t *testing.T) {
	old := runtime.GOMAXPROCS(2)
	defer runtime.GOMAXPROCS(old)
	var stop atomic.Bool
	var busy sync.WaitGroup
	for range 64 {
		busy.Add(1)
		go func() {
			defer busy.Done()
			for !stop.Load() {
			}
		}()
	}
	defer func() { stop.Store(true); busy.Wait() }()
	time.Sleep(50 * time.Millisecond) // let them take the processors
	start := time.Now()
	behind := probes(5)
	if behind == 0 {
		t.Errorf("no probe found the process behind with 64 goroutines spinning on 2 processors")
	}
	// Within the time since the probes began (this goroutine, too, may
	// wait long for its turn on a saturated process).
	if !Recent(time.Now(), time.Since(start)+time.Second) {
		t.Errorf("Recent = false after a probe found the process behind")
	}
}

// TestProbeCannotRun: a probe that cannot be spawned reports no delay.
func TestProbeCannotRun(t *testing.T) {
	p := Start(func(func()) bool { return false })
	select {
	case <-p.Done():
	default:
		t.Fatal("Done not closed for a probe that could not run")
	}
	if p.Behind(time.Millisecond) {
		t.Error("a probe that could not run says behind")
	}
}

// TestYieldOnlyWhileHeld: Yield gives up the processor only between Hold
// and Release; the count is balanced.
func TestYieldOnlyWhileHeld(t *testing.T) {
	if overdue.Load() != 0 {
		t.Fatalf("overdue = %d at start", overdue.Load())
	}
	Hold()
	Hold()
	Release()
	if overdue.Load() != 1 {
		t.Errorf("overdue = %d after Hold, Hold, Release", overdue.Load())
	}
	Yield() // must return
	Release()
	if overdue.Load() != 0 {
		t.Errorf("overdue = %d after balanced Holds", overdue.Load())
	}
	if n := testing.AllocsPerRun(100, Yield); n != 0 {
		t.Errorf("Yield allocates %v times", n)
	}
}
