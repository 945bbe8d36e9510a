package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/overload"
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
	limit policy.Limit
	cfg   config
	auth  *authority.Redis
	brk   *breakers
	table *lease.Table
	sizer lease.Sizer
	local policy.Limit // FailLocal's per-instance share
	share float64
	sf    singleflight.Group
	// direct: the client honours context deadlines (ContextTimeoutEnabled),
	// so Redis calls run in the caller's goroutine bounded by a context.
	direct bool
	// pool is the client's connection pool size (see authorize).
	pool int
	// bg holds a slot per background refill in flight (see prefetch).
	bg  chan struct{}
	tel *telemetry.Recorder
	log *logger // nil without WithLogger

	origin time.Time

	mu     sync.RWMutex // guards closed against wg.Add
	closed atomic.Bool
	wg     sync.WaitGroup // authority calls and prefetches in flight
	stop   chan struct{}
	done   chan struct{} // janitor exited

	rqMu       sync.Mutex
	rq         []authority.Refund // refunds waiting for the janitor
	maxRefunds int                // bound on rq (maxQueuedRefunds; tests lower it)
}

// maxQueuedRefunds bounds the refunds waiting for Redis. Past it, refunds
// are dropped: their tokens stay debited until the bucket refills (which
// only under-admits), counted by ratelimit.lease.refunds.dropped.
const maxQueuedRefunds = 100_000

// New returns a Limiter that enforces limit per key on client, which may be
// any go-redis v9 client: a single node, Sentinel (redis.NewFailoverClient)
// or Cluster. New makes no Redis call, so it neither blocks nor fails when
// Redis is down; decisions follow the failure policy until Redis answers.
//
// The Limiter starts one background goroutine (lease expiry, refunds and
// idle-key eviction); Close stops it.
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
	auth, err := authority.New(client, cfg.prefix)
	if err != nil {
		return nil, fmt.Errorf("leaselimit: %w", err)
	}
	if err := cfg.breaker.Validate(); err != nil {
		return nil, fmt.Errorf("leaselimit: %w", err)
	}
	table := lease.NewTable(cfg.maxKeys)
	local := lease.Share(limit, cfg.fleetSize)
	table.SetKeep(func(e *lease.Entry, now int64) bool {
		// A FailLocal bucket is kept until it has refilled, so an idle key
		// does not get a fresh burst in the middle of an outage.
		b := e.LocalBucket()
		return b != nil && !b.Full(local, now)
	})
	tel, err := telemetry.New(telemetry.Config{
		TracerProvider: cfg.tracerProvider,
		MeterProvider:  cfg.meterProvider,
		LimitName:      limit.Name,
		Events:         cfg.events,
		Redact:         cfg.redact,
	})
	if err != nil {
		return nil, fmt.Errorf("leaselimit: telemetry: %w", err)
	}
	bs := cfg.breaker
	bs.Now = cfg.clock.Now // one clock for retry-afters (WithClock)
	user := bs.OnStateChange
	bs.OnStateChange = func(from, to breaker.State) {
		tel.CountTransition(stateIndex(to))
		if user != nil {
			user(from, to)
		}
	}
	brk := newBreakers(client, "leaselimit:"+limit.Name, bs)
	// The gauges' callback reads the breakers and the table: register it
	// only now that both exist (a metric reader may collect at once).
	if err := tel.Observe(func() int64 { return int64(stateIndex(brk.worst())) },
		func() int64 { return int64(table.Len()) }); err != nil {
		return nil, fmt.Errorf("leaselimit: telemetry: %w", err)
	}
	l := &Limiter{
		limit:      limit,
		cfg:        cfg,
		auth:       auth,
		brk:        brk,
		tel:        tel,
		log:        newLogger(cfg.logger, limit.Name),
		table:      table,
		sizer:      lease.NewSizer(limit, cfg.lease),
		local:      local,
		share:      cfg.lease.MaxShare,
		direct:     honoursDeadlines(client),
		pool:       poolSize(client),
		bg:         make(chan struct{}, prefetchSlots(poolSize(client))),
		origin:     cfg.clock.Now(),
		maxRefunds: maxQueuedRefunds,
		stop:       make(chan struct{}),
		done:       make(chan struct{}),
	}
	brk.spawn = l.spawn
	go l.janitor()
	return l, nil
}

