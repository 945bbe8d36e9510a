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
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/overload"
	"github.com/leaselimit/leaselimit/telemetry"
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
	Breaker breaker.Settings
	// Tel records the engine's own calls (refunds).
	Tel *telemetry.Recorder
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
	tel     *telemetry.Recorder
	pool    int  // the client's connection pool size (see congested)
	bounded bool // the client applies context deadlines to reads and writes
	retries bool // the client may send a command more than once on its own
	gate    gate
	nodes   *nodes
	workers *workers // Do's calls on a client that does not honour deadlines

	closed, unavailable error
}

// New returns the path of cfg's client. It makes no Redis call.
func New(cfg Config) *Path {
	p := &Path{client: cfg.Client, auth: cfg.Auth, budget: cfg.Budget, tel: cfg.Tel, pool: poolSize(cfg.Client),
		bounded: honoursDeadlines(cfg.Client), retries: retriesCommands(cfg.Client),
		closed: cfg.Closed, unavailable: cfg.Unavailable}
	p.nodes = newNodes(cfg.Client, cfg.Name, cfg.Breaker, &p.gate, cfg.Auth, cfg.Budget)
	p.workers = newWorkers()
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
func (p *Path) Close() bool { return p.gate.close() }

// Wait waits for the calls and goroutines admitted before Close, then
// stops the lanes' senders and Do's workers.
func (p *Path) Wait() {
	p.gate.wait()
	p.nodes.stop() // the calls the senders carried have ended
	p.workers.stop()
}

// Shared returns the breaker of a single node or Sentinel deployment, and
// of Cluster keys whose node is not known.
func (p *Path) Shared() *breaker.Breaker { return p.nodes.one }

// Cluster returns the client if it is a Cluster's, else nil.
func (p *Path) Cluster() *redis.ClusterClient { return p.nodes.cluster }

// Route returns the breaker of the node that serves the Redis key rkey.
// It never waits on the network (see nodes.forKey).
func (p *Path) Route(rkey string) *breaker.Breaker { return p.nodes.forKey(rkey, p.budget) }

// State returns the most severe state of the breakers in use.
func (p *Path) State() breaker.State { return p.nodes.worst() }

// Failed tells the path that a call failed in a way that counts against
// the breaker (see nodes.failed).
func (p *Path) Failed() { p.nodes.failed() }

// Do makes one Redis call, op, through brk within the time budget: a peek,
// a reset, an adjustment. The error is the closed error, ctx's, or wraps
// the unavailable error (the breaker is open, a failure that counts
// against it, no reply in the budget); Redis replies that mean
// misconfiguration (NOPERM and the like) are returned as they are. sent
// reports whether op ran (false: it never will, so its effect can be
// queued for later without doubling it).
//
// On a client that honours deadlines op runs on the caller's goroutine,
// bounded by the budget (by saturationGrace budgets more while this process
// is behind, as for an acquire call). On any other, op is carried by one of
// the path's few workers on a context detached from ctx, and the breaker is
// told op's real outcome whenever it comes.
func (p *Path) Do(ctx context.Context, brk *breaker.Breaker, op func(context.Context) error) (sent bool, err error) {
	if brk.Rejects(time.Now()) {
		return false, fmt.Errorf("%w: %w", p.unavailable, breaker.ErrOpen)
	}
	done, err := brk.Allow()
	if err != nil {
		return false, fmt.Errorf("%w: %w", p.unavailable, err)
	}
	if p.bounded {
		return p.doInPlace(ctx, done, op)
	}
	if !p.gate.enter() {
		done(nil)
		return false, p.closed
	}
	ch := make(chan error, 1)
	deadline := time.Now().Add((1 + saturationGrace) * p.budget)
	p.workers.run(func() {
		defer p.gate.leave()
		cctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
		defer cancel()
		err := op(cctx)
		done(err)
		ch <- err
	})
	timer := newTimer(p.budget)
	defer releaseTimer(timer)
	select {
	case err = <-ch:
	case <-timer.C:
		return true, fmt.Errorf("%w: no reply within %v", p.unavailable, p.budget)
	case <-ctx.Done():
		return true, ctx.Err()
	}
	return true, p.doError(err)
}

// doInPlace is Do on a client that honours deadlines. The breaker is told
// a timeout of the budget, not one of the caller's ctx.
func (p *Path) doInPlace(ctx context.Context, done func(error), op func(context.Context) error) (sent bool, err error) {
	if !p.gate.enter() {
		done(nil)
		return false, p.closed
	}
	defer p.gate.leave()
	limit := p.budget
	if overload.Recent(time.Now(), limit) {
		limit *= 1 + saturationGrace
	}
	cctx, cancel := context.WithTimeout(ctx, limit)
	err = op(cctx)
	cancel()
	switch {
	case err != nil && ctx.Err() != nil:
		done(nil) // the caller left: not Redis's doing
		return true, ctx.Err()
	case errors.Is(err, context.DeadlineExceeded):
		done(breaker.ErrBudget)
		return true, fmt.Errorf("%w: no reply within %v", p.unavailable, limit)
	}
	done(err)
	return true, p.doError(err)
}

// doError is what Do returns for op's error.
func (p *Path) doError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, authority.ErrScript), errors.Is(err, authority.ErrReply):
		return fmt.Errorf("leaselimit: %w", err)
	case breaker.Counts(err):
		return fmt.Errorf("%w: %w", p.unavailable, err)
	}
	return fmt.Errorf("leaselimit: redis: %w", err)
}

