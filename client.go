package leaselimit

import (
	"fmt"
	"runtime"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/nilclient"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// Client is the engine that every Limiter of a service shares: the Redis
// client, the circuit breakers around it, the local key table (leases,
// negative cache, FailLocal buckets of every limit), the background
// goroutine that expires leases and gives back their unused tokens, and the
// engine's own logs and metrics. Limiter returns the Limiters that decide,
// one per limit or set of limits; they are cheap views of the Client.
//
// Make one Client per Redis deployment and process, at start-up; Check it
// in readiness probes; Close it at shutdown, which closes every Limiter it
// made. A Client is safe for concurrent use.
type Client struct {
	e *engine
}

// NewClient returns a Client on client, which may be any go-redis v9
// client: a single node, Sentinel (redis.NewFailoverClient) or Cluster.
// NewClient makes no Redis call, so it neither blocks nor fails when Redis
// is down; decisions follow the failure policy until Redis answers. Its
// error is that of an invalid option.
//
// The Client starts one background goroutine (lease expiry, refunds and
// idle-key eviction); Close stops it.
func NewClient(client redis.UniversalClient, opts ...Option) (*Client, error) {
	c, err := newClient(client, opts)
	if err != nil {
		return nil, err
	}
	watchClose(c, c.e)
	return c, nil
}

// newClient is NewClient, for a caller that keeps the Client to itself
// (New: its Limiter closes it).
func newClient(client redis.UniversalClient, opts []Option) (*Client, error) {
	if nilclient.Is(client) {
		return nil, errNoRedisClient
	}
	cfg := defaultConfig()
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o.apply(&cfg); err != nil {
			return nil, err
		}
	}
	if err := cfg.breaker.Validate(); err != nil {
		return nil, fmt.Errorf("leaselimit: %w", err)
	}
	warnClientTimeouts(client, cfg)
	// A batch's reply must outlive every resend of it (see
	// authority.WithResendWindow): the path's longest call deadline grows
	// with the budget.
	auth, err := authority.New(client, cfg.prefix, authority.WithResendWindow(redispath.ResendWindow(cfg.timeout)))
	if err != nil {
		return nil, fmt.Errorf("leaselimit: %w", err)
	}
	meters, err := recorder.New(recorder.Config{
		TracerProvider: cfg.tracerProvider,
		MeterProvider:  cfg.meterProvider,
		Prefix:         cfg.prefix,
		Sources:        sourceNames(),
		Events:         cfg.events,
		Redact:         cfg.redact,
	})
	if err != nil {
		return nil, fmt.Errorf("leaselimit: telemetry: %w", err)
	}
	// Each part is built once what it needs exists, and handed it.
	e := &engine{
		cfg:    cfg,
		clock:  newLocalClock(cfg.clock),
		auth:   auth,
		table:  lease.NewTable(cfg.maxKeys, cfg.lease),
		meters: meters,
		log:    newLogger(cfg.logger, new(logTimes), "prefix", cfg.prefix),
		closed: make(chan struct{}, 1),
	}
	e.path = redispath.New(redispath.Config{Client: client, Auth: auth, Budget: cfg.timeout, Name: "leaselimit:" + cfg.prefix,
		Breaker: e.breakerSettings(), Tel: meters, Closed: ErrClosed, Unavailable: ErrUnavailable})
	e.slots = make(chan struct{}, prefetchSlots(e.path.Pool()))
	// A metric reader may collect at once: the gauges read the breakers
	// and the key table, which exist from here on.
	if err := meters.Observe(e.path.State, func() int64 { return int64(e.table.Len()) }, e.table.Full); err != nil {
		return nil, fmt.Errorf("leaselimit: telemetry: %w", err)
	}
	e.refunds = newRefundQueue(auth, e.path, meters, e.clock)
	e.debts = newDebtBook(cfg.maxKeys, meters, e.log, e.clock)
	e.server = new(serverClock)
	e.janitor = startJanitor(e.table, e.refunds, e.debts, e.closed, e.path, e.log, e.clock, cfg.lease.TTL)
	return &Client{e: e}, nil
}

// watchClose has owner (a Client, or a Limiter of New's, which closes
// its own) say so in e's log if it is garbage-collected before e is
// closed: e's goroutine, its key table and its leased tokens live on (the
// tokens go back only as their leases expire), and nothing can close it
// any more. A new user's trial dropped 200 Clients unclosed: 205
// goroutines and 218 MiB more, and not a word.
func watchClose[T any](owner *T, e *engine) {
	runtime.AddCleanup(owner, (*engine).dropped, e)
}

