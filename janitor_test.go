package leaselimit

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"

	"github.com/leaselimit/leaselimit/policy"
)

// TestJanitorRound: one round of the janitor (sweep, then flush) takes back
// a lease that has expired and gives its tokens back to the bucket in Redis,
// leaving nothing queued.
func TestJanitorRound(t *testing.T) {
	m, c := newMini(t, nil)
	l, err := New(c, policy.PerHour(1000))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx := t.Context()
	rkey := l.auth.Key(l.limit, "k")
	// A lease of 5 tokens for k, debited from its bucket (1000 → 995).
	now := l.clock.now()
	l.leases.Decide("k", 1, now) // a first sight: exact, and no entry yet
	a := l.leases.Decide("k", 1, now)
	l.leases.Join(a.Ticket)
	r := l.leases.Plan(a.Ticket, now)
	g, err := l.auth.Acquire(ctx, rkey, l.limit, 5, 5, 1)
	if err != nil || g.Granted != 5 {
		t.Fatalf("Acquire(5) = %+v, %v", g, err)
	}
	l.leases.Complete(r, g, now)
	if got := bucketTokens(t, m, rkey); got != 995 {
		t.Fatalf("bucket holds %d; want 995", got)
	}

	j := l.janitor
	j.table.Sweep(now+int64(2*policy.DefaultLease().TTL), j.refunds.addReturns)
	j.refunds.flush()
	if got := len(l.refunds.take()); got != 0 {
		t.Errorf("%d refunds still queued after the round", got)
	}
	// 995 + 5 is a full bucket, which the refund script deletes.
	if m.Exists(rkey) {
		t.Errorf("bucket holds %d after the round; want the 5 leased tokens back (a full bucket, deleted)", bucketTokens(t, m, rkey))
	}
}

// bucketTokens reads the whole tokens of the bucket at rkey (the first
// field of its value).
func bucketTokens(t *testing.T, m *miniredis.Miniredis, rkey string) int64 {
	t.Helper()
	v, err := m.Get(rkey)
	if err != nil {
		t.Fatalf("bucket %s: %v", rkey, err)
	}
	w, err := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
	if err != nil {
		t.Fatalf("bucket %s = %q: %v", rkey, v, err)
	}
	return w
}

// TestJanitorHaltWinsOverATick: once halt was called, the janitor starts
// no other round, though a tick (or a breaker closing) is due as well. A
// round can last as long as a hung Redis holds its refunds. Regression:
// select picked the tick half the time, so Close on a silent Redis waited
// for round after round (25s with go-redis's 5s read timeout).
func TestJanitorHaltWinsOverATick(t *testing.T) {
	closed := make(chan struct{})
	close(closed)
	j := &janitor{stop: make(chan struct{}), closed: closed}
	tick := make(chan time.Time, 1)
	tick <- time.Time{}
	if !j.next(tick) {
		t.Fatal("next = false before halt; want a round")
	}
	close(j.stop)
	for i := range 1000 {
		select {
		case tick <- time.Time{}:
		default:
		}
		if j.next(tick) {
			t.Fatalf("next = true after halt, try %d, with a tick and a closed breaker due; want false", i+1)
		}
	}
}
