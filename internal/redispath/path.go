// Package redispath is the one path from a leaselimit engine to Redis.
// Every call the root package makes (acquire, adjust and refund, peek,
// reset, check) goes through it, and it owns what those calls share: the
// time budget and its rule set, the circuit breakers (one per Cluster
// master), the lanes that batch acquire calls, the gate Close waits for,
// and what it must know of the go-redis client's options.
//
// It knows nothing of leases, the refund queue or logging. The root states
// what to ask; what it does with an answer comes back to it as a value, or,
// for an answer its caller may no longer wait for, through a Receiver.
//
// The rule set: a call is made through its node's breaker, and its caller
// waits for it at most the time budget, plus a grace of saturationGrace
// budgets while this process, not Redis, is behind (see Caller). On a
// client that honours context deadlines (see honoursDeadlines) the call
// runs on its caller's goroutine with that deadline; on any other, a hung
// Redis could hold a read for the client's ReadTimeout, so the call is
// carried by a goroutine of the path (a lane's sender for an acquire, one
// per call for the rarer verbs) and the caller stops waiting at the budget.
package redispath

import (
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/monotime"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/redis/go-redis/v9"
)

// Config is what New needs.
type Config struct {
	Client redis.UniversalClient
	Auth   *authority.Redis
	Budget time.Duration
	// Name names the breakers ("<Name>" for the shared one, "<Name>@<node
	// address>" for a Cluster master's).
	Name    string
	Breaker circuit.Settings
	// Tel records the engine's own calls (refunds).
	Tel *recorder.Recorder
	// Closed is the error of every call once Close has begun;
	// Unavailable is wrapped by Do's errors when Redis cannot be asked or
	// does not answer in the budget.
	Closed, Unavailable error
}

// Path is one engine's path to Redis. It is safe for concurrent use.
type Path struct {
	client  redis.UniversalClient
	auth    *authority.Redis
	budget  time.Duration
	tel     *recorder.Recorder
	pool    int  // the client's connection pool size (see congested)
	bounded bool // the client applies context deadlines to reads and writes
	retries bool // the client may send a command more than once on its own
	gate    gate
	nodes   *nodes
	workers *workers // Do's calls on a client that does not honour deadlines
	// recoverers learn the outcomes of cut calls (see recoverCut): a crew
	// of their own, so that a Redis that does not answer holds no Do call
	// behind them. recovering counts the calls they have.
	recoverers *workers
	recovering atomic.Int32
	closedAt   atomic.Int64 // when Close began, a monotime (0: not yet), for the recoverers
	dials      dials        // whether the client's dials fail (see unreachable)

	closed, unavailable error
}

// New returns the path of cfg's client. It makes no Redis call.
func New(cfg Config) *Path {
	p := &Path{client: cfg.Client, auth: cfg.Auth, budget: cfg.Budget, tel: cfg.Tel, pool: poolSize(cfg.Client),
		bounded: honoursDeadlines(cfg.Client), retries: retriesCommands(cfg.Client),
		closed: cfg.Closed, unavailable: cfg.Unavailable}
	p.nodes = newNodes(cfg.Client, cfg.Name, cfg.Breaker, &p.gate, cfg.Auth, cfg.Budget)
	p.workers, p.recoverers = newWorkers(), newWorkers()
	p.dials.look(cfg.Client)
	return p
}

// Pool is the client's connection pool size (one node's on a Cluster).
func (p *Path) Pool() int { return p.pool }

// Retries reports whether the client may send a command more than once on
// its own, so that an error saying the last attempt never reached Redis
// says nothing of the earlier ones (see retriesCommands).
func (p *Path) Retries() bool { return p.retries }

// IsClosed reports whether Close has begun (one atomic load).
func (p *Path) IsClosed() bool { return p.gate.isClosed() }

// Closing returns a channel closed once Close has begun: a caller that
// sleeps between calls wakes on it.
func (p *Path) Closing() <-chan struct{} { return p.gate.done() }

// Spawn runs f in a goroutine that Wait waits for; it fails once Close has
// begun.
func (p *Path) Spawn(f func()) bool { return p.gate.spawn(f) }

// Enter registers work that Wait must wait for (Leave ends it); it fails
// once Close has begun.
func (p *Path) Enter() bool { return p.gate.enter() }

// Leave ends work registered by Enter.
func (p *Path) Leave() { p.gate.leave() }

// Close refuses new calls from now on. It reports false if it had begun
// already.
func (p *Path) Close() bool {
	if !p.gate.close() {
		return false
	}
	p.closedAt.Store(monotime.Now())
	return true
}

// Wait waits for the calls and goroutines admitted before Close, then
// stops the lanes' senders, Do's workers and the recoverers.
func (p *Path) Wait() {
	p.gate.wait()
	p.nodes.stop() // the calls the senders carried have ended
	p.workers.stop()
	p.recoverers.stop()
}

// Shared returns the breaker of a single node or Sentinel deployment, and
// of Cluster keys whose node is not known.
func (p *Path) Shared() *circuit.Breaker { return p.nodes.one }

// Cluster returns the client if it is a Cluster's, else nil.
func (p *Path) Cluster() *redis.ClusterClient { return p.nodes.cluster }

// Route returns the breaker of the node that serves the Redis key rkey.
// It never waits on the network (see nodes.forKey).
func (p *Path) Route(rkey string) *circuit.Breaker { return p.nodes.forKey(rkey, p.budget) }

// State returns the most severe state of the breakers in use.
func (p *Path) State() breaker.State { return p.nodes.worst() }

// Failed tells the path that a call failed in a way that counts against
// the breaker (see nodes.failed).
func (p *Path) Failed() { p.nodes.failed() }
