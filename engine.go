package leaselimit

import (
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/cowmap"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"golang.org/x/sync/singleflight"
)

// engine is what every Limiter of one New shares: the path to Redis (its
// breakers, lanes, time budget and the gate Close waits on), the key table
// (one MaxKeys bound for every limit), the refund queue, the janitor, and
// the Limiters that For has made. Each Limiter adds what is its limit's own (see Limiter).
type engine struct {
	cfg     config
	clock   localClock
	auth    *authority.Redis // the bucket scripts and key names
	path    *redispath.Path  // every Redis call, and every goroutine Close waits for
	table   *lease.Table     // the local state of every limit's keys
	refunds *refundQueue     // unused tokens on their way back
	debts   *debtBook        // what the failure policy admitted, to charge when Redis is back
	closed  chan struct{}    // a breaker closed: the janitor charges the debts at once
	janitor *janitor         // expiry, eviction and refunds in the background
	slots   chan struct{}    // one per background refill in flight (refill.go)
	// meters records what belongs to the engine rather than to one limit
	// (breaker transitions and state, the key table, refunds); its
	// ratelimit.limit.name is that of New's limit.
	meters *telemetry.Recorder
	root   *Limiter // the Limiter New returned: the one whose Close closes the engine

	limits cowmap.Map[policy.Limit, *Limiter] // For's Limiters (and New's)
	groups cowmap.Map[groupKey, *Limiter]     // For's multi-limits
}

// limiter returns the engine's Limiter for limit, making it on first use.
// A lookup of a limit seen before is one atomic load and one map read: no
// lock, no allocation.
func (e *engine) limiter(limit policy.Limit) *Limiter {
	limit = canonical(limit)
	if l, ok := e.limits.Load(limit); ok {
		return l
	}
	if err := limit.Validate(); err != nil {
		// Not kept: an invalid limit is the caller's bug, reported by
		// every call of the Limiter it gets.
		return &Limiter{engine: e, limit: limit, invalid: err, tel: e.meters}
	}
	return e.limits.LoadOrMake(limit, func() *Limiter { return e.newLimiter(limit) })
}

// zones maps a time zone's name to the one *time.Location the engines use
// for it: two quotas in one zone compare equal (as map keys, and in For's
// check for a limit given twice) even when each loaded its own Location.
var zones cowmap.Map[string, *time.Location]

// canonical returns limit with its calendar Location replaced by the
// shared one of the same name (see zones); other limits as they are.
func canonical(limit policy.Limit) policy.Limit {
	loc := limit.Calendar.Location
	if loc == nil {
		return limit
	}
	limit.Calendar.Location = zones.LoadOrMake(loc.String(), func() *time.Location { return loc })
	return limit
}

// newLimiter returns a Limiter for limit on e: its own lease protocol (over
// the shared table), refills, telemetry attributes and log name.
func (e *engine) newLimiter(limit policy.Limit) *Limiter {
	tel := e.meters // New's limit
	if e.root != nil {
		tel = e.meters.WithLimit(limit.Name)
	}
	l := &Limiter{
		engine:  e,
		limit:   limit,
		namer:   e.auth.Namer(limit),
		tel:     tel,
		log:     newLogger(e.cfg.logger, limit.Name),
		leases:  lease.New(e.table, limit, e.cfg.lease, e.cfg.fleetSize),
		sf:      new(singleflight.Group),
		enforce: e.cfg.enforce,
	}
	l.calls = e.path.Caller(tel, &receiver{leases: l.leases, refunds: e.refunds, clock: e.clock, log: l.log})
	return l
}

// breakerSettings are the configured breaker settings on the engine's
// clock, with transitions counted.
func (e *engine) breakerSettings() breaker.Settings {
	s := e.cfg.breaker
	s.Now = e.cfg.clock.Now // one clock for retry-afters (WithClock)
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
