package leaselimit

import (
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/policy"
)

// TestAuthorizerVariant: the budgeted call runs in place on the caller's
// context when the client honours deadlines (ContextTimeoutEnabled), in a
// detached goroutine otherwise, chosen once at New.
func TestAuthorizerVariant(t *testing.T) {
	m := miniredis.RunT(t)
	for _, tc := range []struct {
		opts *redis.Options
		want string
	}{
		{&redis.Options{Addr: m.Addr()}, "detached"},
		{&redis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true}, "direct"},
	} {
		c := redis.NewClient(tc.opts)
		l, err := New(c, policy.PerSecond(10))
		if err != nil {
			t.Fatal(err)
		}
		got := "detached"
		if _, ok := l.calls.(direct); ok {
			got = "direct"
		}
		if got != tc.want {
			t.Errorf("ContextTimeoutEnabled %v: %s variant; want %s", tc.opts.ContextTimeoutEnabled, got, tc.want)
		}
		if err := l.Close(); err != nil {
			t.Error(err)
		}
		_ = c.Close()
	}
}
