package redispath

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// newMini starts a miniredis for the test and a client on it, both closed
// when the test ends; opts, if set, are the client's options (its Addr is
// filled in).
func newMini(t *testing.T, opts *redis.Options) (*miniredis.Miniredis, *redis.Client) {
	t.Helper()
	m := miniredis.RunT(t)
	if opts == nil {
		opts = &redis.Options{}
	}
	opts.Addr = m.Addr()
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	return m, c
}

// authAndTel returns the authority of c and a recorder for limit name,
// for a path under test.
func authAndTel(t *testing.T, c redis.UniversalClient, name string) (*authority.Redis, *recorder.Recorder) {
	t.Helper()
	auth, err := authority.New(c, "leaselimit")
	if err != nil {
		t.Fatal(err)
	}
	tel, err := recorder.New(recorder.Config{LimitName: name})
	if err != nil {
		t.Fatal(err)
	}
	return auth, tel
}

// TestVariant: calls run in place on the caller's goroutine (acquire calls
// when their lane is idle) when the client honours deadlines
// (ContextTimeoutEnabled), and are carried by the path's goroutines
// otherwise, chosen once at New.
func TestVariant(t *testing.T) {
	const budget = 100 * time.Millisecond
	for _, tc := range []struct {
		opts    *redis.Options
		bounded bool
	}{
		{&redis.Options{}, false},
		{&redis.Options{ContextTimeoutEnabled: true}, true},
	} {
		_, c := newMini(t, tc.opts)
		auth, err := authority.New(c, "leaselimit")
		if err != nil {
			t.Fatal(err)
		}
		p := New(Config{Client: c, Auth: auth, Budget: budget, Name: "variant", Breaker: circuit.Settings{}})
		if p.bounded != tc.bounded {
			t.Errorf("ContextTimeoutEnabled %v: bounded %v; want %v", tc.opts.ContextTimeoutEnabled, p.bounded, tc.bounded)
		}
		p.Close()
		p.Wait()
	}
}

// nopReceiver ignores what the path hands back.
type nopReceiver struct{}

func (nopReceiver) Arrived(Call, authority.Grant)   {}
func (nopReceiver) Unclaimed(Call, authority.Grant) {}
func (nopReceiver) Saturated()                      {}

// TestIdleCallsInPlace: one caller after another, each finding its lane
// idle, makes its call in place when the client honours deadlines (the
// lane starts no sender) and through the lane's senders when it does not;
// both get their grants.
func TestIdleCallsInPlace(t *testing.T) {
	for _, tc := range []struct {
		opts    *redis.Options
		senders bool
	}{
		{&redis.Options{ContextTimeoutEnabled: true}, false},
		{&redis.Options{}, true},
	} {
		_, c := newMini(t, tc.opts)
		auth, tel := authAndTel(t, c, "idle")
		p := New(Config{Client: c, Auth: auth, Budget: time.Second, Name: "idle", Breaker: circuit.Settings{}, Tel: tel})
		k := p.Caller(tel, nopReceiver{})
		l := policy.PerSecond(100)
		for i := range 20 {
			a := authority.Acquisition{Key: auth.Key(l, "k"+strconv.Itoa(i)), Limit: l, Want: 1, Min: 1, Share: 1}
			if g, err := k.Acquire(context.Background(), &Call{Brk: p.Shared(), Acq: a}); err != nil || g.Granted != 1 {
				t.Fatalf("ContextTimeoutEnabled %v: call %d: %+v, %v; want 1 token", tc.opts.ContextTimeoutEnabled, i, g, err)
			}
		}
		ln := p.nodes.laneFor(p.Shared())
		ln.mu.Lock()
		started := ln.senders.started
		ln.mu.Unlock()
		if (started > 0) != tc.senders {
			t.Errorf("ContextTimeoutEnabled %v: %d senders started by 20 calls one after another; want senders %v",
				tc.opts.ContextTimeoutEnabled, started, tc.senders)
		}
		p.Close()
		p.Wait()
	}
}

// newProxiedPath returns a path under test to a miniredis behind the
// proxy it returns, on a client with the options opts (its Addr filled
// in), with the budget and a breaker that one failure opens for openFor,
// and call, which acquires a token of key through it; all of it closed
// when the test ends.
func newProxiedPath(t *testing.T, opts *redis.Options, budget, openFor time.Duration) (px *redistest.Proxy, p *Path, call func(key string) error) {
	t.Helper()
	m := miniredis.RunT(t)
	px = redistest.NewProxy(t, m.Addr())
	opts.Addr = px.Addr
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	auth, tel := authAndTel(t, c, "proxied")
	p = New(Config{Client: c, Auth: auth, Budget: budget, Name: "proxied", Tel: tel, Unavailable: errors.New("unavailable"),
		Breaker: circuit.Settings{Settings: breaker.Settings{Failures: 1, OpenFor: openFor}}})
	t.Cleanup(func() { p.Close(); p.Wait() })
	k := p.Caller(tel, nopReceiver{})
	l := policy.PerSecond(100)
	call = func(key string) error {
		a := authority.Acquisition{Key: auth.Key(l, key), Limit: l, Want: 1, Min: 1, Share: 1}
		_, err := k.Acquire(context.Background(), &Call{Brk: p.Shared(), Acq: a})
		return err
	}
	return px, p, call
}
