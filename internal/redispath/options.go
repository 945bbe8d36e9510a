package redispath

import (
	"runtime"
	"time"

	"github.com/redis/go-redis/v9"
)

// clientOptions is what the path reads of a go-redis client's options,
// once go-redis has set its defaults.
type clientOptions struct {
	known          bool // one of go-redis's own types, whose options can be read
	contextTimeout bool // ContextTimeoutEnabled
	// read, write: 0 none; negative: -2 as given, no deadline set at all.
	read, write time.Duration
	pool        int // the pool size (one node's on a Cluster)
}

// optionsOf reads client's options (zero if it is not one of go-redis's
// own client types).
func optionsOf(client redis.UniversalClient) clientOptions {
	switch c := client.(type) {
	case *redis.Client:
		o := c.Options()
		return clientOptions{true, o.ContextTimeoutEnabled, o.ReadTimeout, o.WriteTimeout, o.PoolSize}
	case *redis.ClusterClient:
		o := c.Options()
		return clientOptions{true, o.ContextTimeoutEnabled, o.ReadTimeout, o.WriteTimeout, o.PoolSize}
	case *redis.Ring:
		o := c.Options()
		return clientOptions{true, o.ContextTimeoutEnabled, o.ReadTimeout, o.WriteTimeout, o.PoolSize}
	}
	return clientOptions{}
}

// honoursDeadlines reports whether client applies context deadlines to its
// network reads and writes: go-redis's ContextTimeoutEnabled option, and
// neither timeout -2 (the client then never sets a read or write deadline,
// whatever the context says). Only then can a call be bounded by its
// context alone; otherwise a hung Redis holds a read for the client's
// ReadTimeout (5s by default), so the path's own goroutines make the calls
// and their callers wait at most the budget (see Path and lane).
// Regression (a review): with ContextTimeoutEnabled and ReadTimeout -2,
// calls made in place on a hung Redis held their callers 27× the budget,
// until Redis came back.
func honoursDeadlines(client redis.UniversalClient) bool {
	o := optionsOf(client)
	return o.contextTimeout && o.read >= 0 && o.write >= 0
}

// ShortestTimeout returns the shorter of client's positive read and write
// timeouts; 0 if it has none (or is not one of go-redis's own client
// types). A script call slower than it is sent again under its id within
// the budget (see authority.Redis.AcquireAll), and one that keeps missing
// it fails with a network timeout, which the breaker counts as Redis's
// failure whatever the budget (see circuit.Counts).
func ShortestTimeout(client redis.UniversalClient) time.Duration {
	o := optionsOf(client)
	shortest := time.Duration(0)
	for _, d := range []time.Duration{o.read, o.write} {
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
	o := optionsOf(client)
	return o.known && o.read <= 0 && !honoursDeadlines(client)
}

// poolSize is the client's connection pool size (one node's on a Cluster).
func poolSize(client redis.UniversalClient) int {
	if pool := optionsOf(client).pool; pool > 0 {
		return pool
	}
	return 10 * runtime.GOMAXPROCS(0) // go-redis's default
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
