package leaselimit

import (
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
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
