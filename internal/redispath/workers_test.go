package redispath

import (
	"sync"
	"sync/atomic"
	"testing"
)

// TestWorkers: calls run on at most maxWorkers goroutines, each once, and
// stop waits for the queue to drain (goleak in TestMain sees the rest).
func TestWorkers(t *testing.T) {
	w := newWorkers()
	release := make(chan struct{})
	var running, most, ran atomic.Int64
	var wg sync.WaitGroup
	const calls = 50
	wg.Add(calls)
	for range calls {
		w.run(func() {
			defer wg.Done()
			n := running.Add(1)
			for {
				m := most.Load()
				if n <= m || most.CompareAndSwap(m, n) {
					break
				}
			}
			<-release
			running.Add(-1)
			ran.Add(1)
		})
	}
	close(release)
	wg.Wait()
	w.stop()
	if ran.Load() != calls {
		t.Errorf("%d calls ran; want %d", ran.Load(), calls)
	}
	if most.Load() > maxWorkers {
		t.Errorf("%d calls ran at once; want at most %d workers", most.Load(), maxWorkers)
	}
}