// honoursDeadlines reports whether client applies context deadlines to its
// network reads and writes (go-redis's ContextTimeoutEnabled option). Only
// then can a call be bounded by its context alone; otherwise a hung Redis
// holds a read for the client's ReadTimeout (3s by default) and the Limiter
// waits for each call in a separate goroutine instead.
func honoursDeadlines(client redis.UniversalClient) bool {
	switch c := client.(type) {
	case *redis.Client:
		return c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		return c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		return c.Options().ContextTimeoutEnabled
	}
	return false
}

// prefetchSlots is how many background refills of a Limiter may run at
// once: half the client's connection pool (one node's pool on a Cluster; the
// slots are shared by all nodes), so that prefetches of many keys coming due
// together never queue on the pool ahead of callers that wait for a refill.
// A prefetch finding no slot is skipped; the key refills on a later hit or a
// miss. A slot is freed when its prefetch stops waiting (at the latest at
// the time budget), so against a slow Redis more calls than this can still
// be outstanding.
func prefetchSlots(pool int) int { return max(pool/2, 1) }

// poolSize is the client's connection pool size (one node's on a Cluster).
func poolSize(client redis.UniversalClient) int {
	pool := 0
	switch c := client.(type) {
	case *redis.Client:
		pool = c.Options().PoolSize
	case *redis.ClusterClient:
		pool = c.Options().PoolSize
	case *redis.Ring:
		pool = c.Options().PoolSize
	}
	if pool <= 0 {
		pool = 10 * runtime.GOMAXPROCS(0) // go-redis's default
	}
	return pool
}

// Limit returns the limit the Limiter enforces.
func (l *Limiter) Limit() policy.Limit { return l.limit }

// BreakerState returns the state of the circuit breaker around Redis calls.
// On a Redis Cluster, each master node has its own breaker; this is the most
// severe of their states.
func (l *Limiter) BreakerState() breaker.State { return l.brk.worst() }

// LocalKeys returns how many keys the Limiter holds local state for.
func (l *Limiter) LocalKeys() int { return l.table.Len() }

// now returns the local monotonic time in nanoseconds since the Limiter was made.
func (l *Limiter) now() int64 { return l.mono(l.cfg.clock.Now()) }

// mono converts a clock reading to the Limiter's local monotonic time.
func (l *Limiter) mono(t time.Time) int64 { return int64(t.Sub(l.origin)) }

// enter registers a goroutine or call that Close must wait for. It fails
// once Close has begun.
func (l *Limiter) enter() bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.closed.Load() {
		return false
	}
	l.wg.Add(1)
	return true
}

// spawn runs f in a goroutine that Close waits for; it fails once Close has
// begun.
func (l *Limiter) spawn(f func()) bool {
	if !l.enter() {
		return false
	}
	go func() {
		defer l.wg.Done()
		f()
	}()
	return true
}

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
	d, err := l.allowN(ctx, key, n)
	if err == nil {
		l.tel.CountDecision(ctx, d.Allowed, int(d.Source))
	}
	if span != nil {
		l.tel.EndDecision(span, outcome(d, err, key, n))
	}
	return d, err
}

func outcome(d Decision, err error, key string, n int64) telemetry.Outcome {
	return telemetry.Outcome{Allowed: d.Allowed, Source: int(d.Source), Cost: n,
		Remaining: d.Remaining, RetryAfter: d.RetryAfter, Key: key, Err: err}
}

