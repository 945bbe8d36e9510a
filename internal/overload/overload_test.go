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
	defer saturate()()
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

// TestProbeCannotRun: a probe that cannot be spawned runs on the caller's
// goroutine, done when Start returns: on an idle process it finds no
// delay, and with the processors kept busy by more goroutines than there
// are processors, it finds the process behind.
func TestProbeCannotRun(t *testing.T) {
	refuse := func(func()) bool { return false }
	p := Start(refuse)
	select {
	case <-p.Done():
	default:
		t.Fatal("Done not closed when Start returned, for a probe that could not be spawned")
	}
	if p.Behind(time.Second) {
		t.Errorf("a probe run in place on an idle process took %v", time.Duration(p.took.Load()))
	}
	defer saturate()()
	behind := false
	for range 20 {
		if p := Start(refuse); p.Behind(time.Millisecond) {
			behind = true
			break
		}
	}
	if !behind {
		t.Error("a probe run in place never found a saturated process behind by 1ms in 20 tries")
	}
}

// saturate holds both of two processors with 64 goroutines that never
// block, and returns what stops them.
func saturate() (stop func()) {
	old := runtime.GOMAXPROCS(2)
	var done atomic.Bool
	var busy sync.WaitGroup
	for range 64 {
		busy.Add(1)
		go func() {
			defer busy.Done()
			for !done.Load() {
			}
		}()
	}
	time.Sleep(50 * time.Millisecond) // let them take the processors
	return func() {
		done.Store(true)
		busy.Wait()
		runtime.GOMAXPROCS(old)
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
