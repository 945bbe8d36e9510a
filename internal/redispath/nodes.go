package redispath

import (
	"context"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/monotime"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/redis/go-redis/v9"
)

// nodes holds the circuit breakers of an engine, each with its lane of
// batched acquire calls: one for a single node or Sentinel deployment, one
// per master node for a Redis Cluster, so that one failed shard sends only
// its own keys to the failure policy.
type nodes struct {
	name     string
	settings circuit.Settings
	now      func() time.Time                                                           // the Limiter's clock
	one      *circuit.Breaker                                                           // non-cluster clients, and cluster keys whose node is unknown
	oneLane  *lane                                                                      // one's batches
	cluster  *redis.ClusterClient                                                       // nil unless the client is a cluster
	newLane  func(brk *circuit.Breaker, ep recorder.Endpoint, node *redis.Client) *lane // a lane for a new node's breaker, node its client
	shards   *shardWitnesses                                                            // a Ring's shards' witnesses; nil unless the client is a Ring

	mu     sync.RWMutex
	byNode map[string]*nodeBreaker // master address → breaker
	lanes  map[*circuit.Breaker]*lane

	lastReload atomic.Int64 // the monotime of the last slot-map reload we asked for

	// go-redis loads a ClusterClient's slot map on first use, in the
	// caller's goroutine and without honouring context deadlines. Until it
	// has one, keys use the shared breaker and the map loads in the
	// background, in a goroutine of gate (Close waits for it).
	mapReady   atomic.Bool
	mapLoading atomic.Bool
	gate       *gate
}

// maxNodeBreakers bounds the per-node breakers kept (failovers add
// addresses); past it, unknown nodes share the common breaker.
const maxNodeBreakers = 1024

// nodeBreaker is the breaker of one cluster node, with when keys were last
// routed to it: a node that no longer serves any slot (a failed master
// replaced by its replica) stops counting towards the Limiter's state.
type nodeBreaker struct {
	*circuit.Breaker
	routed atomic.Int64 // unix ns, coarse
}

// newNodes returns the breakers of client, each with its lane of batched
// calls (see lane) to auth.
func newNodes(client redis.UniversalClient, name string, s circuit.Settings, g *gate, auth *authority.Redis, budget time.Duration) *nodes {
	now := s.Now
	if now == nil {
		now = time.Now
	}
	pool := poolSize(client)
	b := &nodes{name: name, settings: s, now: now, one: circuit.New(name, s), byNode: map[string]*nodeBreaker{}, gate: g}
	b.newLane = func(brk *circuit.Breaker, ep recorder.Endpoint, node *redis.Client) *lane {
		ln := newLane(auth, brk, pool, callLife(budget), ep, newWitness(node, budget))
		ln.witnessOf = func(rkey string) *witness { return b.witnessOf(brk, rkey) }
		return ln
	}
	single, _ := client.(*redis.Client) // nil on a Cluster: its nodes' lanes have their nodes' witnesses
	b.oneLane = b.newLane(b.one, endpointOf(client), single)
	b.lanes = map[*circuit.Breaker]*lane{} // the node breakers'; one has oneLane
	if cc, ok := client.(*redis.ClusterClient); ok {
		b.cluster = cc
	}
	b.shards = newShardWitnesses(client, budget)
	return b
}

// endpointOf is the server a client's shared lane talks to: a single
// node's address and database; for Sentinel (whose master moves) and
// Cluster (see nodeEndpoint) only what is known.
func endpointOf(client redis.UniversalClient) recorder.Endpoint {
	c, ok := client.(*redis.Client)
	if !ok {
		return recorder.Endpoint{}
	}
	o := c.Options()
	ep := recorder.Endpoint{Namespace: strconv.Itoa(o.DB)}
	if o.Addr != "FailoverClient" { // go-redis's name for a Sentinel client's address
		ep.Address, ep.Port = splitAddr(o.Addr)
	}
	return ep
}

// nodeEndpoint is a Cluster node's endpoint (a Cluster has database 0 alone).
func nodeEndpoint(addr string) recorder.Endpoint {
	ep := recorder.Endpoint{Namespace: "0"}
	ep.Address, ep.Port = splitAddr(addr)
	return ep
}

// splitAddr splits host:port; an address without a port is all host.
func splitAddr(addr string) (string, int) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr, 0
	}
	p, _ := strconv.Atoi(port)
	return host, p
}

