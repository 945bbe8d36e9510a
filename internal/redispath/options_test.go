package redispath

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestHonoursDeadlines: a client carries its callers' deadlines to its
// reads only with ContextTimeoutEnabled and no timeout of -2 (go-redis
// then never sets a read or write deadline). Regression (a review): with
// ReadTimeout -2 calls ran in place, and a hung Redis held its callers
// until it came back.
func TestHonoursDeadlines(t *testing.T) {
	for _, c := range []struct {
		name          string
		ctx           bool
		read, write   time.Duration // as given to go-redis
		single, multi bool          // want, for a Client and a ClusterClient
	}{
		{"defaults", false, 0, 0, false, false},
		{"context", true, 0, 0, true, true},
		{"context, no read timeout (-1)", true, -1, 0, true, true},
		{"context, read deadlines off (-2)", true, -2, 0, false, false},
		{"context, write deadlines off (-2)", true, 0, -2, false, false},
	} {
		one := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: c.ctx, ReadTimeout: c.read, WriteTimeout: c.write})
		cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}, ContextTimeoutEnabled: c.ctx, ReadTimeout: c.read, WriteTimeout: c.write})
		if got := honoursDeadlines(one); got != c.single {
			t.Errorf("%s: Client: honoursDeadlines = %v; want %v", c.name, got, c.single)
		}
		if got := honoursDeadlines(cluster); got != c.multi {
			t.Errorf("%s: ClusterClient: honoursDeadlines = %v; want %v", c.name, got, c.multi)
		}
		_ = one.Close()
		_ = cluster.Close()
	}
}
