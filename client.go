package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/overload"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/singleflight"
)

// Limiter enforces one token-bucket policy.Limit per key across every
// instance that shares the Redis deployment, the limit name and the prefix.
//
// Redis holds the authoritative bucket of each key, updated by one atomic
// Lua script on Redis's clock. By default the Limiter also keeps a small
// lease of tokens for each busy key: the tokens are debited from the Redis
// bucket when the lease is granted, so most decisions are a local atomic
// operation and the fleet still never admits more than the bucket allows
// over a run. WithoutLease selects exact mode, where every decision is one
// Redis call.
//
// Most callers want Allow (or AllowN for weighted requests); Wait blocks
// until a request is admitted. While Redis is unavailable, decisions follow
// the failure policy (WithFailureMode) and carry SourceFallback; they are not
// errors. A Limiter is safe for concurrent use; Close it to refund leased
// tokens and stop its background goroutine.
type Limiter struct {
	*engine // shared with every Limiter of the same New (see For)

	limit   policy.Limit
	namer   authority.Namer // names limit's buckets
	invalid error           // set by For for an invalid limit: every call returns it
	tel     *telemetry.Recorder
	log     *logger             // nil without WithLogger
	leases  *lease.Leases       // this limit's local decision protocol and state
	calls   *redispath.Caller   // budgeted authority calls
	sf      *singleflight.Group // one refill per key at a time (refill.go)
	group   []*Limiter          // a multi-limit's limits, each its own Limiter (group.go); nil for one limit
	enforce float64             // the share of keys whose decisions are enforced (shadow.go)
}

// New returns a Limiter that enforces limit per key on client, which may be
// any go-redis v9 client: a single node, Sentinel (redis.NewFailoverClient)
// or Cluster. New makes no Redis call, so it neither blocks nor fails when
// Redis is down; decisions follow the failure policy until Redis answers.
//
// The Limiter starts one background goroutine (lease expiry, refunds and
// idle-key eviction); Close stops it. For returns Limiters for other limits
// that share it (see For).
func New(client redis.UniversalClient, limit policy.Limit, opts ...Option) (*Limiter, error) {
	if client == nil {
		return nil, errors.New("leaselimit: nil redis client")
	}
	if err := limit.Validate(); err != nil {
		return nil, err
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
	auth, err := authority.New(client, cfg.prefix)
	if err != nil {
		return nil, fmt.Errorf("leaselimit: %w", err)
	}
	meters, err := telemetry.New(telemetry.Config{
		TracerProvider: cfg.tracerProvider,
		MeterProvider:  cfg.meterProvider,
		LimitName:      limit.Name,
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
		closed: make(chan struct{}, 1),
	}
	e.path = redispath.New(redispath.Config{Client: client, Auth: auth, Budget: cfg.timeout, Name: "leaselimit:" + limit.Name,
		Breaker: e.breakerSettings(), Tel: meters, Closed: ErrClosed, Unavailable: ErrUnavailable})
	e.slots = make(chan struct{}, prefetchSlots(e.path.Pool()))
	// A metric reader may collect at once: the gauges read the breakers
	// and the key table, which exist from here on.
	if err := meters.Observe(e.path.State, func() int64 { return int64(e.table.Len()) }); err != nil {
		return nil, fmt.Errorf("leaselimit: telemetry: %w", err)
	}
	e.refunds = newRefundQueue(auth, e.path, meters, e.clock)
	e.root = e.newLimiter(limit)
	e.limits.LoadOrMake(limit, func() *Limiter { return e.root })
	e.debts = newDebtBook(cfg.maxKeys, meters, e.root.log, e.clock)
	e.janitor = startJanitor(e.table, e.refunds, e.debts, e.closed, e.path, e.root.log, e.clock, cfg.lease.TTL)
	return e.root, nil
}

// Limit returns the limit the Limiter enforces.
func (l *Limiter) Limit() policy.Limit { return l.limit }

// BreakerState returns the state of the circuit breaker around Redis calls.
// On a Redis Cluster, each master node has its own breaker; this is the most
// severe of their states. The breakers are the engine's: every Limiter of
// one New reports the same state.
func (l *Limiter) BreakerState() breaker.State { return l.path.State() }

// LocalKeys returns how many keys the engine holds local state for, over
// every limit of one New (the table that WithMaxKeys bounds).
func (l *Limiter) LocalKeys() int { return l.table.Len() }

// Allow is shorthand for AllowN(ctx, key, 1).
func (l *Limiter) Allow(ctx context.Context, key string) (Decision, error) {
	return l.AllowN(ctx, key, 1)
}

// AllowN reports whether n tokens may be taken for key now, and takes them if
// so (all or nothing; a denial takes nothing). n must be between 1 and the
// limit's Burst, and key 1 to MaxKeyLen bytes; other input returns
// ErrInvalidCost or ErrInvalidKey and touches nothing.
//
// A denial is a Decision with Allowed false, not an error. Errors are
// ErrClosed, the ctx's error when ctx ends before a decision, invalid input,
// leaselimit's own bugs (an unexpected script reply), and Redis replies that
// mean misconfiguration rather than an outage (NOPERM, WRONGTYPE). While Redis is
// unavailable the failure policy decides (SourceFallback, nil error), within
// the time budget of WithTimeout.
func (l *Limiter) AllowN(ctx context.Context, key string, n int64) (Decision, error) {
	var span trace.Span
	if l.tel.Tracing() {
		ctx, span = l.tel.StartDecision(ctx)
	}
	d, err := l.decide(ctx, key, n)
	if err == nil {
		l.tel.CountDecision(ctx, d.Allowed && !d.ShadowDenied, int(d.Source), d.Shadow)
	}
	if span != nil {
		l.tel.EndDecision(span, outcome(d, err, key, n))
	}
	return d, err
}

// decide is one decision as the caller gets it: allowN's, admitted anyway
// for a key in shadow (see WithShadow).
func (l *Limiter) decide(ctx context.Context, key string, n int64) (Decision, error) {
	d, err := l.allowN(ctx, key, n)
	if err == nil && l.enforce < 1 && !l.enforced(key) {
		d = shadowed(d)
	}
	return d, err
}

// outcome describes a finished decision (or its error) for its span.
func outcome(d Decision, err error, key string, n int64) telemetry.Outcome {
	return telemetry.Outcome{Allowed: d.Allowed && !d.ShadowDenied, Shadow: d.Shadow, Source: int(d.Source), Cost: n,
		Remaining: d.Remaining, RetryAfter: d.RetryAfter, Key: key, Err: err, CallerError: callerError(err),
		Reason: errorReason(err)}
}

// errorReason is ratelimit.reason of a decision that ended with err.
func errorReason(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrInvalidKey):
		return "invalid_key"
	case errors.Is(err, ErrInvalidCost):
		return "invalid_cost"
	case errors.Is(err, policy.ErrInvalidLimit):
		return "invalid_limit"
	case errors.Is(err, ErrClosed):
		return "closed"
	case errors.Is(err, ErrWouldExceedDeadline):
		return "would_exceed_deadline"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline_exceeded"
	}
	return "redis_error" // a reply that is neither a decision nor an outage, or our own bug
}

