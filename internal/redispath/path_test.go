package redispath

import (
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
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
		p := New(Config{Client: c, Auth: auth, Budget: budget, Name: "variant", Breaker: breaker.Settings{}})
		if p.bounded != tc.bounded {
			t.Errorf("ContextTimeoutEnabled %v: bounded %v; want %v", tc.opts.ContextTimeoutEnabled, p.bounded, tc.bounded)
		}
		p.Close()
		p.Wait()
	}
}
