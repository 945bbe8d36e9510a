package leaselimit

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/policy"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Option configures a Client, given to NewClient in order. Three are
// also options of a view (WithFailureMode, WithShadow, WithEnforce): given
// to NewClient they set the default of every Limiter, given to
// Limiter.With they set one view's (see With).
type Option interface {
	apply(*config) error
}

// engineOption is an option of the Client alone: what every Limiter of the
// Client shares (the connection to Redis, leases, telemetry). name is the
// option's name, for With's error.
type engineOption struct {
	name string
	set  func(*config) error
}

func (o engineOption) apply(c *config) error { return optionFailed(o.name, o.set(c)) }

// optionFailed is the error of option name that refused its value with
// err (nil if err is): it names the option and wraps ErrInvalidOption as
// well as err.
func optionFailed(name string, err error) error {
	if err == nil {
		return nil
	}
	return optionError{namedError{name: name, err: err}}
}

// namedError is an option's error, prefixed with the option's name once:
// "leaselimit: WithTimeout: timeout 0s must be > 0".
type namedError struct {
	name string
	err  error
}

func (e namedError) Error() string {
	return "leaselimit: " + e.name + ": " + strings.TrimPrefix(e.err.Error(), "leaselimit: ")
}

func (e namedError) Unwrap() error { return e.err }

// DefaultTimeout is the budget of one authority call (WithTimeout).
const DefaultTimeout = 100 * time.Millisecond

// MinTimeout is the least budget WithTimeout takes. Below it a round trip
// to Redis and the wake-up of the goroutine waiting for it cannot both fit,
// even on one host, so every decision would go to the failure policy (and
// under FailOpen admit everything).
const MinTimeout = time.Millisecond

// MaxTimeout is the most budget WithTimeout takes. A Redis call may be
// resent for up to six budgets (its waiter's hard cap and a budget more),
// and Redis remembers which adjustments it applied (authority.IDLife, two
// minutes) for far longer than the resends of a call on a budget up to it.
// A decision that waits longer for Redis is no longer rate limiting.
const MaxTimeout = 10 * time.Second

// MaxFleetSize is the most instances WithFleetSize takes. A share of a
// limit is computed as (rate + n - 1) / n: a fleet size near math.MaxInt
// overflowed it, and every instance's share under FailLocal was a limit
// of 0 tokens that denied everything (a review), with no error.
const MaxFleetSize = 1 << 20

// Defaults of other options.
const (
	defaultMaxKeys = 100_000      // the bound on the local key table (WithMaxKeys)
	defaultPrefix  = "leaselimit" // the Redis key prefix (WithPrefix)
)

type config struct {
	timeout   time.Duration
	prefix    string
	lease     policy.Lease
	noLease   bool
	leaseSet  bool // WithLease was given
	maxKeys   int
	fleetSize int
	clock     clockSource
	breaker   breaker.Settings

	logger         *slog.Logger
	tracerProvider trace.TracerProvider
	meterProvider  metric.MeterProvider
	events         bool
	redact         func(string) string

	view view // the default view of every Limiter (WithFailureMode, WithShadow, WithEnforce)
}

func defaultConfig() config {
	return config{
		timeout:   DefaultTimeout,
		prefix:    defaultPrefix,
		lease:     policy.DefaultLease(),
		maxKeys:   defaultMaxKeys,
		fleetSize: 1,
		clock:     systemClock{},
		view:      view{mode: policy.FailOpen, enforce: 1},
		// An outage the failure policy answers must be seen: under the
		// default FailOpen, without a line nothing told an operator that
		// every request passed unlimited.
		logger: slog.Default(),
	}
}

// WithTimeout sets the budget for one authority call: the longest a decision
// waits for Redis before the failure policy decides instead. It holds even
// when the Redis client has go-redis's default options (context deadlines
// not honoured on reads, 5 s read timeout). Default DefaultTimeout (100ms).
//
// A call unanswered at the budget is blamed on Redis only if this process is
// keeping up. When the process itself is behind (its goroutines wait an
// eighth of the budget or more to run, Redis has answered a whole
// connection pool's worth of other calls meanwhile, or the call is still
// queued in this process behind batches Redis is answering), the reply may
// have arrived and not been read yet, or the call not been sent: the
// decision keeps waiting, up to 5× the
// budget in all, and a call abandoned then is denied, whatever the failure
// policy (FailOpen's admission would go past the fleet's bound while Redis
// answers), with reason "saturated" and without counting against the
// breaker.
//
// d must be between MinTimeout (1ms) and MaxTimeout (10s). A batch's reply
// is kept in Redis for six budgets and a second, at least 5s, so that a
// resent batch never takes twice: a longer budget keeps more batch keys
// alive (docs/operations.md, "Memory").
func WithTimeout(d time.Duration) Option {
	return engineOption{"WithTimeout", func(c *config) error {
		if d < MinTimeout {
			return fmt.Errorf("leaselimit: timeout %v is below MinTimeout (%v): no Redis call could answer in time, and the failure policy would decide every request", d, MinTimeout)
		}
		if d > MaxTimeout {
			return fmt.Errorf("leaselimit: timeout %v is above MaxTimeout (%v)", d, MaxTimeout)
		}
		c.timeout = d
		return nil
	}}
}

// WithPrefix sets the prefix of every Redis key the Client writes: keys are
// "<prefix>:<limit name>:<rate>/<period>/<burst>:{<digest of the user key>}". 1 to 64 bytes of
// printable ASCII without spaces or braces. Default "leaselimit".
func WithPrefix(p string) Option {
	return engineOption{"WithPrefix", func(c *config) error {
		if err := authority.ValidatePrefix(p); err != nil {
			return fmt.Errorf("leaselimit: %w", err)
		}
		c.prefix = p
		return nil
	}}
}

