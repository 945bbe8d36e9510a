package leaselimit

import (
	"runtime"

	"github.com/redis/go-redis/v9"
)

// honoursDeadlines reports whether client applies context deadlines to its
// network reads and writes (go-redis's ContextTimeoutEnabled option). Only
// then can a call be bounded by its context alone; otherwise a hung Redis
// holds a read for the client's ReadTimeout (3s by default) and the Limiter
// waits for each call in a separate goroutine instead (see newAuthorizer).
func honoursDeadlines(client redis.UniversalClient) bool {
	switch c := client.(type) {
	case *redis.Client:
		return c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		return c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		return c.Options().ContextTimeoutEnabled
	}
	return false
}

// poolSize is the client's connection pool size (one node's on a Cluster).
func poolSize(client redis.UniversalClient) int {
	pool := 0
	switch c := client.(type) {
	case *redis.Client:
		pool = c.Options().PoolSize
	case *redis.ClusterClient:
		pool = c.Options().PoolSize
	case *redis.Ring:
		pool = c.Options().PoolSize
	}
	if pool <= 0 {
		pool = 10 * runtime.GOMAXPROCS(0) // go-redis's default
	}
	return pool
}