// forKey returns the breaker of the node that serves rkey. Finding the node
// reads go-redis's cached slot map and never waits on the network: before
// the map has loaded, the shared breaker is used and the map is loaded in
// the background.
func (b *nodes) forKey(rkey string, budget time.Duration) *circuit.Breaker {
	if b.cluster == nil {
		return b.one
	}
	if !b.mapReady.Load() {
		b.loadMap(budget)
		return b.one
	}
	node, err := b.cluster.MasterForKey(context.Background(), rkey)
	if err != nil {
		return b.one
	}
	addr := node.Options().Addr
	now := monotime.Of(b.now())
	b.mu.RLock()
	nb := b.byNode[addr]
	b.mu.RUnlock()
	if nb == nil {
		b.mu.Lock()
		if nb = b.byNode[addr]; nb == nil {
			if len(b.byNode) >= maxNodeBreakers {
				b.mu.Unlock()
				return b.one
			}
			nb = &nodeBreaker{Breaker: circuit.New(b.name+"@"+addr, b.settings)}
			b.byNode[addr] = nb
			b.lanes[nb.Breaker] = b.newLane(nb.Breaker, nodeEndpoint(addr), node)
		}
		b.mu.Unlock()
	}
	if now-nb.routed.Load() > int64(10*time.Millisecond) {
		nb.routed.Store(now)
	}
	return nb.Breaker
}

// stop stops the senders of every lane (see lane.stop), once the calls
// the engine admitted have ended.
func (b *nodes) stop() {
	b.oneLane.stop()
	b.mu.RLock()
	lanes := make([]*lane, 0, len(b.lanes))
	for _, ln := range b.lanes {
		lanes = append(lanes, ln)
	}
	b.mu.RUnlock()
	for _, ln := range lanes {
		ln.stop()
	}
	b.shards.close()
}

// laneFor returns the lane of brk, a breaker forKey returned.
func (b *nodes) laneFor(brk *circuit.Breaker) *lane {
	if brk == b.one {
		return b.oneLane
	}
	b.mu.RLock()
	ln := b.lanes[brk]
	b.mu.RUnlock()
	return ln
}

// witnessOf returns the witness that judges a call on rkey through brk (see
// witness): the witness of brk's node, or on a Ring of rkey's shard. A
// Cluster's key sent through the shared breaker, before the slot map had
// loaded, is judged by the witness of the node that serves it once the map
// has loaded (none before): TestClusterPoolHeldByTheApplication saw the
// first calls of a Limiter, made while the application's BLPOP loops held
// every node's pool, open the shared breaker without it.
func (b *nodes) witnessOf(brk *circuit.Breaker, rkey string) *witness {
	if b.shards != nil {
		return b.shards.of(rkey) // a Ring: one breaker, a witness per shard
	}
	if brk == b.one && b.cluster != nil {
		if rkey == "" || !b.mapReady.Load() {
			return nil
		}
		if brk = b.forKey(rkey, 0); brk == b.one { // the map has loaded: forKey does not load it
			return nil
		}
	}
	if ln := b.laneFor(brk); ln != nil {
		return ln.witness
	}
	return nil
}

// loadMap starts one background load of the cluster's slot map.
func (b *nodes) loadMap(budget time.Duration) {
	if !b.mapLoading.CompareAndSwap(false, true) {
		return
	}
	ok := b.gate.spawn(func() {
		defer b.mapLoading.Store(false)
		ctx, cancel := context.WithTimeout(context.Background(), budget)
		defer cancel()
		if _, err := b.cluster.MasterForKey(ctx, "leaselimit"); err == nil {
			b.mapReady.Store(true)
		}
	})
	if !ok {
		b.mapLoading.Store(false)
	}
}

// failed tells the breakers that a call to rkey's node failed. On a
// Cluster it asks go-redis to reload its slot map (at most once a second):
// go-redis refreshes it on MOVED replies, but not when a master dies, and
// would otherwise keep sending a failed-over shard's keys to the dead node
// for up to a minute.
func (b *nodes) failed() {
	if b.cluster == nil {
		return
	}
	now := monotime.Of(b.now())
	last := b.lastReload.Load()
	if now-last < int64(time.Second) || !b.lastReload.CompareAndSwap(last, now) {
		return
	}
	b.cluster.ReloadState(context.Background()) // asynchronous in go-redis
}

// worst returns the most severe state of the breakers in use: open, then
// half-open. A node breaker that no key was routed to for a while (twice
// the open interval, at least 1s) is out of use: its node no longer serves
// any slot.
func (b *nodes) worst() breaker.State {
	w := b.one.State()
	stale := max(2*b.settings.WithDefaults().OpenFor, time.Second)
	since := monotime.Of(b.now().Add(-stale))
	b.mu.RLock()
	defer b.mu.RUnlock()
	for _, nb := range b.byNode {
		if nb.routed.Load() < since {
			continue
		}
		if s := nb.State(); s > w { // closed < half-open < open
			w = s
		}
	}
	return w
}
