// Package cowmap provides a map for lookups on every request and rare
// additions, such as the limits of a service's plans.
package cowmap

import (
	"maps"
	"sync"
	"sync/atomic"
)

// Map is a map read on every request and added to now and then. A lookup
// of a key it has held since its last promotion is one atomic load and one
// map read, with no lock and no allocation. A new key goes to a second,
// dirty map under the lock, and lookups that must take the lock count as
// misses: once they reach the dirty map's size, it becomes the read map,
// copied once. This is sync.Map's scheme; sync.Map itself keys by
// interface, so a lookup of a struct key (a policy.Limit) would allocate.
// Copying the whole map on each addition, as Map once did, cost O(n²):
// 30,000 limits took 27 s, the lock held. The zero Map is empty and ready
// to use.
type Map[K comparable, V any] struct {
	mu   sync.Mutex
	read atomic.Pointer[readOnly[K, V]] // never changed once stored
	// dirty holds read's entries and the keys added since read was
	// stored, or is nil when it has none of its own. Guarded by mu.
	dirty  map[K]V
	misses int // lookups that took the lock since dirty was made; guarded by mu
	copied int // entries copied from read to a new dirty, in all (for tests)
}

// readOnly is the lock-free part of a Map.
type readOnly[K comparable, V any] struct {
	m       map[K]V
	amended bool // the dirty map holds keys m does not
}

// Load returns the value for k, if any.
func (c *Map[K, V]) Load(k K) (V, bool) {
	if v, ok, final := fromRead(c.read.Load(), k); final {
		return v, ok
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.loadLocked(k)
}

// fromRead looks k up in the read map r; final reports whether r's answer
// is the Map's: k found, or no key added since r was stored.
func fromRead[K comparable, V any](r *readOnly[K, V], k K) (v V, ok, final bool) {
	if r == nil {
		return v, false, true
	}
	v, ok = r.m[k]
	return v, ok, ok || !r.amended
}

// loadLocked is Load with c.mu held; a lookup the read map could not
// answer counts a miss.
func (c *Map[K, V]) loadLocked(k K) (V, bool) {
	if v, ok, final := fromRead(c.read.Load(), k); final {
		return v, ok
	}
	v, ok := c.dirty[k]
	c.misses++
	if c.misses >= len(c.dirty) {
		// As many lookups paid the lock as the dirty map has entries:
		// promoting it now costs no more than they did.
		c.read.Store(&readOnly[K, V]{m: c.dirty})
		c.dirty, c.misses = nil, 0
	}
	return v, ok
}

// LoadOrMake returns the value for k, calling mk for it (once, under the
// lock) when there is none.
func (c *Map[K, V]) LoadOrMake(k K, mk func() V) V {
	if v, ok, _ := fromRead(c.read.Load(), k); ok {
		return v
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if v, ok := c.loadLocked(k); ok {
		return v
	}
	if c.dirty == nil {
		var old map[K]V
		if r := c.read.Load(); r != nil {
			old = r.m
		}
		c.dirty = make(map[K]V, len(old)+1)
		maps.Copy(c.dirty, old)
		c.copied += len(old)
		c.read.Store(&readOnly[K, V]{m: old, amended: true})
	}
	v := mk()
	c.dirty[k] = v
	return v
}
