package leaselimit

import (
	"context"
	"errors"
	"log/slog"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/nilclient"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
)

// The API of 0.2, where a Limiter was its engine as well: thin wrappers
// over the Client and its views, kept for one minor release.

// New returns a Limiter that enforces limit per key on a Client of its own
// (see NewClient): its Close closes that Client.
//
// Deprecated: use NewClient(client, opts...) and Client.Limiter(limit);
// Close the Client.
func New(client redis.UniversalClient, limit policy.Limit, opts ...Option) (*Limiter, error) {
	if nilclient.Is(client) {
		return nil, errNoRedisClient
	}
	if err := limit.Validate(); err != nil {
		return nil, err
	}
	c, err := newClient(client, opts)
	if err != nil {
		return nil, err
	}
	l := *c.e.single(limit)
	l.owner = true
	watchClose(&l, c.e)
	return &l, nil
}

// For returns a Limiter that enforces limit (and more, together) on the
// same Client as l, with l's failure policy and enforcement. For of l's own
// limits is l. For of limits seen before allocates nothing.
//
// Deprecated: use Client.Limiter(limit, more...), and With for another
// failure policy or enforcement.
func (l *Limiter) For(limit policy.Limit, more ...policy.Limit) *Limiter {
	if err := l.present(); err != nil {
		return &Limiter{err: err}
	}
	f := l.limiter(limit, more)
	if l.err != nil && f.err == nil && errors.As(l.err, new(optionError)) {
		// A view With refused gives Limiters that refuse too: the view it
		// did not become is not a view to serve (part of it applied, it
		// could shadow every decision and say nothing).
		v := *l.viewOf(f, l.view)
		v.owner, v.err = false, l.err
		return &v
	}
	switch {
	case f.limitSet == l.limitSet && l.err == nil:
		return l
	case f.view != l.view && f.err == nil:
		return l.viewOf(f, l.view) // l is a view of its own: so are the Limiters it gives
	}
	return f
}

// Enforcing returns a view of l that enforces its decisions for share of
// keys and shadows the rest; an invalid share gives a Limiter whose calls
// return the error.
//
// Deprecated: use l.With(WithEnforce(share)).
func (l *Limiter) Enforcing(share float64) *Limiter {
	if err := l.present(); err != nil {
		return &Limiter{err: err}
	}
	if err := validShare("Enforcing", share); err != nil && l.err == nil {
		v := *l
		v.owner, v.err = false, optionError{err}
		return &v
	}
	return l.With(WithEnforce(share))
}

// errCloseView is Close's error on a Limiter that New did not return.
var errCloseView = errors.New("leaselimit: Close on a Limiter that New did not return does nothing: close the Client (or the Limiter from New), which closes every Limiter of its engine")

// Close closes l's Client if New returned l (see Client.Close); on any
// other Limiter it does nothing and returns an error that says so.
//
// Deprecated: use Client.Close.
func (l *Limiter) Close() error {
	if l == nil || !l.owner {
		return errCloseView
	}
	return l.shutdown()
}

// Check is Client.Check of l's Client.
//
// Deprecated: use Client.Check.
func (l *Limiter) Check(ctx context.Context) error {
	if err := l.callable(ctx); err != nil {
		return err
	}
	return l.ready(ctx)
}

// BreakerState is Client.BreakerState of l's Client.
//
// Deprecated: use Client.BreakerState.
func (l *Limiter) BreakerState() breaker.State {
	if l.present() != nil || l.path.IsClosed() {
		return breaker.Open
	}
	return l.path.State()
}

// LocalKeys is Client.LocalKeys of l's Client.
//
// Deprecated: use Client.LocalKeys.
func (l *Limiter) LocalKeys() int {
	if l.present() != nil {
		return 0
	}
	return l.table.Len()
}

// RedisLogger writes go-redis's own log lines to a slog.Logger, throttled.
//
// Deprecated: use telemetry.RedisLogger.
type RedisLogger = telemetry.RedisLogger

// NewRedisLogger returns a RedisLogger writing to out (slog.Default() if
// nil), for redis.SetLogger.
//
// Deprecated: use telemetry.NewRedisLogger.
func NewRedisLogger(out *slog.Logger) *RedisLogger { return telemetry.NewRedisLogger(out) }