// stateIndex maps a breaker state to telemetry's 0 closed, 1 half-open, 2 open.
func stateIndex(s breaker.State) int {
	switch s {
	case breaker.HalfOpen:
		return 1
	case breaker.Open:
		return 2
	}
	return 0
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
	if l.brk.cluster == nil {
		return l.brk.one, ""
	}
	rkey = l.auth.Key(l.limit, key)
	return l.brk.forKey(rkey, l.cfg.timeout), rkey
}

func (l *Limiter) allowN(ctx context.Context, key string, n int64) (Decision, error) {
	if l.closed.Load() {
		return Decision{Source: SourceNone}, ErrClosed
	}
	// While a Redis reply is overdue because this process is behind, each
	// decision gives up the processor once, so that callers which never
	// block cannot starve the goroutine carrying that reply.
	overload.Yield()
	if err := l.check(key, n); err != nil {
		return Decision{Source: SourceNone}, err
	}
	if l.cfg.noLease {
		return l.allowExact(ctx, key, n)
	}
	now := l.now()
	e := l.table.Get(key)
	if e != nil {
		if ok, left := e.Take(n, now); ok {
			if e.NeedsPrefetch(left) {
				l.prefetch(ctx, e)
			}
			return l.leaseDecision(e, left, SourceLease), nil
		}
		if denied, wait := l.sizer.Denied(e, n, now); denied {
			e.Touch(now)
			return l.denial(e.Remote(), wait, SourceCache), nil
		}
	}
	return l.allowMiss(ctx, key, e, n, now)
}

func (l *Limiter) check(key string, n int64) error {
	if len(key) == 0 || len(key) > MaxKeyLen {
		return fmt.Errorf("%w: length %d, want 1 to %d bytes", ErrInvalidKey, len(key), MaxKeyLen)
	}
	if n < 1 || n > l.limit.Burst {
		return fmt.Errorf("%w: n = %d, want 1 <= n <= burst %d", ErrInvalidCost, n, l.limit.Burst)
	}
	return nil
}

func (l *Limiter) leaseDecision(e *lease.Entry, left int64, src Source) Decision {
	rem := left + e.Reserved() + e.Remote()
	if rem > l.limit.Burst {
		rem = l.limit.Burst
	}
	return Decision{
		Allowed:    true,
		Limit:      l.limit,
		Remaining:  rem,
		ResetAfter: l.limit.Interval(l.limit.Burst - rem),
		Source:     src,
	}
}

func (l *Limiter) denial(remaining int64, retry time.Duration, src Source) Decision {
	if retry <= 0 {
		retry = time.Microsecond
	}
	return Decision{
		Limit:      l.limit,
		Remaining:  remaining,
		RetryAfter: retry,
		ResetAfter: l.limit.Interval(l.limit.Burst - remaining),
		Source:     src,
	}
}

func (l *Limiter) fromGrant(g authority.Grant, src Source) Decision {
	d := Decision{
		Allowed:    g.Granted > 0,
		Limit:      l.limit,
		Remaining:  g.Remaining,
		RetryAfter: g.RetryAfter,
		ResetAfter: g.ResetAfter,
		Source:     src,
	}
	if !d.Allowed && d.RetryAfter <= 0 {
		d.RetryAfter = time.Microsecond
	}
	return d
}

// allowExact asks Redis for exactly n tokens.
func (l *Limiter) allowExact(ctx context.Context, key string, n int64) (Decision, error) {
	brk, rkey := l.route(key)
	if wall := l.cfg.clock.Now(); brk.Rejects(wall) {
		return l.fallback(ctx, brk, key, nil, n, l.mono(wall), wall, telemetry.ReasonBreakerOpen), nil
	}
	return l.callExact(ctx, brk, rkey, key, nil, n)
}

