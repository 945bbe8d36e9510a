package redispath

import (
	"runtime"

	"github.com/redis/go-redis/v9"
)

// honoursDeadlines reports whether client applies context deadlines to its
// network reads and writes (go-redis's ContextTimeoutEnabled option). Only
// then can a call be bounded by its context alone; otherwise a hung Redis
// holds a read for the client's ReadTimeout (3s by default), so the path's
// own goroutines make the calls and their callers wait at most the budget
// (see Path and lane).
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

// retriesCommands reports whether client may send a command more than once
// on its own (go-redis retries a command whose connection failed, and
// reports only the last attempt's error): then an error that says the last
// attempt never reached Redis says nothing of the earlier ones. Only a
// single node's or Sentinel's client with MaxRetries off is known not to;
// a ClusterClient also retries on its own (MaxRedirects).
func retriesCommands(client redis.UniversalClient) bool {
	if c, ok := client.(*redis.Client); ok {
		return c.Options().MaxRetries > 0
	}
	return true
}
