package redispath

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/monotime"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// TestLearnAsksOnlyWhileItMay: a cut call's recovery (learn) sends its
// invocation again only while the resend key surely holds the first
// sending's reply, while the breaker lets calls through, and, once Close
// has begun, within a budget of Close or of its queueing; otherwise it
// gives up without sending (the outcome counted unknown by its caller).
// A resend after the key's life would take the call's tokens a second
// time; attempts while Redis is known down, or queued long after Close,
// only hold Close.
func TestLearnAsksOnlyWhileItMay(t *testing.T) {
	const budget = 50 * time.Millisecond
	_, c := newMini(t, &redis.Options{})
	auth, tel := authAndTel(t, c, "learn")
	p := New(Config{Client: c, Auth: auth, Budget: budget, Name: "learn", Unavailable: errors.New("unavailable"), Tel: tel,
		Breaker: circuit.Settings{Settings: breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}}})
	l := policy.Limit{Name: "learn", Rate: 1, Period: time.Hour, Burst: 10}
	ctx := context.Background()
	cut := errors.New("cut") // stands for the lost reply's error
	sentAlone := func(key string) *authority.Acquisition {
		t.Helper()
		a := &authority.Acquisition{Key: auth.Key(l, key), Limit: l, Want: 2, Min: 2, Share: 1}
		auth.AcquireAll(ctx, []*authority.Acquisition{a})
		if a.Err != nil || a.Grant.Granted != 2 {
			t.Fatalf("first sending: %+v, %v", a.Grant, a.Err)
		}
		a.Grant, a.Err = authority.Grant{}, cut
		return a
	}
	brk := p.Shared()
	life := auth.ResendLife()

	a := sentAlone("in-time")
	if !p.learn([]*authority.Acquisition{a}, brk, time.Now(), time.Now()) || a.Err != nil || a.Grant.Granted != 2 {
		t.Fatalf("learn within the key's life: %+v, %v; want the first's grant of 2", a.Grant, a.Err)
	}
	a = sentAlone("too-late")
	if p.learn([]*authority.Acquisition{a}, brk, time.Now().Add(-life/2), time.Now()) || a.Err != cut {
		t.Fatalf("learn half the key's life after the send: %+v, %v; want no attempt", a.Grant, a.Err)
	}
	// The breaker open: no attempt, and learn gives up as the window ends.
	done, err := brk.Allow()
	if err != nil {
		t.Fatal(err)
	}
	done(circuit.ErrBudget)
	if brk.State() != breaker.Open {
		t.Fatalf("breaker %v after a failure; want open", brk.State())
	}
	a = sentAlone("breaker-open")
	if p.learn([]*authority.Acquisition{a}, brk, time.Now().Add(-life/2+4*budget), time.Now()) || a.Err != cut {
		t.Fatalf("learn while the breaker is open: %+v, %v; want no attempt", a.Grant, a.Err)
	}
	// Close begun: a recovery queued well before it, starting a budget
	// and more after it, makes no attempt; one queued now makes one.
	shared := New(Config{Client: c, Auth: auth, Budget: budget, Name: "learn-close", Unavailable: errors.New("unavailable"), Tel: tel})
	shared.Close()
	shared.closedAt.Store(monotime.Of(time.Now().Add(-2 * budget))) // as if Close began two budgets ago
	a = sentAlone("after-close")
	if shared.learn([]*authority.Acquisition{a}, shared.Shared(), time.Now(), time.Now().Add(-3*budget)) || a.Err != cut {
		t.Fatalf("learn begun two budgets after Close, queued before it: %+v, %v; want no attempt", a.Grant, a.Err)
	}
	a = sentAlone("queued-at-close")
	if !shared.learn([]*authority.Acquisition{a}, shared.Shared(), time.Now(), time.Now()) || a.Grant.Granted != 2 {
		t.Fatalf("learn queued now, after Close: %+v, %v; want one attempt, the first's grant", a.Grant, a.Err)
	}
	shared.Wait()
	p.Close()
	p.Wait()
}