// callExact asks Redis for exactly n tokens of key outside any lease; a
// grant that arrives after the caller left is refunded. e, if not nil, is
// key's entry, for the failure policy.
func (l *Limiter) callExact(ctx context.Context, brk *breaker.Breaker, rkey, key string, e *lease.Entry, n int64) (Decision, error) {
	if rkey == "" {
		rkey = l.auth.Key(l.limit, key)
	}
	g, err := l.authorize(ctx, brk, rkey, n, n, 1, func(late authority.Grant) {
		// The caller left before the grant arrived: give the tokens back.
		l.queueRefund(rkey, late.Granted)
	})
	if err != nil {
		return l.onError(ctx, brk, key, e, n, err)
	}
	return l.fromGrant(g, SourceAuthority), nil
}

// onError turns an authority error into the caller's result: an error for
// ctx ending, Close and our own bugs; the failure policy's decision for an
// unavailable Redis.
func (l *Limiter) onError(ctx context.Context, brk *breaker.Breaker, key string, e *lease.Entry, n int64, err error) (Decision, error) {
	switch {
	case errors.Is(err, ErrClosed):
		return Decision{Source: SourceNone}, ErrClosed
	case errors.Is(err, authority.ErrScript), errors.Is(err, authority.ErrReply):
		return Decision{Source: SourceNone}, fmt.Errorf("leaselimit: %w", err)
	case errors.Is(err, errSaturated):
		// Redis may be fine; this process could not read its reply in time.
		wall := l.cfg.clock.Now()
		return l.fallback(ctx, brk, key, e, n, l.mono(wall), wall, telemetry.ReasonSaturated), nil
	case ctx.Err() != nil && !errors.Is(err, breaker.ErrBudget) && !errors.Is(err, breaker.ErrOpen):
		return Decision{Source: SourceNone}, ctx.Err()
	case !breaker.Counts(err) && !errors.Is(err, breaker.ErrOpen) && !breaker.Excluded(err):
		// Redis answered, but not with a decision: NOPERM (an ACL that is
		// too narrow), WRONGTYPE (another program's key under our prefix)
		// and the like. That is misconfiguration, not an outage: say so
		// rather than let the failure policy hide it.
		l.log.misconfig(err)
		return Decision{Source: SourceNone}, fmt.Errorf("leaselimit: redis: %w", err)
	}
	if strings.HasPrefix(err.Error(), "READONLY") {
		l.log.readonly(err)
	}
	reason := telemetry.ReasonError
	switch {
	case errors.Is(err, breaker.ErrOpen):
		reason = telemetry.ReasonBreakerOpen
	case errors.Is(err, breaker.ErrBudget), errors.Is(err, context.DeadlineExceeded):
		reason = telemetry.ReasonTimeout
	}
	wall := l.cfg.clock.Now()
	return l.fallback(ctx, brk, key, e, n, l.mono(wall), wall, reason), nil
}

// allowMiss handles a key with no usable lease: one coalesced refill per key
// asks Redis for the tokens every waiting caller needs plus a lease.
func (l *Limiter) allowMiss(ctx context.Context, key string, e *lease.Entry, n, now int64) (Decision, error) {
	if e == nil || e.Removed() {
		e = l.getOrCreate(key, now)
	}
	brk, rkey := l.route(key)
	if wall := l.cfg.clock.Now(); brk.Rejects(wall) {
		return l.fallback(ctx, brk, key, e, n, now, wall, telemetry.ReasonBreakerOpen), nil
	}
	return l.missRefill(ctx, brk, rkey, key, e, n)
}