// Refund sends adjustments rs, all of brk's node, in one pipeline within
// the budget, and returns those that failed. It reports false, sending
// nothing, when brk holds calls back: they wait for Redis.
func (p *Path) Refund(brk *breaker.Breaker, rs []authority.Refund, tokens int64) (failed []authority.Failed, sent bool) {
	if brk.Rejects(time.Now()) {
		return nil, false
	}
	done, err := brk.Allow()
	if err != nil {
		return nil, false
	}
	span := p.tel.StartRefund(p.nodes.laneFor(brk).ep, len(rs))
	ctx, cancel := context.WithTimeout(context.Background(), p.refundBudget(len(rs)))
	failed = p.auth.RefundAll(ctx, rs)
	cancel()
	err = firstError(failed)
	p.tel.EndRefund(span, tokens, err)
	if err != nil && errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("%w: %w", breaker.ErrBudget, err)
	}
	done(err)
	return failed, true
}

// RefundFinal sends adjustments rs once, for Close, within the budget,
// whatever the breakers say: the engine gets no later chance. It returns
// those that failed.
func (p *Path) RefundFinal(rs []authority.Refund, tokens int64) []authority.Failed {
	ctx, cancel := context.WithTimeout(context.Background(), p.refundBudget(len(rs)))
	defer cancel()
	span := p.tel.StartRefund(p.nodes.oneLane.ep, len(rs))
	failed := p.auth.RefundAll(ctx, rs)
	p.tel.EndRefund(span, tokens, firstError(failed))
	return failed
}

// perRefund is what one adjustment adds to its pipeline's deadline: Redis
// runs a refund script (four commands) and the pipeline carries it in 10 to
// 30 µs on a loaded machine; 50 µs leaves a margin.
const perRefund = 50 * time.Microsecond

// maxRefundWait caps a pipeline's deadline (Close's final one waits for
// it): go-redis's own default read timeout.
const maxRefundWait = 3 * time.Second

// refundBudget is the deadline of a pipeline of n adjustments: the budget,
// plus perRefund each, at most maxRefundWait (or the budget, if longer). A
// pipeline is sent whole, and on a client that honours deadlines a flush of
// the leases of thousands of keys (Close's) does not fit in one budget.
func (p *Path) refundBudget(n int) time.Duration {
	return min(p.budget+time.Duration(n)*perRefund, max(maxRefundWait, p.budget))
}

// firstError returns the error of the first failed adjustment, if any.
func firstError(failed []authority.Failed) error {
	if len(failed) == 0 {
		return nil
	}
	return failed[0].Err
}

// Check runs authority.Check within the budget of every node it visits,
// whatever the client's own timeouts; ctx can end it sooner. It runs in a
// goroutine of the gate, since a client that does not honour deadlines
// could hold it for its ReadTimeout.
func (p *Path) Check(ctx context.Context) error {
	ch := make(chan error, 1)
	if !p.gate.spawn(func() { ch <- p.auth.Check(context.WithoutCancel(ctx), p.budget) }) {
		return p.closed
	}
	wait, cancel := context.WithTimeout(ctx, p.checkBudget())
	defer cancel()
	select {
	case err := <-ch:
		return err
	case <-wait.Done():
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("%w: no reply within %v: check the address, the network, and that Redis is not hung", authority.ErrCheck, p.checkBudget())
	}
}

// checkBudget bounds a whole Check: two budgets a node (the scripts and
// the eviction policy), and one for the cluster's masters.
func (p *Path) checkBudget() time.Duration {
	nodes := 1
	if p.nodes.cluster != nil {
		nodes = max(len(p.nodes.cluster.Options().Addrs), 1) + 1
	}
	return time.Duration(2*nodes) * p.budget
}
