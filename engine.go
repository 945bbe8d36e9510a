package leaselimit

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/cowmap"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
)

// engine is what every Limiter of one Client shares: the path to Redis (its
// breakers, lanes, time budget and the gate Close waits on), the key table
// (one MaxKeys bound for every limit), the refund queue, the debt book, the
// janitor, and the sets of limits the Client has been asked for. Each set
// adds what is its limits' own (see limitSet), each Limiter its view.
type engine struct {
	cfg     config
	clock   localClock
	auth    *authority.Redis // the bucket scripts and key names
	path    *redispath.Path  // every Redis call, and every goroutine Close waits for
	table   *lease.Table     // the local state of every limit's keys
	refunds *refundQueue     // unused tokens on their way back
	debts   *debtBook        // what the failure policy admitted, to charge when Redis is back
	server  *serverClock     // Redis's clock as its replies show it, for calendar windows no reply names
	closed  chan struct{}    // a breaker closed: the janitor charges the debts at once
	janitor *janitor         // expiry, eviction and refunds in the background
	slots   chan struct{}    // one per background refill in flight (refill.go)
	// meters and log record what belongs to the engine rather than to one
	// limit (breaker transitions and state, the key table, refunds, the
	// debt book), named by the key prefix (ratelimit.prefix, prefix=).
	meters *recorder.Recorder
	log    *logger

	limits cowmap.Map[policy.Limit, *Limiter] // the default view of each limit
	sets   cowmap.Map[setKey, *Limiter]       // the default view of each set of several limits
	views  cowmap.Map[viewKey, *Limiter]      // other views of sets, made by For on a view
	made   atomic.Int64                       // the sets of limits made (see manyLimits)
	// misuses holds the errors of Limiters that refuse every call (see
	// refusing) already logged, up to misusesKept of them.
	misuses struct {
		sync.Mutex
		seen map[string]struct{}
	}
}

// misusesKept bounds the errors of refusing Limiters remembered: a program
// that makes them from each request's data (one error each) is logged
// once per logEvery past it.
const misusesKept = 64

// refusing logs err, the error every call of a Limiter just made returns
// (an invalid limit, an option With refused): each error the first time
// (so that two typos in a plan table are both told at start-up), then at
// most once per logEvery.
func (e *engine) refusing(err error) {
	text := err.Error()
	e.misuses.Lock()
	_, seen := e.misuses.seen[text]
	first := !seen && len(e.misuses.seen) < misusesKept
	if first {
		if e.misuses.seen == nil {
			e.misuses.seen = make(map[string]struct{})
		}
		e.misuses.seen[text] = struct{}{}
	}
	e.misuses.Unlock()
	e.log.refusing(err, first)
}

// viewKey identifies one view of one set of limits.
type viewKey struct {
	set *limitSet
	v   view
}

// viewOf returns the Limiter of d's limits (d a default view) with view v,
// making it on first use: For on a view made by With gives Limiters of the
// same view, with no allocation for limits seen before.
func (e *engine) viewOf(d *Limiter, v view) *Limiter {
	return e.views.LoadOrMake(viewKey{d.limitSet, v}, func() *Limiter {
		l := *d
		l.view = v
		return &l
	})
}

// limiter returns the default view of first and more together, making
// their state on first use. A set seen before costs one atomic load and
// one map read: no lock, no allocation. Limits that cannot be enforced
// together give a Limiter whose every call returns why.
func (e *engine) limiter(first policy.Limit, more []policy.Limit) *Limiter {
	if len(more) == 0 {
		return e.single(first)
	}
	return e.several(first, more)
}

// single returns the default view of limit alone.
func (e *engine) single(limit policy.Limit) *Limiter {
	limit = limit.Canonical()
	if l, ok := e.limits.Load(limit); ok {
		return l
	}
	if err := limit.Validate(); err != nil {
		// Not kept: an invalid limit is the caller's bug, reported by
		// every call of the Limiter it gets.
		return e.invalid([]policy.Limit{limit}, err)
	}
	return e.limits.LoadOrMake(limit, func() *Limiter {
		return e.defaultView(e.newSet([]*member{e.newMember(limit)}))
	})
}

// several returns the default view of first and more (1 to MaxLimits-1 of
// them) together. Each member is that of its limit alone: a key's own
// lease and FailLocal bucket under one limit are the same whichever set
// reaches them.
func (e *engine) several(first policy.Limit, more []policy.Limit) *Limiter {
	var k setKey
	if len(more) < MaxLimits {
		k[0] = first.Canonical()
		for i, l := range more {
			k[1+i] = l.Canonical()
		}
		if l, ok := e.sets.Load(k); ok {
			return l
		}
	}
	limits := append([]policy.Limit{first}, more...)
	for i := range limits {
		limits[i] = limits[i].Canonical()
	}
	if err := validLimits(limits); err != nil {
		return e.invalid(limits, err)
	}
	return e.sets.LoadOrMake(k, func() *Limiter {
		members := make([]*member, len(limits))
		for i, l := range limits {
			members[i] = e.single(l).members[0]
		}
		return e.defaultView(e.newSet(members))
	})
}

// defaultView is the view of s that NewClient's options describe.
func (e *engine) defaultView(s *limitSet) *Limiter {
	return &Limiter{limitSet: s, view: e.cfg.view}
}

// invalid returns a Limiter of limits whose every call returns err, and
// logs it.
func (e *engine) invalid(limits []policy.Limit, err error) *Limiter {
	e.refusing(err)
	return &Limiter{limitSet: e.invalidSet(limits), view: e.cfg.view, err: err}
}

// breakerSettings are the configured breaker settings on the engine's
// clock, with transitions counted.
func (e *engine) breakerSettings() circuit.Settings {
	s := circuit.Settings{Settings: e.cfg.breaker, Now: e.cfg.clock.Now} // one clock for retry-afters (withClock)
	user := s.OnStateChange
	s.OnStateChange = func(from, to breaker.State) {
		e.meters.CountTransition(to)
		if to == breaker.Closed {
			select { // under the breaker's lock: never block
			case e.closed <- struct{}{}:
			default:
			}
		}
		if user != nil {
			user(from, to)
		}
	}
	return s
}

// dropped is called once what owned e (a Client, or a Limiter of New's)
// has been garbage-collected: unclosed, e runs on for nothing (see
// watchClose).
func (e *engine) dropped() {
	if !e.path.IsClosed() {
		e.log.dropped()
	}
}

// shutdown is Client.Close: it stops new calls, waits for those in flight
// and the janitor, and gives back every leased token and charges every
// debt in one final send.
func (e *engine) shutdown() error {
	if !e.path.Close() {
		return ErrClosed
	}
	defer e.meters.Close()
	e.janitor.halt()
	e.path.Wait()
	e.refunds.addReturns(e.table.Drain())
	e.debts.move(e.refunds, e.path, true)
	return e.refunds.final()
}

// ready is Client.Check.
func (e *engine) ready(ctx context.Context) error {
	if e.path.IsClosed() {
		return ErrClosed
	}
	return e.path.Check(ctx)
}