// missRefill waits for a coalesced refill of e and takes n from it.
func (l *Limiter) missRefill(ctx context.Context, brk *breaker.Breaker, rkey, key string, e *lease.Entry, n int64) (Decision, error) {
	if rkey == "" {
		rkey = l.auth.Key(l.limit, key)
	}
	var now int64
	for attempt := 0; attempt < 4; attempt++ {
		e.AddPending(n)
		ch := l.sf.DoChan(key, func() (any, error) { return l.refill(ctx, brk, rkey, e) })
		var r singleflight.Result
		select {
		case r = <-ch:
		case <-ctx.Done():
			// The refill goes on; what it brings for us stays in the lease.
			return Decision{Source: SourceNone}, ctx.Err()
		}
		if sp, ok := recording(ctx); ok {
			sp.SetAttributes(telemetry.AttrCoalesced.Bool(r.Shared), telemetry.AttrBreaker.String(brk.State().String()))
		}
		if r.Err != nil {
			return l.onError(ctx, brk, key, e, n, r.Err)
		}
		out := r.Val.(lease.Outcome)
		now = l.now()
		if e.TakeReserved(n) {
			return l.leaseDecision(e, e.Tokens(), SourceAuthority), nil
		}
		if ok, left := e.Take(n, now); ok {
			return l.leaseDecision(e, left, SourceAuthority), nil
		}
		if out.Granted == 0 {
			retry := out.RetryAfter
			if out.Min < n {
				retry += l.limit.Interval(n - out.Min)
			}
			return l.denial(out.Remaining, retry, SourceAuthority), nil
		}
		// Tokens came, but concurrent callers took them first: ask again.
		if denied, wait := l.sizer.Denied(e, n, now); denied {
			return l.denial(e.Remote(), wait, SourceCache), nil
		}
		if e.Removed() {
			e = l.getOrCreate(key, now)
		}
	}
	// Four times the shared refill's tokens went to others first: ask Redis for
	// exactly our n, outside the lease, so a busy key never denies a request
	// the bucket can serve.
	return l.callExact(ctx, brk, rkey, key, e, n)
}

// getOrCreate returns key's entry, refunding the tokens of any entry evicted
// to make room.
func (l *Limiter) getOrCreate(key string, now int64) *lease.Entry {
	e, ev := l.table.GetOrCreate(key, now)
	if ev != nil {
		if t := ev.Drain(); t > 0 {
			l.refundEntry(ev, t)
		}
	}
	return e
}

// refill is the shared work of one coalesced miss or prefetch of e.
// ctx is the context of the caller that started it, used only for its
// values (the trace); the call itself is bounded by the time budget.
func (l *Limiter) refill(ctx context.Context, brk *breaker.Breaker, rkey string, e *lease.Entry) (any, error) {
	req := l.sizer.Plan(e, l.now())
	install := func(g authority.Grant) lease.Outcome {
		o := lease.Outcome{Granted: g.Granted, Remaining: g.Remaining, RetryAfter: g.RetryAfter, Min: req.Min}
		if back := l.sizer.Install(e, req, o, l.now()); back > 0 {
			l.queueRefund(rkey, back)
		}
		return o
	}
	share := l.share
	if req.Whole {
		share = 1
	}
	g, err := l.authorize(context.WithoutCancel(ctx), brk, rkey, req.Want, req.Min, share, func(late authority.Grant) {
		install(late)
	})
	if err != nil {
		return nil, err
	}
	return install(g), nil
}

// prefetch refills e in the background before its lease runs dry.
func (l *Limiter) prefetch(ctx context.Context, e *lease.Entry) {
	select {
	case l.bg <- struct{}{}:
	default:
		e.PrefetchDone()
		return
	}
	if !l.enter() {
		<-l.bg
		e.PrefetchDone()
		return
	}
	go func() {
		defer l.wg.Done()
		defer func() { <-l.bg }()
		defer e.PrefetchDone()
		rkey := l.auth.Key(l.limit, e.Key())
		brk := l.brk.forKey(rkey, l.cfg.timeout)
		if brk.Rejects(l.cfg.clock.Now()) {
			return
		}
		_, _, _ = l.sf.Do(e.Key(), func() (any, error) { return l.refill(ctx, brk, rkey, e) })
	}()
}

