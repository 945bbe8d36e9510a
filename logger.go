package leaselimit

import (
	"log/slog"
	"time"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/throttle"
	"github.com/leaselimit/leaselimit/policy"
)

// logEvery is the least time between two lines of one kind: leaselimit logs
// what an operator must know (the breaker moved, the failure policy took
// over, Redis replied with misconfiguration), never a line per decision.
const logEvery = 10 * time.Second

// The kinds of lines, each rate-limited on its own.
const (
	// The failure policy decides: a kind per policy (logFallback plus the
	// FailureMode), so that an operator hears of each that took over (a
	// review: views under FailOpen, FailClosed and FailLocal logged one
	// line, naming one of them).
	logFallback  = iota
	_            // FailClosed
	_            // FailLocal
	logMisconfig // Redis replied with an error that is not an outage
	logReadonly  // READONLY: a failover, or a replica by mistake
	logSaturated // a call given up while this process was behind
	logBreaker   // the breaker opened (closing is always logged)
	logUncharged // a failure policy's admission found the debt book full
	logInvalid   // a Limiter was made that refuses every call
	logKinds
)

// logger writes operational events to a slog.Logger (see WithLogger): a
// set of limits' (limit=<names>) or the engine's own, for what concerns no
// one limit (prefix=<key prefix>: the breakers, the debt book). A nil
// *logger logs nothing.
type logger struct {
	out   *slog.Logger
	whose slog.Attr     // limit=… or prefix=…
	last  *logTimes     // the engine's: shared by its loggers
	state breaker.State // last breaker state logged; the janitor's alone
}

// logTimes holds the unix ns of the last line of each kind, for all the
// loggers of one engine: a line per limit would be a line per tenant of a
// service that makes a limit per tenant (2,000 lines in 0.6 s for 2,000
// limits during an outage, in a review).
type logTimes [logKinds]throttle.Gate

func newLogger(out *slog.Logger, last *logTimes, key, value string) *logger {
	if out == nil {
		return nil
	}
	return &logger{out: out, last: last, whose: slog.String(key, value)}
}

// forLimit returns the logger of a set of limits named name: the engine's
// output and times (a nil *logger logs nothing).
func (g *logger) forLimit(name string) *logger {
	if g == nil {
		return nil
	}
	return &logger{out: g.out, last: g.last, whose: slog.String("limit", name)}
}

// due reports whether a line of kind may be written now, and claims it.
func (g *logger) due(kind int) bool {
	return g.last[kind].Due(logEvery)
}

// fallback logs that the failure policy mode decided, at most once per
// logEvery for each mode.
func (g *logger) fallback(mode policy.FailureMode, reason string) {
	kind := logFallback + int(mode)
	if mode.Validate() != nil {
		kind = logFallback // not reached: a view's mode is validated
	}
	if g == nil || !g.due(kind) {
		return
	}
	g.out.Warn("leaselimit: Redis unavailable, the failure policy decides", g.whose,
		slog.String("mode", mode.String()), slog.String("reason", reason))
}

// dropped logs that a Client (or a Limiter of New's) was garbage-collected
// without Close: once, for it cannot happen twice to one engine.
func (g *logger) dropped() {
	if g == nil {
		return
	}
	g.out.Warn("leaselimit: a Client was garbage-collected without Close: its background goroutine and key table live on, and its leased tokens go back to Redis only as they expire; Close every Client when done with it", g.whose)
}

// manyLimits logs, once at each power of ten from manyLimitsFirst, that
// an engine has made n sets of limits: each is kept, with its keys' local
// state, until Close, so a Limiter made per request (a limit computed from
// each request's data) grows the heap without bound. A new user's trial
// made 100,000 and held 157 MiB more, with nothing to tell it.
func (g *logger) manyLimits(n int64) {
	if g == nil || n < manyLimitsFirst {
		return
	}
	for p := int64(manyLimitsFirst); p <= n; p *= 10 {
		if p == n {
			g.out.Warn("leaselimit: the Client holds many limits, each kept until Close: make Limiters once (plans, overrides), not one per request", g.whose,
				slog.Int64("limits", n))
			return
		}
	}
}

// manyLimitsFirst is the number of sets of limits manyLimits first logs.
const manyLimitsFirst = 1000

// refusing logs that a Limiter was made whose every call returns err (an
// invalid limit, an option With refused): a caller that logs nothing of
// its own (a middleware mapping errors to 500s, a sampled error log)
// would leave it unseen until it looked. first bypasses the gate (see
// engine.refusing).
func (g *logger) refusing(err error, first bool) {
	if g == nil || (!g.due(logInvalid) && !first) {
		return
	}
	g.out.Error("leaselimit: a Limiter was made that refuses every call with this error; fix the program", g.whose,
		slog.String("error", err.Error()))
}

// misconfig logs a Redis reply that is neither a decision nor an outage.
func (g *logger) misconfig(err error) {
	if g == nil || !g.due(logMisconfig) {
		return
	}
	g.out.Error("leaselimit: Redis replied with an error that is not an outage; fix the deployment (Client.Check says what)", g.whose,
		slog.String("error", err.Error()))
}

// readonly logs a READONLY reply: counted as an outage (a failover demotes
// a master for a moment), but one that lasts means a client pointed at a
// replica.
func (g *logger) readonly(err error) {
	if g == nil || !g.due(logReadonly) {
		return
	}
	g.out.Warn("leaselimit: Redis answered READONLY: a failover in progress, or, if it lasts, the client points at a replica (Client.Check tells)", g.whose,
		slog.String("error", err.Error()))
}

// saturated logs a call given up while this process, not Redis, was
// behind, or while Redis answered (see the log line).
func (g *logger) saturated() {
	if g == nil || !g.due(logSaturated) {
		return
	}
	g.out.Warn("leaselimit: instance saturated: a Redis call was given up though Redis was not failing (this process behind its scheduler or its client's pool, a reply held up on its way while Redis answered a connection of leaselimit's own, or the client's own timeout shorter than Redis's round trip); the request is denied, whatever the failure policy", g.whose)
}

// uncharged logs that an admission of the failure policy could not be
// recorded for charging: the debt book holds max buckets already.
func (g *logger) uncharged(max int) {
	if g == nil || !g.due(logUncharged) {
		return
	}
	g.out.Warn("leaselimit: the failure policy admitted a request that will not be charged to its bucket: the debt book is full (WithMaxKeys); counted on ratelimit.settle.charges.dropped", g.whose,
		slog.Int("max_keys", max))
}

// breakerState logs a change of the breaker's state (the most severe of a
// Cluster's). Called by the janitor only.
func (g *logger) breakerState(s breaker.State) {
	if g == nil || s == g.state {
		return
	}
	if s != breaker.Closed && !g.due(logBreaker) {
		return // flapping: the next line comes once logEvery has passed
	}
	g.state = s
	if s == breaker.Closed {
		g.out.Info("leaselimit: circuit breaker closed: decisions come from Redis again", g.whose)
		return
	}
	g.out.Warn("leaselimit: circuit breaker "+s.String()+": Redis calls are held back", g.whose)
}