// warnClientTimeouts logs, at start-up, the Redis client options that take
// the time budget out of leaselimit's hands (docs/operations.md, "Redis
// requirements"): a read or write timeout shorter than it, which is the
// real budget for a reply that keeps missing it, and denies such calls
// while Redis answers; and reads that nothing bounds,
// which a reply lost in the network holds for ever.
func warnClientTimeouts(client redis.UniversalClient, cfg config) {
	if cfg.logger == nil {
		return
	}
	if t := redispath.ShortestTimeout(client); t > 0 && t < cfg.timeout {
		cfg.logger.Warn("leaselimit: the Redis client's read or write timeout is shorter than the time budget (WithTimeout): calls slower than it are sent again within the budget, and those that keep missing it are denied while Redis answers (or go to the failure policy if it does not); set ReadTimeout and WriteTimeout to at least the budget",
			"client_timeout", t, "budget", cfg.timeout, "prefix", cfg.prefix)
	}
	if redispath.UnboundedReads(client) {
		cfg.logger.Warn("leaselimit: the Redis client has no read timeout and does not apply context deadlines: a reply lost in the network holds leaselimit's calls to that node until the connection dies, and the failure policy decides meanwhile; set a ReadTimeout, or ContextTimeoutEnabled with read and write timeouts other than -2",
			"budget", cfg.timeout, "prefix", cfg.prefix)
	}
}

// Limiter returns the Limiter that enforces limit per key on c, or, with
// more, limit and more together (at most MaxLimits in all): a request's
// tokens are taken from every limit's bucket or from none, in one Redis
// call, and Decision.Parts tells each limit's state. Use one limit per
// plan or tier, or several for a burst within a quota:
//
//	d, err := c.Limiter(plans[user.Plan]).Allow(ctx, user.ID)
//
// A Limiter is a view: it has nothing to release (close the Client; a
// Limiter's Close, deprecated, is for the Limiters New returns), and its
// failure policy and enforcement are NewClient's options until With says
// otherwise. Each limit has its own buckets in Redis (the key names carry
// the limit's name and parameters) and its own local state per key (leases,
// negative cache, slow start, FailLocal buckets); WithMaxKeys bounds the
// keys of all limits together.
//
// Limiter of limits seen before is one atomic load and one map lookup: no
// lock, no allocation, so it is meant to be called per request (a limit
// just added takes a lock for its first lookups, until the Client's map
// of limits takes it in: after as many lookups of new limits as the
// Client holds limits). Limits are kept for the Client's life: Limiter
// is for a set of plans and overrides, which may be large (30,000 limits,
// one per tenant, are added in about 0.3 s), not a limit computed afresh
// for each request. An invalid limit (or limits
// given twice, or more than MaxLimits) gives a Limiter whose every call
// returns the validation error; after Close, every call returns ErrClosed.
//
// A key moved to another limit (a plan upgrade) is decided by that limit's
// bucket from its next request on: a bucket of its own, full the first
// time it is used. The tokens this instance leased under the old limit are
// never spent under the new one; the janitor gives them back to the old
// bucket when the lease expires (within the lease TTL).
func (c *Client) Limiter(limit policy.Limit, more ...policy.Limit) *Limiter {
	if err := c.missing(); err != nil {
		return &Limiter{err: err} // every call returns err
	}
	return c.e.limiter(limit, more)
}

// missing returns the error of a nil *Client, or a zero one NewClient did
// not make (wrapping ErrClosed: nothing can be decided through it), whose
// methods panicked (a review).
func (c *Client) missing() error {
	switch {
	case c == nil:
		return fmt.Errorf("%w: nil *Client", ErrClosed)
	case c.e == nil:
		return fmt.Errorf("%w: a zero Client (make one with NewClient)", ErrClosed)
	}
	return nil
}

// Close refunds the unused leased tokens of every Limiter of c, waits for
// Redis calls in flight and stops the background goroutine. On a hung
// Redis, a client that applies context deadlines (ContextTimeoutEnabled)
// lets Close return in one to two seconds; one that does not holds it for
// its read timeout (a refund in flight), then for the final refund's, or
// about a second if that is longer (10.6s with go-redis's default 5s), and
// for ever if it has no read timeout either (NewClient warns of such a
// client). Later calls of every Limiter of c return ErrClosed, and so
// does a second Close. The error is that of the final round of
// adjustments, and says how many it could not send: tokens it could not
// return stay debited until their bucket refills (under-admission); a
// charge it could not make (what FailOpen admitted during an outage, a
// Settle's cost above its reservation) is dropped, and those tokens were
// admitted without being counted (counted on
// ratelimit.settle.charges.dropped). Close does not close the Redis
// client.
func (c *Client) Close() error {
	if err := c.missing(); err != nil {
		return err
	}
	return c.e.shutdown()
}

// BreakerState returns the state of the circuit breaker around Redis calls.
// On a Redis Cluster, each master node has its own breaker; this is the most
// severe of their states.
// A nil, zero or closed Client's is Open: no call can reach Redis through
// it (a closed one reported Closed, the state before Close, to a readiness
// probe asking after its decisions had begun to return ErrClosed).
func (c *Client) BreakerState() breaker.State {
	if c.missing() != nil || c.e.path.IsClosed() {
		return breaker.Open
	}
	return c.e.path.State()
}

// LocalKeys returns how many keys c holds local state for, over every
// limit (the table that WithMaxKeys bounds).
func (c *Client) LocalKeys() int {
	if c.missing() != nil {
		return 0
	}
	return c.e.table.Len()
}
