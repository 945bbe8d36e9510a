package leaselimit

import (
	"strconv"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// TestDebtsPerRound: a janitor round hands at most debtsPerRound debts to
// the refund queue, so that an outage over many keys is not charged in one
// pipeline as Redis comes back; Close hands every one.
func TestDebtsPerRound(t *testing.T) {
	_, c := newMini(t, nil)
	l, err := New(c, policy.Limit{Name: "rounds", Rate: 1, Period: time.Hour, Burst: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	l.janitor.halt() // this test runs the rounds
	l.janitor = &janitor{stop: make(chan struct{}), done: make(chan struct{})}
	close(l.janitor.done)
	const keys = debtsPerRound*2 + 500
	for i := range keys {
		l.owe("k"+strconv.Itoa(i), 1, time.Now())
	}
	queued := func() int {
		l.refunds.mu.Lock()
		defer l.refunds.mu.Unlock()
		return len(l.refunds.queue)
	}
	l.debts.move(l.refunds, l.path, false)
	if got := queued(); got != debtsPerRound {
		t.Fatalf("one round queued %d charges; want %d", got, debtsPerRound)
	}
	l.debts.move(l.refunds, l.path, true)
	if got := queued(); got != keys {
		t.Errorf("after the round of Close, %d charges queued; want all %d", got, keys)
	}
}
