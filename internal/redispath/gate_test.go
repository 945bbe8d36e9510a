package redispath

import (
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