// fallback is the failure policy's decision for key. Leases already held
// keep serving until they expire.
// now is the local monotonic time (see Limiter.now) and wall the clock
// reading it came from, read once by the caller.
func (l *Limiter) fallback(ctx context.Context, brk *breaker.Breaker, key string, e *lease.Entry, n, now int64, wall time.Time, reason string) Decision {
	l.tel.CountFallback(ctx, reason)
	l.log.fallback(l.cfg.mode.String(), reason)
	if sp, ok := recording(ctx); ok {
		sp.SetAttributes(telemetry.AttrReason.String(reason), telemetry.AttrBreaker.String(brk.State().String()))
	}
	if e == nil && (!l.cfg.noLease || l.cfg.mode == policy.FailLocal) {
		e = l.table.Get(key)
	}
	if e != nil && !l.cfg.noLease {
		if ok, left := e.Take(n, now); ok {
			return l.leaseDecision(e, left, SourceLease)
		}
	}
	switch l.cfg.mode {
	case policy.FailClosed:
		return l.denial(0, l.untilProbe(brk, wall), SourceFallback)
	case policy.FailLocal:
		if e == nil {
			e = l.getOrCreate(key, now)
		}
		e.Touch(now)
		ok, rem, retry := e.Local().Allow(l.local, n, now)
		if retry == lease.Never {
			// Above this instance's share: wait for Redis to come back.
			retry = l.untilProbe(brk, wall)
		}
		// The share decided: report it as the Limit, and its ResetAfter.
		d := Decision{Allowed: ok, Limit: l.local, Remaining: rem,
			ResetAfter: l.local.Interval(l.local.Burst - rem), Source: SourceFallback}
		if !ok {
			d.RetryAfter = max(retry, time.Microsecond)
		}
		return d
	}
	// FailOpen. Remaining is the best knowledge: what Redis last said for a
	// key seen before, else a full bucket.
	rem := l.limit.Burst
	if e != nil && e.Remote() > 0 {
		rem = min(e.Remote()+e.Tokens(), l.limit.Burst)
	}
	return Decision{Allowed: true, Limit: l.limit, Remaining: rem,
		ResetAfter: l.limit.Interval(l.limit.Burst - rem), Source: SourceFallback}
}

