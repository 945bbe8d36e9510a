package leaselimit

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/redis/go-redis/v9"
)

// breakers holds the circuit breakers of a Limiter: one for a single node or
// Sentinel deployment, one per master node for a Redis Cluster, so that one
// failed shard sends only its own keys to the failure policy.
type breakers struct {
	name     string
	settings breaker.Settings
	one      *breaker.Breaker     // non-cluster clients, and cluster keys whose node is unknown
	cluster  *redis.ClusterClient // nil unless the client is a cluster

	mu     sync.RWMutex
	byNode map[string]*breaker.Breaker // master address → breaker

	lastReload atomic.Int64 // unix ns of the last slot-map reload we asked for
}

// maxNodeBreakers bounds the per-node breakers kept (failovers add
// addresses); past it, unknown nodes share the common breaker.
const maxNodeBreakers = 1024

func newBreakers(client redis.UniversalClient, name string, s breaker.Settings) *breakers {
	b := &breakers{name: name, settings: s, one: breaker.New(name, s), byNode: map[string]*breaker.Breaker{}}
	if cc, ok := client.(*redis.ClusterClient); ok {
		b.cluster = cc
	}
	return b
}

// forKey returns the breaker of the node that serves rkey. Finding the node
// reads go-redis's cached slot map; only when it has none (a cluster that
// has never answered) does it ask Redis, within budget.
func (b *breakers) forKey(rkey string, budget time.Duration) *breaker.Breaker {
	if b.cluster == nil {
		return b.one
	}
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	node, err := b.cluster.MasterForKey(ctx, rkey)
	if err != nil {
		return b.one
	}
	addr := node.Options().Addr
	b.mu.RLock()
	br := b.byNode[addr]
	b.mu.RUnlock()
	if br != nil {
		return br
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if br = b.byNode[addr]; br != nil {
		return br
	}
	if len(b.byNode) >= maxNodeBreakers {
		return b.one
	}
	br = breaker.New(b.name+"@"+addr, b.settings)
	b.byNode[addr] = br
	return br
}

// failed tells the breakers that a call to rkey's node failed. On a
// Cluster it asks go-redis to reload its slot map (at most once a second):
// go-redis refreshes it on MOVED replies, but not when a master dies, and
// would otherwise keep sending a failed-over shard's keys to the dead node
// for up to a minute.
func (b *breakers) failed() {
	if b.cluster == nil {
		return
	}
	now := time.Now().UnixNano()
	last := b.lastReload.Load()
	if now-last < int64(time.Second) || !b.lastReload.CompareAndSwap(last, now) {
		return
	}
	b.cluster.ReloadState(context.Background()) // asynchronous in go-redis
}

// worst returns the most severe state of any breaker: open, then half-open.
func (b *breakers) worst() breaker.State {
	w := b.one.State()
	b.mu.RLock()
	defer b.mu.RUnlock()
	for _, br := range b.byNode {
		if s := br.State(); rank(s) > rank(w) {
			w = s
		}
	}
	return w
}

func rank(s breaker.State) int {
	switch s {
	case breaker.Open:
		return 2
	case breaker.HalfOpen:
		return 1
	}
	return 0
}