// callerError reports errors that are the caller's doing (bad input, its
// context ending, a closed Limiter, a deadline too short to wait): not
// failures of leaselimit or Redis, so not marked as span errors.
func callerError(err error) bool {
	return errors.Is(err, ErrInvalidKey) || errors.Is(err, ErrInvalidCost) || errors.Is(err, ErrClosed) || errors.Is(err, policy.ErrInvalidLimit) ||
		errors.Is(err, ErrWouldExceedDeadline) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// recording returns the decision span in ctx if it is recording, so that
// attributes are built only when someone will see them.
func recording(ctx context.Context) (trace.Span, bool) {
	sp := trace.SpanFromContext(ctx)
	return sp, sp.IsRecording()
}

// route returns the breaker for key and, on a Cluster (where finding the
// breaker needs it), key's Redis key; elsewhere rkey is "" and is built only
// when a Redis call is to be made, so breaker-open decisions stay cheap.
func (l *Limiter) route(key string) (brk *breaker.Breaker, rkey string) {
	if l.path.Cluster() == nil {
		return l.path.Shared(), ""
	}
	rkey = l.namer.Key(key)
	return l.path.Route(rkey), rkey
}

// allowN is one decision: validated, then made by the lease protocol (or,
// in exact mode, by Redis), asking Redis when the protocol says so.
func (l *Limiter) allowN(ctx context.Context, key string, n int64) (Decision, error) {
	if err := l.usable(); err != nil {
		return Decision{Source: SourceNone}, err
	}
	// While a Redis reply is overdue because this process is behind, each
	// decision gives up the processor once, so that callers which never
	// block cannot starve the goroutine carrying that reply.
	overload.Yield()
	if err := l.check(key, n); err != nil {
		return Decision{Source: SourceNone}, err
	}
	if l.cfg.noLease {
		return l.allowExact(ctx, key, n) // a multi-limit's too: callExact takes from every bucket
	}
	a := l.leases.Decide(key, n, l.clock.now())
	switch a.Status {
	case lease.Leased:
		if a.Prefetch {
			l.prefetch(ctx, a.Ticket)
		}
		if l.group != nil {
			return l.decided(a), nil
		}
		return admitted(l.limit, a.Remaining, SourceLease), nil
	case lease.Cached:
		if l.group != nil {
			return l.decided(a), nil
		}
		return denial(l.limit, a.Remaining, a.RetryAfter, SourceCache), nil
	}
	return l.miss(ctx, key, n, a)
}

// usable returns the error every call of l returns before it does
// anything: the invalid limit For was given, or ErrClosed.
func (l *Limiter) usable() error {
	if l.invalid != nil {
		return l.invalid
	}
	if l.path.IsClosed() {
		return ErrClosed
	}
	return nil
}

// maxCost is the most tokens one request may take: the least Burst of the
// Limiter's limits.
func (l *Limiter) maxCost() int64 {
	n := l.limit.Burst
	for _, p := range l.group {
		n = min(n, p.limit.Burst)
	}
	return n
}

func (l *Limiter) check(key string, n int64) error {
	if err := checkKey(key); err != nil {
		return err
	}
	if n < 1 || n > l.limit.Burst {
		return fmt.Errorf("%w: n = %d, want 1 <= n <= burst %d", ErrInvalidCost, n, l.limit.Burst)
	}
	for _, p := range l.group {
		if n > p.limit.Burst {
			return fmt.Errorf("%w: n = %d, want 1 <= n <= burst %d of %s", ErrInvalidCost, n, p.limit.Burst, p.limit.Name)
		}
	}
	return nil
}

// checkKey returns ErrInvalidKey for a key outside 1 to MaxKeyLen bytes.
func checkKey(key string) error {
	if len(key) == 0 || len(key) > MaxKeyLen {
		return fmt.Errorf("%w: length %d, want 1 to %d bytes", ErrInvalidKey, len(key), MaxKeyLen)
	}
	return nil
}

// Wait is shorthand for WaitN(ctx, key, 1).
func (l *Limiter) Wait(ctx context.Context, key string) error {
	return l.WaitN(ctx, key, 1)
}

// WaitN blocks until n tokens for key are admitted, ctx ends, or the Limiter
// is closed. It fails fast, without waiting, for invalid input (n above the
// burst can never be admitted) and with ErrWouldExceedDeadline when a denial's
// RetryAfter reaches past ctx's deadline.
func (l *Limiter) WaitN(ctx context.Context, key string, n int64) (err error) {
	var d Decision
	if l.tel.Tracing() {
		var span trace.Span
		ctx, span = l.tel.StartDecision(ctx)
		defer func() { l.tel.EndDecision(span, outcome(d, err, key, n)) }()
	}
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		d, err = l.decide(ctx, key, n)
		if err != nil {
			return err
		}
		l.tel.CountDecision(ctx, d.Allowed && !d.ShadowDenied, int(d.Source), d.Shadow)
		if d.Allowed {
			return nil
		}
		wait := d.RetryAfter
		// ctx's deadline is on the real clock, and so is the timer below:
		// compare the wait with it there, whatever WithClock says.
		if dl, ok := ctx.Deadline(); ok && time.Now().Add(wait).After(dl) {
			return fmt.Errorf("%w: retry after %v", ErrWouldExceedDeadline, wait)
		}
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		select {
		case <-timer.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// errCloseFor is Close's error on a Limiter from For.
var errCloseFor = errors.New("leaselimit: Close on a Limiter from For does nothing: close the Limiter from New, which closes every Limiter of its engine")

// Close refunds the unused leased tokens, waits for Redis calls in flight
// (at most the client's read timeout on a hung Redis) and stops the
// background goroutine. Later calls return ErrClosed. The error is that of
// the final refund: tokens it could not return stay debited until their
// bucket refills, which never over-admits.
//
// Close on the Limiter from New closes every Limiter that For made from it
// (they share one engine). Close on a Limiter from For does nothing and
// returns an error that says so.
func (l *Limiter) Close() error {
	if l != l.root {
		return errCloseFor
	}
	if !l.path.Close() {
		return ErrClosed
	}
	defer l.meters.Close()
	l.janitor.halt()
	l.path.Wait()
	l.refunds.addReturns(l.table.Drain()...)
	l.debts.move(l.refunds, l.path, true)
	return l.refunds.final()
}
