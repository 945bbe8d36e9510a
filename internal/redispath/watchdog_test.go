package redispath

import (
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
	ln.submit(p)
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
	later := w.submit(ln, auth, l, "later", 60*time.Millisecond)
	sooner := w.submit(ln, auth, l, "sooner", 20*time.Millisecond)
	never := w.submit(ln, auth, l, "never", 0)
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
