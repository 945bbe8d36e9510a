package redispath

import (
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
)

// wakes records when the lane's watchdog woke each call, and each call's
// delivery.
type wakes struct {
	mu        sync.Mutex
	at        map[*pending][]time.Time
	delivered chan *pending
}

// watched is the finisher of one call that wakes records.
type watched struct {
	w *wakes
	p *pending
}

func (c watched) finished(p *pending) { c.w.delivered <- p }
func (c watched) gaveUp() bool        { return false }
func (c watched) checkPoint() {
	c.w.mu.Lock()
	c.w.at[c.p] = append(c.w.at[c.p], time.Now())
	c.w.mu.Unlock()
}

// woken returns when the watchdog woke p.
func (w *wakes) woken(p *pending) []time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]time.Time(nil), w.at[p]...)
}

// submit queues a call of one token on key whose first check point comes
// in checkIn (none if 0).
func (w *wakes) submit(ln *lane, auth *authority.Redis, l policy.Limit, key string, checkIn time.Duration) *pending {
	p := &pending{a: &authority.Acquisition{Key: auth.Key(l, key), Limit: l, Want: 1, Min: 1, Share: 1}, deadline: time.Now().Add(5 * time.Second)}
	if checkIn > 0 {
		p.checkAt = time.Now().Add(checkIn)
	}
	p.finish = watched{w: w, p: p}
	ln.submit(p, time.Now())
	return p
}

// TestWatchdogWakesEachCallOnceAtItsCheckPoint: with the lane's one
// pipeline busy, the lane's watchdog wakes each queued call once, no
// sooner than its check point, and never a call without one; a call
// delivered before its check point is never woken; a stopped lane's
// watchdog is disarmed.
func TestWatchdogWakesEachCallOnceAtItsCheckPoint(t *testing.T) {
	ln, auth, h := newTestLane(t, 1)
	l := policy.PerSecond(10)
	first := sendFirst(t, ln, auth, l)
	w := &wakes{at: map[*pending][]time.Time{}, delivered: make(chan *pending, 8)}
	// Queued in the order of their check points, as calls are.
	sooner := w.submit(ln, auth, l, "sooner", 20*time.Millisecond)
	never := w.submit(ln, auth, l, "never", 0)
	later := w.submit(ln, auth, l, "later", 250*time.Millisecond)
	waitLane(t, ln, "the watchdog never woke both queued calls", func(ln *lane) bool { return later.alarmed && sooner.alarmed })
	// Past both check points, and then some: still once each.
	time.Sleep(30 * time.Millisecond)
	for _, p := range []*pending{sooner, later} {
		woken := w.woken(p)
		if len(woken) != 1 {
			t.Fatalf("woken %d times, want once", len(woken))
		}
		if woken[0].Before(p.checkAt) {
			t.Errorf("woken %v before its check point", p.checkAt.Sub(woken[0]))
		}
	}
	if woken := w.woken(sooner); !woken[0].Before(later.checkAt) {
		t.Errorf("the sooner call was woken at the later one's check point")
	}
	if got := w.woken(never); len(got) != 0 {
		t.Errorf("a call without a check point was woken %d times", len(got))
	}

	close(h.release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range 3 {
		<-w.delivered
	}
	// Answered long before its check point: the watchdog, armed for it,
	// finds it gone.
	quick := w.submit(ln, auth, l, "quick", 40*time.Millisecond)
	<-w.delivered
	waitLane(t, ln, "the watchdog stayed armed with no call left to watch", func(ln *lane) bool { return ln.dog.at.IsZero() })
	if got := w.woken(quick); len(got) != 0 || quick.alarmed {
		t.Errorf("a call answered before its check point was woken %d times", len(got))
	}

	ln.stop()
	ln.mu.Lock()
	defer ln.mu.Unlock()
	if !ln.dog.stopped || ln.dog.timer.Stop() {
		t.Error("a stopped lane's watchdog was still armed")
	}
}

// TestWatchdogSweepsALongQueue: behind a busy pipeline, each of many
// queued calls is woken once, no sooner than its check point; the sweep
// then stands past them all, and the batch that takes them resets it.
func TestWatchdogSweepsALongQueue(t *testing.T) {
	ln, auth, h := newTestLane(t, 1)
	l := policy.PerSecond(1000)
	first := sendFirst(t, ln, auth, l)
	const calls = 300
	w := &wakes{at: map[*pending][]time.Time{}, delivered: make(chan *pending, calls)}
	ps := make([]*pending, calls)
	for i := range ps {
		ps[i] = w.submit(ln, auth, l, "k"+strconv.Itoa(i), 5*time.Millisecond+time.Duration(i)*50*time.Microsecond)
	}
	waitLane(t, ln, "the watchdog never woke every queued call", func(ln *lane) bool { return ln.swept == calls })
	for i, p := range ps {
		woken := w.woken(p)
		if len(woken) != 1 || !p.alarmed {
			t.Fatalf("call %d: woken %d times, want once", i, len(woken))
		}
		if woken[0].Before(p.checkAt) {
			t.Fatalf("call %d: woken %v before its check point", i, p.checkAt.Sub(woken[0]))
		}
	}
	close(h.release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range calls {
		<-w.delivered
	}
	ln.mu.Lock()
	swept, queued := ln.swept, len(ln.queue)
	ln.mu.Unlock()
	if swept != 0 || queued != 0 {
		t.Errorf("after the queue was sent: swept %d of %d queued; want 0 of 0", swept, queued)
	}
	ln.stop()
}