// WithLease tunes local leases; zero fields take their defaults (see
// policy.Lease). Leases are on by default. It cannot be given with
// WithoutLease.
func WithLease(s policy.Lease) Option {
	return engineOption{"WithLease", func(c *config) error {
		if err := s.Validate(); err != nil {
			return err
		}
		if c.noLease {
			return errLeaseAndNot
		}
		c.lease = s.WithDefaults()
		c.leaseSet = true
		return nil
	}}
}

// WithoutLease selects exact mode: every decision asks Redis, nothing is
// cached locally, and the decisions for a key are exactly those of one
// central token bucket. It cannot be given with WithLease.
func WithoutLease() Option {
	return engineOption{"WithoutLease", func(c *config) error {
		if c.leaseSet {
			return errLeaseAndNot
		}
		c.noLease = true
		return nil
	}}
}

// errLeaseAndNot is the error of WithLease and WithoutLease given together:
// the later silently undid the earlier (exact mode, then leases after all,
// or lease settings dropped; a review).
var errLeaseAndNot = errors.New("leaselimit: WithLease and WithoutLease contradict each other: give one")

// WithMaxKeys bounds the number of keys the Client keeps local state for
// (n must be at least 1; a bound below 64 keeps 64, one per shard). The
// bound is split over 64 shards: when a new key's shard is full, a key of
// that shard not used for a while is evicted (its unused leased tokens are
// refunded), possibly before the whole table is full; when that key still
// holds a live lease, it stays and the new key is decided exactly, as a
// key seen once is, until a lease of the shard ends (at most the lease
// TTL). The metric ratelimit.keys.full counts both: growing, it says the
// bound is short of the keys that repeat. A key gets local state only when
// it repeats: the Client also remembers the keys it was lately asked for,
// in 8 bytes per key of the bound (rounded up to a power of two: 1 MiB by
// default, 8 MiB at most), made when a Limiter with leases first decides.
// Default 100,000.
func WithMaxKeys(n int) Option {
	return engineOption{"WithMaxKeys", func(c *config) error {
		if n < 1 {
			return fmt.Errorf("leaselimit: max keys %d must be >= 1", n)
		}
		c.maxKeys = n
		return nil
	}}
}

// WithFleetSize tells the Client how many instances share its limits; under
// policy.FailLocal each instance enforces 1/n of each limit locally during
// an outage. Default 1; 1 to MaxFleetSize.
func WithFleetSize(n int) Option {
	return engineOption{"WithFleetSize", func(c *config) error {
		if n < 1 {
			return fmt.Errorf("leaselimit: fleet size %d must be >= 1", n)
		}
		if n > MaxFleetSize {
			return fmt.Errorf("leaselimit: fleet size %d is above MaxFleetSize (%d)", n, MaxFleetSize)
		}
		c.fleetSize = n
		return nil
	}}
}

// WithBreaker configures the circuit breaker around Redis calls; zero fields
// take the defaults documented on breaker.Settings.
func WithBreaker(s breaker.Settings) Option {
	return engineOption{"WithBreaker", func(c *config) error {
		if err := s.Validate(); err != nil {
			return err
		}
		c.breaker = s
		return nil
	}}
}

// WithTracerProvider sets the tracer provider for decision spans. Default:
// the global provider (otel.GetTracerProvider); while no SDK is installed
// there, nothing is traced and decisions do not allocate.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return engineOption{"WithTracerProvider", func(c *config) error {
		if tp == nil {
			return fmt.Errorf("leaselimit: nil tracer provider")
		}
		c.tracerProvider = tp
		return nil
	}}
}

// WithMeterProvider sets the meter provider for leaselimit's metrics.
// Default: the global provider (otel.GetMeterProvider).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return engineOption{"WithMeterProvider", func(c *config) error {
		if mp == nil {
			return fmt.Errorf("leaselimit: nil meter provider")
		}
		c.meterProvider = mp
		return nil
	}}
}

// WithDecisionEvents records each decision as an event named
// "ratelimit.decision" on the caller's current span, instead of a child span
// per decision. Default: a child span.
func WithDecisionEvents() Option {
	return engineOption{"WithDecisionEvents", func(c *config) error {
		c.events = true
		return nil
	}}
}

// WithKeyRedactor records redact(key) as the ratelimit.key attribute of
// decision spans and events. By default no form of the key is recorded.
// telemetry.KeyDigest(secret) gives a keyed digest. The key never appears in
// metrics.
func WithKeyRedactor(redact func(key string) string) Option {
	return engineOption{"WithKeyRedactor", func(c *config) error {
		if redact == nil {
			return fmt.Errorf("leaselimit: nil key redactor")
		}
		c.redact = redact
		return nil
	}}
}

// WithLogger writes what an operator must know to log: breaker
// transitions, the failure policy taking over after a healthy period,
// READONLY replies, Redis replies that mean misconfiguration, and an
// instance too saturated to read its replies. Each kind is written at most
// once every 10 seconds per Client, whatever the number of limits: never a
// line per decision, nor per limit. Default: slog.Default()
// as NewClient finds it, so that an outage the failure policy answers is
// never silent; WithLogger(slog.New(slog.DiscardHandler)) turns it off.
// go-redis's own lines (its logger is process-wide, and leaselimit leaves
// it alone) can be routed to the same logger: see telemetry.NewRedisLogger.
func WithLogger(log *slog.Logger) Option {
	return engineOption{"WithLogger", func(c *config) error {
		if log == nil {
			return fmt.Errorf("leaselimit: nil logger")
		}
		c.logger = log
		return nil
	}}
}
