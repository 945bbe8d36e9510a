package redispath

import (
	"runtime"
	"time"

	"github.com/redis/go-redis/v9"
)

// honoursDeadlines reports whether client applies context deadlines to its
// network reads and writes (go-redis's ContextTimeoutEnabled option, with
// no read or write timeout of -2). Only
// then can a call be bounded by its context alone; otherwise a hung Redis
// holds a read for the client's ReadTimeout (5s by default), so the path's
// own goroutines make the calls and their callers wait at most the budget
// (see Path and lane).
func honoursDeadlines(client redis.UniversalClient) bool {
	switch c := client.(type) {
	case *redis.Client:
		o := c.Options()
		return appliesDeadlines(o.ContextTimeoutEnabled, o.ReadTimeout, o.WriteTimeout)
	case *redis.ClusterClient:
		o := c.Options()
		return appliesDeadlines(o.ContextTimeoutEnabled, o.ReadTimeout, o.WriteTimeout)
	case *redis.Ring:
		o := c.Options()
		return appliesDeadlines(o.ContextTimeoutEnabled, o.ReadTimeout, o.WriteTimeout)
	}
	return false
}

// clientTimeouts returns client's read and write timeouts once go-redis
// has set its defaults (0: none; negative: -2 as given, no deadline set at
// all), and whether client is one of go-redis's own types, whose options
// can be read.
func clientTimeouts(client redis.UniversalClient) (read, write time.Duration, known bool) {
	switch c := client.(type) {
	case *redis.Client:
		return c.Options().ReadTimeout, c.Options().WriteTimeout, true
	case *redis.ClusterClient:
		return c.Options().ReadTimeout, c.Options().WriteTimeout, true
	case *redis.Ring:
		return c.Options().ReadTimeout, c.Options().WriteTimeout, true
	}
	return 0, 0, false
}

// ShortestTimeout returns the shorter of client's positive read and write
// timeouts; 0 if it has none (or is not one of go-redis's own client
// types). A call slower than it fails with a network timeout, which the
// breaker counts as Redis's failure whatever the budget (see
// circuit.Counts).
func ShortestTimeout(client redis.UniversalClient) time.Duration {
	read, write, _ := clientTimeouts(client)
	shortest := time.Duration(0)
	for _, d := range []time.Duration{read, write} {
		if d > 0 && (shortest == 0 || d < shortest) {
			shortest = d
		}
	}
	return shortest
}

// UnboundedReads reports whether nothing bounds a read of client's: it
// has no read timeout and does not put contexts' deadlines on its reads. A
// reply lost in the network (no reset, as when a NAT entry is dropped) then
// holds the path's senders until the connection dies, and the failure
// policy decides meanwhile, even once Redis answers again.
func UnboundedReads(client redis.UniversalClient) bool {
	read, _, known := clientTimeouts(client)
	return known && read <= 0 && !honoursDeadlines(client)
}

// appliesDeadlines reports whether a go-redis client with these options
// puts a context's deadline on its reads and writes: it must honour
// contexts, and neither timeout may be negative once go-redis has set its
// defaults (-2 as given: the client never sets a read or write deadline,
// whatever the context says). Regression (a review): with
// ContextTimeoutEnabled and ReadTimeout -2, calls made in place on a hung
// Redis held their callers 27× the budget, until Redis came back.
func appliesDeadlines(contextTimeout bool, read, write time.Duration) bool {
	return contextTimeout && read >= 0 && write >= 0
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
