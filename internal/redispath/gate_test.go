package redispath

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestGate: spawn and enter are refused once close has begun; wait waits
// for what was admitted before.
func TestGate(t *testing.T) {
	g := new(gate)
	release := make(chan struct{})
	finished := make(chan struct{})
	if !g.spawn(func() { <-release; close(finished) }) {
		t.Fatal("spawn refused on an open gate")
	}
	if !g.close() || g.close() {
		t.Fatal("close: want true the first time, false after")
	}
	if !g.isClosed() || g.enter() || g.spawn(func() { t.Error("ran after close") }) {
		t.Fatal("a closed gate admitted a call")
	}
	waited := make(chan struct{})
	go func() { g.wait(); close(waited) }()
	select {
	case <-waited:
		t.Fatal("wait returned while a goroutine admitted before close still ran")
	case <-time.After(20 * time.Millisecond):
	}
	close(release)
	<-waited
	select {
	case <-finished:
	default:
		t.Fatal("wait returned before the goroutine finished")
	}
}

// TestGateRace: calls entering and leaving from many goroutines while the
// gate closes: wait returns once every admitted call has left (none is
// still inside), every call after close is refused, and the calls that
// raced close, whose add is taken back, do not end the wait twice.
func TestGateRace(t *testing.T) {
	for range 20 {
		g := new(gate)
		var inside atomic.Int64
		var stop atomic.Bool
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for !stop.Load() {
					if g.enter() {
						inside.Add(1)
						inside.Add(-1)
						g.leave()
					}
				}
			})
		}
		time.Sleep(time.Millisecond)
		if !g.close() {
			t.Fatal("close refused on an open gate")
		}
		g.wait()
		if n := inside.Load(); n != 0 {
			t.Fatalf("wait returned with %d calls inside", n)
		}
		if g.enter() {
			t.Fatal("enter admitted after close")
		}
		stop.Store(true)
		wg.Wait()
		g.wait() // refused enters after the drain: still drained, no second close
	}
}

// TestGateCloseIdle: a gate closed with nothing in flight is drained at once.
func TestGateCloseIdle(t *testing.T) {
	g := new(gate)
	if !g.enter() {
		t.Fatal("enter refused on an open gate")
	}
	g.leave()
	g.close()
	g.wait()
	if g.enter() || g.spawn(func() {}) {
		t.Fatal("a closed gate admitted a call")
	}
	g.wait()
	select {
	case <-g.done():
	default:
		t.Fatal("done not closed after close")
	}
}
