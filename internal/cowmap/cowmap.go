// Package cowmap provides a map for lookups on every request and rare
// additions, such as the limits of a service's plans.
package cowmap

import (
	"sync"
	"sync/atomic"
)

// Map is a copy-on-write map: a lookup is one atomic load and one map
// read, with no lock and no allocation; an addition copies the map under a
// lock, so it suits a set that stops growing (a few thousand entries). The
// zero Map is empty and ready to use.
type Map[K comparable, V any] struct {
	mu sync.Mutex // serialises additions
	m  atomic.Pointer[map[K]V]
}

// Load returns the value for k, if any.
func (c *Map[K, V]) Load(k K) (V, bool) {
	if m := c.m.Load(); m != nil {
		v, ok := (*m)[k]
		return v, ok
	}
	var zero V
	return zero, false
}

// LoadOrMake returns the value for k, calling mk for it (once, under the
// lock) when there is none.
func (c *Map[K, V]) LoadOrMake(k K, mk func() V) V {
	if v, ok := c.Load(k); ok {
		return v
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.m.Load()
	var n int
	if old != nil {
		if v, ok := (*old)[k]; ok {
			return v
		}
		n = len(*old)
	}
	next := make(map[K]V, n+1)
	if old != nil {
		for key, v := range *old {
			next[key] = v
		}
	}
	v := mk()
	next[k] = v
	c.m.Store(&next)
	return v
}