// untilProbe is the RetryAfter of a fallback denial: until the breaker lets
// a probe through, at least the time budget.
func (l *Limiter) untilProbe(brk *breaker.Breaker, wall time.Time) time.Duration {
	retry := time.Duration(0)
	if u := brk.OpenUntil(); !u.IsZero() {
		retry = u.Sub(wall)
	}
	if retry < l.cfg.timeout {
		retry = l.cfg.timeout
	}
	return retry
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
		d, err = l.allowN(ctx, key, n)
		if err != nil {
			return err
		}
		l.tel.CountDecision(ctx, d.Allowed, int(d.Source))
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

// refundEntry queues n unused tokens of e's lease for refunding.
func (l *Limiter) refundEntry(e *lease.Entry, n int64) {
	l.queueRefund(l.auth.Key(l.limit, e.Key()), n)
}

// queueRefund records n unused tokens of rkey's bucket for the janitor to
// give back in its next batch.
func (l *Limiter) queueRefund(rkey string, n int64) {
	if n <= 0 {
		return
	}
	l.rqMu.Lock()
	if len(l.rq) >= l.maxRefunds {
		l.rqMu.Unlock()
		l.tel.CountDroppedRefund(context.Background(), n)
		return
	}
	l.rq = append(l.rq, authority.Refund{Key: rkey, Limit: l.limit, Tokens: n})
	l.rqMu.Unlock()
}

func (l *Limiter) takeRefunds() []authority.Refund {
	l.rqMu.Lock()
	defer l.rqMu.Unlock()
	rq := l.rq
	l.rq = nil
	return rq
}

// janitor expires leases, evicts idle keys and sends refunds in batches.
func (l *Limiter) janitor() {
	defer close(l.done)
	every := l.cfg.lease.TTL / 4
	if every < 5*time.Millisecond {
		every = 5 * time.Millisecond
	}
	if every > 250*time.Millisecond {
		every = 250 * time.Millisecond
	}
	t := time.NewTicker(every)
	defer t.Stop()
	idle := int64(l.cfg.lease.IdleTTL)
	for {
		select {
		case <-l.stop:
			return
		case <-t.C:
		}
		l.log.breakerState(l.brk.worst())
		l.table.Sweep(l.now(), idle, func(e *lease.Entry, n int64) {
			l.refundEntry(e, n)
		})
		l.flushRefunds()
	}
}

// flushRefunds sends the queued refunds in one pipeline per breaker (per
// master node on a Cluster; go-redis splits a pipeline by node anyway).
// Refunds whose node is unavailable (the breaker holds calls back) are kept
// for the next round; refunds whose pipeline failed once sent are dropped,
// never sent again, so none is applied twice (see authority.Redis.Refund).
func (l *Limiter) flushRefunds() {
	rq := l.takeRefunds()
	if len(rq) == 0 {
		return
	}
	groups := map[*breaker.Breaker][]authority.Refund{}
	for _, r := range rq {
		brk := l.brk.forKey(r.Key, l.cfg.timeout)
		groups[brk] = append(groups[brk], r)
	}
	now := l.cfg.clock.Now()
	for brk, g := range groups {
		if brk.Rejects(now) {
			l.requeue(g) // keep them until Redis is back
			continue
		}
		done, err := brk.Allow()
		if err != nil {
			l.requeue(g)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), l.cfg.timeout)
		err = l.auth.Refund(ctx, g)
		cancel()
		if err != nil && errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("%w: %w", breaker.ErrBudget, err)
		}
		done(err)
		if err != nil {
			// Sent, outcome unknown: a refund may have been applied
			// before the error. Sending it again could give its tokens
			// back twice (over-admission); dropping it can only leave
			// them debited until the bucket refills.
			l.dropRefunds(g)
			continue
		}
		l.countRefunds(g)
	}
}

func (l *Limiter) countRefunds(rq []authority.Refund) {
	var n int64
	for _, r := range rq {
		n += r.Tokens
	}
	l.tel.CountRefund(context.Background(), n)
}

// dropRefunds counts rq as dropped: their tokens stay debited.
func (l *Limiter) dropRefunds(rq []authority.Refund) {
	var n int64
	for _, r := range rq {
		n += r.Tokens
	}
	l.tel.CountDroppedRefund(context.Background(), n)
}

func (l *Limiter) requeue(rq []authority.Refund) {
	l.rqMu.Lock()
	defer l.rqMu.Unlock()
	if len(l.rq)+len(rq) > l.maxRefunds {
		var n int64
		for _, r := range rq {
			n += r.Tokens
		}
		l.tel.CountDroppedRefund(context.Background(), n)
		return
	}
	l.rq = append(l.rq, rq...)
}

// Close refunds the unused leased tokens, waits for Redis calls in flight
// (at most the client's read timeout on a hung Redis) and stops the
// background goroutine. Later calls return ErrClosed. The error is that of
// the final refund: tokens it could not return stay debited until their
// bucket refills, which never over-admits.
func (l *Limiter) Close() error {
	l.mu.Lock()
	if l.closed.Load() {
		l.mu.Unlock()
		return ErrClosed
	}
	l.closed.Store(true)
	l.mu.Unlock()
	close(l.stop)
	<-l.done
	l.wg.Wait()
	l.table.Drain(func(e *lease.Entry, n int64) {
		l.refundEntry(e, n)
	})
	defer l.tel.Close()
	rq := l.takeRefunds()
	if len(rq) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.timeout)
	defer cancel()
	if err := l.auth.Refund(ctx, rq); err != nil {
		return fmt.Errorf("leaselimit: refund on close: %w", err)
	}
	l.countRefunds(rq)
	return nil
}
