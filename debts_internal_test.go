package leaselimit

import (
	"strconv"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/authority"
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

// TestChargedDenial: a denial is given as the buckets will stand once the
// debts of this instance are charged: the denying bucket's debt adds its
// refill time exactly, up to one Burst into debt; another bucket of
// several waits as its whole tokens say, never longer than the charge
// makes it; a grant, a bucket without debt and a quota's are unchanged.
func TestChargedDenial(t *testing.T) {
	_, c := newMini(t, nil)
	second := policy.Limit{Name: "charged-a", Rate: 1, Period: time.Second, Burst: 10}
	tenth := policy.Limit{Name: "charged-b", Rate: 10, Period: time.Second, Burst: 100}
	quota := policy.Quota("charged-q", 100, policy.Day, time.UTC)
	l, err := New(c, second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	l.janitor.halt() // the debts stay in the book
	l.janitor = &janitor{stop: make(chan struct{}), done: make(chan struct{})}
	close(l.janitor.done)
	ms := []*member{l.engine.newMember(second), l.engine.newMember(tenth), l.engine.newMember(quota)}
	wall := time.Now()
	b := l.debts
	single := authority.Grant{Remaining: 0, RetryAfter: 300 * time.Millisecond, ResetAfter: 9300 * time.Millisecond}
	if got := b.charged(ms[:1], "k", 1, single); got != single {
		t.Errorf("no debt: charged = %+v; want %+v unchanged", got, single)
	}
	b.owe(ms[0].namer, "k", second, 4, wall)
	if got := b.charged(ms[:1], "k", 1, single); got.RetryAfter != 4300*time.Millisecond || got.ResetAfter != 13300*time.Millisecond {
		t.Errorf("4 owed at 1/s: charged = %+v; want RetryAfter 4.3s, ResetAfter 13.3s", got)
	}
	if g := (authority.Grant{Granted: 1, Remaining: 3}); b.charged(ms[:1], "k", 1, g) != g {
		t.Errorf("a grant was changed: %+v", b.charged(ms[:1], "k", 1, g))
	}
	if got := b.charged(ms[:1], "other", 1, single); got != single {
		t.Errorf("another key's debt counted: %+v", got)
	}
	b.owe(ms[0].namer, "k", second, 100, wall) // the book holds 2 Bursts; the charge leaves one Burst in debt
	if got := b.charged(ms[:1], "k", 1, single); got.RetryAfter != 10300*time.Millisecond || got.ResetAfter != 19300*time.Millisecond {
		t.Errorf("20 owed, Burst 10: charged = %+v; want RetryAfter 10.3s, ResetAfter 19.3s (one Burst into debt)", got)
	}
	// In debt already (7.3 s until one token: 6.3 tokens owed, 7 whole):
	// the charge counts for 3 tokens, to the floor.
	indebted := authority.Grant{Remaining: 0, RetryAfter: 7300 * time.Millisecond}
	if got := b.charged(ms[:1], "k", 1, indebted); got.RetryAfter != 10300*time.Millisecond {
		t.Errorf("20 owed by a bucket 7 in debt, Burst 10: charged = %+v; want RetryAfter 10.3s", got)
	}

	// Several: the first bucket denied, owing nothing for this key; the
	// second, 5 tokens held and 8 owed, will need 4 refills for 1 token,
	// counted as 3 (0.3 s): a fraction of one may be there already, and a
	// wait is never made longer than the charge makes it.
	b.owe(ms[1].namer, "m", tenth, 8, wall)
	b.owe(ms[2].namer, "m", quota, 50, wall)
	multi := authority.Grant{Remaining: 0, RetryAfter: 100 * time.Millisecond,
		Multi: &authority.Multi{Denied: 0, Parts: []authority.Part{{Remaining: 0}, {Remaining: 5}, {Remaining: 60}}}}

	// The denying bucket second, the first short after its charge: the
	// longer wait of the two, not their sum (7 s: 3 held, 10 owed).
	perMinute := policy.Limit{Name: "charged-c", Rate: 60, Period: time.Minute, Burst: 10} // a token a second too
	two := []*member{ms[0], l.engine.newMember(perMinute)}
	b.owe(two[0].namer, "n", second, 10, wall)
	b.owe(two[1].namer, "n", perMinute, 2, wall)
	late := authority.Grant{RetryAfter: 500 * time.Millisecond,
		Multi: &authority.Multi{Denied: 1, Parts: []authority.Part{{Remaining: 3}, {Remaining: 0}}}}
	if got := b.charged(two, "n", 1, late); got.RetryAfter != 7*time.Second {
		t.Errorf("first bucket 7 short, the denying one 2.5 s: RetryAfter %v; want 7s", got.RetryAfter)
	}

	// need > 1: 1 held, 2 s until 3; 4 owed leave -3, 6 s until 3.
	b.owe(ms[0].namer, "three", second, 4, wall)
	if got := b.charged(ms[:1], "three", 3, authority.Grant{Remaining: 1, RetryAfter: 2 * time.Second}); got.RetryAfter != 6*time.Second {
		t.Errorf("need 3, 1 held, 4 owed: RetryAfter %v; want 6s", got.RetryAfter)
	}

	// A token every 3.33 µs, 200,000 in debt and 200,000 owed: the floor
	// (-300,000) counts 100,000 of them; 300,001 tokens' time, to a µs.
	fast := policy.Limit{Name: "charged-fast", Rate: 300_000, Period: time.Second, Burst: 300_000}
	fm := l.engine.newMember(fast)
	b.owe(fm.namer, "f", fast, 200_000, wall)
	got := b.charged([]*member{fm}, "f", 1, authority.Grant{RetryAfter: 666_670 * time.Microsecond})
	if want := 1_000_003 * time.Microsecond; got.RetryAfter < want-2*time.Microsecond || got.RetryAfter > want+2*time.Microsecond {
		t.Errorf("200,000 owed by a fast bucket 200,000 in debt: RetryAfter %v; want about %v", got.RetryAfter, want)
	}

	got = b.charged(ms, "m", 1, multi)
	if got.RetryAfter != 300*time.Millisecond {
		t.Errorf("second bucket short 3 tokens after its charge: RetryAfter %v; want 300ms", got.RetryAfter)
	}
	if got.Multi.Parts[1].Remaining != 0 || got.Multi.Parts[2].Remaining != 60 || multi.Multi.Parts[1].Remaining != 5 {
		t.Errorf("parts after the charge %+v (given %+v); want the second at 0, the quota's unchanged, the given grant untouched",
			got.Multi.Parts, multi.Multi.Parts)
	}
}
