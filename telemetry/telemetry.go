// Package telemetry is for users who build dashboards, alerts and trace
// queries on what leaselimit records with OpenTelemetry: the names of its
// spans, attributes and metrics, and the values of its outcome and reason
// attributes, as constants; KeyDigest, a key redactor for
// leaselimit.WithKeyRedactor; and RedisLogger, which routes go-redis's own
// log lines to a slog.Logger.
//
// leaselimit records a span (or an event on the caller's span) per
// decision, a client span per Redis call, and metrics for decisions, Redis
// calls, leases, refunds, the circuit breaker and the local key table. The
// raw rate-limit key never appears in spans, events or metrics unless the
// user opts in with a redactor (KeyDigest makes a keyed digest). Metric
// attributes never hold anything per key. What belongs to a Client rather
// than to one of its limits (the breakers, the key table, refunds and
// dropped charges) carries ratelimit.prefix, the Client's Redis key
// prefix, instead of a limit name.
//
// With no provider configured (the OpenTelemetry global no-op), recording a
// decision does not allocate: no span is started, and metric calls go to
// no-op instruments.
package telemetry

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"

	"github.com/leaselimit/leaselimit/internal/version"
	"go.opentelemetry.io/otel/attribute"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of every tracer and meter: the
// module's import path.
const ScopeName = "github.com/leaselimit/leaselimit"

// Version is the instrumentation version recorded with the scope: the
// module's version (leaselimit.Version).
const Version = version.Version

// Span and event names.
const (
	DecisionSpan  = "ratelimit.decision"  // one per Allow/AllowN/Wait call
	AuthoritySpan = "ratelimit.authority" // one per Redis script call, SpanKindClient
	RefundSpan    = "ratelimit.refund"    // one per pipeline of refunds to a node, SpanKindClient
)

// Attribute keys.
const (
	AttrLimitName  = attribute.Key("ratelimit.limit.name")
	AttrPrefix     = attribute.Key("ratelimit.prefix") // the Client's own metrics and spans: its Redis key prefix
	AttrAllowed    = attribute.Key("ratelimit.allowed")
	AttrSource     = attribute.Key("ratelimit.source")
	AttrCost       = attribute.Key("ratelimit.cost")
	AttrRemaining  = attribute.Key("ratelimit.remaining")
	AttrRetryAfter = attribute.Key("ratelimit.retry_after") // seconds, when denied
	AttrBreaker    = attribute.Key("ratelimit.breaker.state")
	AttrCoalesced  = attribute.Key("ratelimit.coalesced")
	AttrKey        = attribute.Key("ratelimit.key") // only with a redactor: its output
	AttrWant       = attribute.Key("ratelimit.want")
	AttrMin        = attribute.Key("ratelimit.min")
	AttrGranted    = attribute.Key("ratelimit.granted")
	AttrOutcome    = attribute.Key("ratelimit.outcome")
	AttrReason     = attribute.Key("ratelimit.reason")
	AttrSaturated  = attribute.Key("ratelimit.saturated") // the authority call ran past the budget because this process was behind
	AttrShadow     = attribute.Key("ratelimit.shadow")    // the decision was computed, not enforced (shadow mode): ratelimit.allowed is what the limit decided
	AttrState      = attribute.Key("ratelimit.breaker.to")
	AttrErrorType  = semconv.ErrorTypeKey // error.type
	// Database client span attributes, as OpenTelemetry semantic
	// conventions v1.43.0 name them (see semconv/v1.43.0).
	AttrDBSystem      = semconv.DBSystemNameKey
	AttrDBOp          = semconv.DBOperationNameKey
	AttrDBNamespace   = semconv.DBNamespaceKey
	AttrServerAddress = semconv.ServerAddressKey
	AttrServerPort    = semconv.ServerPortKey
)

// SemconvVersion is the OpenTelemetry semantic conventions version that
// the Redis client spans follow.
const SemconvVersion = "1.43.0"

// Metric names.
const (
	MetricDecisions   = "ratelimit.decisions"              // counter {decision}: allowed, source, limit name
	MetricAuthority   = "ratelimit.authority.duration"     // histogram s: limit name, outcome
	MetricGrantSize   = "ratelimit.lease.grant.size"       // histogram {token}: limit name
	MetricRefunds     = "ratelimit.lease.refunds"          // counter {token}: prefix (the Client's)
	MetricBreaker     = "ratelimit.breaker.state"          // gauge: prefix; 0 closed, 1 half-open, 2 open
	MetricTransitions = "ratelimit.breaker.transitions"    // counter: prefix, to-state
	MetricKeys        = "ratelimit.keys"                   // gauge {key}: prefix; local key-table size
	MetricKeysFull    = "ratelimit.keys.full"              // counter {key}: prefix, outcome evicted or declined
	MetricFallbacks   = "ratelimit.fallbacks"              // counter {decision}: limit name, reason
	MetricSaturated   = "ratelimit.saturated"              // counter {call}: limit name, outcome answered or abandoned
	MetricDropped     = "ratelimit.lease.refunds.dropped"  // counter {token}: prefix
	MetricChargesLost = "ratelimit.settle.charges.dropped" // counter {token}: prefix
	MetricUnknown     = "ratelimit.authority.unknown"      // counter {token}: prefix
)

// Fallback reasons (ratelimit.reason on ratelimit.fallbacks and on a
// decision's span).
const (
	ReasonBreakerOpen = "breaker_open"
	// ReasonTimeout: Redis was connected to but did not answer within the
	// time budget (a hung, stalled or overloaded Redis).
	ReasonTimeout = "timeout"
	// ReasonUnreachable: no connection to Redis could be made (refused, no
	// route, a DNS failure, a dial timeout): a wrong address, or a Redis
	// that is down.
	ReasonUnreachable = "unreachable"
	ReasonError       = "error"
	// ReasonSaturated: no reply within the budget and the hard cap while
	// this process, not Redis, was behind (its goroutines waited that long
	// to run). Redis may well be healthy: the instance is saturated, and
	// the request is denied whatever the failure policy.
	ReasonSaturated = "saturated"
)

// Outcomes of a call that ran past its budget while the process was behind
// (ratelimit.saturated).
const (
	SaturatedAnswered  = "answered"  // waited for, and answered
	SaturatedAbandoned = "abandoned" // given up at the hard cap
)

// What a full shard of the local key table did with a new key
// (ratelimit.outcome on ratelimit.keys.full).
const (
	FullEvicted  = "evicted"  // took it in, evicting a key not used for a while
	FullDeclined = "declined" // decided it exactly: the key to evict held a live lease
)

// Outcomes of a decision (ratelimit.outcome on its span or event): every
// decision has one.
const (
	OutcomeAllowed = "allowed"
	OutcomeDenied  = "denied"
	OutcomeError   = "error" // the call returned an error instead of a decision
)

// KeyDigest returns a redactor that records the first 64 bits of
// HMAC-SHA256(secret, key) in hex: stable across instances that share the
// secret, so a dashboard can group by key without ever seeing one.
//
// It panics on an empty secret (a secret read from an unset variable,
// say): the digests would be an unkeyed hash, which anyone can reverse by
// trying the likely keys (every IPv4 address is 2^32 tries).
func KeyDigest(secret []byte) func(string) string {
	if len(secret) == 0 {
		panic("telemetry: KeyDigest with an empty secret: its digests of keys such as IP addresses could be reversed by trying them")
	}
	s := append([]byte(nil), secret...)
	return func(key string) string {
		h := hmac.New(sha256.New, s)
		h.Write([]byte(key))
		return hex.EncodeToString(h.Sum(nil)[:8])
	}
}
