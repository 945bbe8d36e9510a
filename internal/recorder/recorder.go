// Package recorder records leaselimit's decisions with OpenTelemetry, for
// the root package and internal/redispath: a span (or an event on the
// caller's span) per decision, a client span per Redis call, and the
// metrics. The names it records under are package telemetry's.
//
// Metric attributes are built once per limit (on first use) and never hold
// anything per key. With no provider configured (the OpenTelemetry global
// no-op), recording a decision does not allocate: no span is started, and
// metric calls go to no-op instruments with prebuilt options.
package recorder

import (
	"context"
	"reflect"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/telemetry"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// Endpoint is the Redis server a call goes to, for the client span's
// server.address, server.port and db.namespace (the database index); empty
// fields are left out.
type Endpoint struct {
	Address   string
	Port      int
	Namespace string
}

// attrs returns e's span attributes, with the peer service named "redis":
// service.peer.name as v1.43.0 names it, and the peer.service it replaced,
// which Jaeger's dependency graph reads, so that the graph shows the service
// calling Redis rather than itself.
func (e Endpoint) attrs() []attribute.KeyValue {
	out := []attribute.KeyValue{semconv.ServicePeerNameKey.String("redis"), attribute.String("peer.service", "redis")}
	if e.Address != "" {
		out = append(out, telemetry.AttrServerAddress.String(e.Address))
	}
	if e.Port > 0 {
		out = append(out, telemetry.AttrServerPort.Int(e.Port))
	}
	if e.Namespace != "" {
		out = append(out, telemetry.AttrDBNamespace.String(e.Namespace))
	}
	return out
}

// Config configures a Recorder.
type Config struct {
	TracerProvider trace.TracerProvider // nil: the global provider
	MeterProvider  metric.MeterProvider // nil: the global provider
	// LimitName names the limit the Recorder records for
	// (ratelimit.limit.name). Without it the Recorder is an engine's own,
	// for what belongs to no one limit (breaker transitions and state, the
	// key table, refunds), named by the engine's Redis key prefix
	// (ratelimit.prefix): WithLimit gives its limits theirs.
	LimitName string
	Prefix    string
	// Sources names the decision sources, indexed by the Source value a
	// decision carries (leaselimit.Source: the names are defined there).
	Sources []string
	// Events records each decision as an event on the caller's span
	// instead of a child span.
	Events bool
	// Redact, if set, turns a key into the value of the ratelimit.key
	// attribute on spans and events. Never used for metrics.
	Redact func(key string) string
}

// Recorder records decisions. It is safe for concurrent use.
type Recorder struct {
	*instruments                    // shared by every Recorder of one engine
	scope        attribute.KeyValue // ratelimit.limit.name, or for the engine's own ratelimit.prefix
	reg          metric.Registration
	sets         *limitSets
}

// instruments is what the Recorders of one engine share: the tracer, the
// meter and its instruments.
type instruments struct {
	tracer     trace.Tracer
	tp         trace.TracerProvider
	globalIdle trace.TracerProvider // the untouched global provider, if we use it
	noTrace    bool
	events     bool
	redact     func(string) string
	sources    []string

	decisions   metric.Int64Counter
	authority   metric.Float64Histogram
	grantSize   metric.Int64Histogram
	refunds     metric.Int64Counter
	transitions metric.Int64Counter
	fallbacks   metric.Int64Counter
	saturated   metric.Int64Counter
	dropped     metric.Int64Counter
	chargesLost metric.Int64Counter
	unknown     metric.Int64Counter
	state, keys metric.Int64ObservableGauge
	full        metric.Int64ObservableCounter
	meter       metric.Meter
}

// limitSets are the metric options of one limit's attribute sets, each
// built on its first use, so that recording allocates nothing and a limit
// pays only for the sets it records with (a thousand limits of one Client
// would otherwise hold thousands of sets they never use).
type limitSets struct {
	decision  [2][]atomic.Pointer[[]metric.AddOption] // by allowed, source
	shadow    [2][]atomic.Pointer[[]metric.AddOption] // shadow decisions, by allowed, source
	limitAdd  atomic.Pointer[[]metric.AddOption]
	limitRec  atomic.Pointer[[]metric.RecordOption]
	outcome   [len(outcomes)]atomic.Pointer[[]metric.RecordOption]
	reason    [len(reasons)]atomic.Pointer[[]metric.AddOption]
	saturated [len(saturatedOutcomes)]atomic.Pointer[[]metric.AddOption]
	state     [3]atomic.Pointer[[]metric.AddOption] // by breaker.State
}

// The values of the attributes a limit's sets are built from, in slot order.
var (
	outcomes          = [...]string{"granted", "denied", telemetry.ReasonTimeout, telemetry.ReasonError}
	reasons           = [...]string{telemetry.ReasonBreakerOpen, telemetry.ReasonTimeout, telemetry.ReasonUnreachable, telemetry.ReasonError, telemetry.ReasonSaturated}
	saturatedOutcomes = [...]string{telemetry.SaturatedAnswered, telemetry.SaturatedAbandoned}
)

func newLimitSets(sources int) *limitSets {
	s := &limitSets{}
	for a := range s.decision {
		s.decision[a] = make([]atomic.Pointer[[]metric.AddOption], sources)
		s.shadow[a] = make([]atomic.Pointer[[]metric.AddOption], sources)
	}
	return s
}

// kvs is the attributes of a set besides the limit name, the first n of
// them used.
type kvs struct {
	a [3]attribute.KeyValue
	n int
}

// addOpts returns the Add options of the set {limit name, k}, built in slot
// on first use.
func (r *Recorder) addOpts(slot *atomic.Pointer[[]metric.AddOption], k kvs) []metric.AddOption {
	if o := slot.Load(); o != nil {
		return *o
	}
	o := []metric.AddOption{metric.WithAttributeSet(r.set(k))}
	slot.Store(&o)
	return o
}

// recordOpts is addOpts for Record options.
func (r *Recorder) recordOpts(slot *atomic.Pointer[[]metric.RecordOption], k kvs) []metric.RecordOption {
	if o := slot.Load(); o != nil {
		return *o
	}
	o := []metric.RecordOption{metric.WithAttributeSet(r.set(k))}
	slot.Store(&o)
	return o
}

// set returns the attribute set {limit name, k}.
func (r *Recorder) set(k kvs) attribute.Set {
	all := append([]attribute.KeyValue{r.scope}, k.a[:k.n]...)
	return attribute.NewSet(all...)
}

// one and none are kvs of one attribute and of none.
func one(a attribute.KeyValue) kvs { return kvs{a: [3]attribute.KeyValue{a}, n: 1} }

var none = kvs{}

// slot returns the index of v in values, or -1.
func slot[T comparable](values []T, v T) int {
	for i, x := range values {
		if x == v {
			return i
		}
	}
	return -1
}

// New returns a Recorder. It fails only if the meter rejects an instrument.
func New(c Config) (*Recorder, error) {
	name := telemetry.AttrPrefix.String(c.Prefix)
	if c.LimitName != "" {
		name = telemetry.AttrLimitName.String(c.LimitName)
	}
	r := &Recorder{instruments: &instruments{events: c.Events, redact: c.Redact, sources: c.Sources},
		scope: name, sets: newLimitSets(len(c.Sources))}
	tp := c.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
		if isGlobalDelegate(tp) {
			r.globalIdle = tp
		}
	}
	if _, ok := tp.(tracenoop.TracerProvider); ok {
		r.noTrace = true
	}
	r.tp = tp
	r.tracer = tp.Tracer(telemetry.ScopeName, trace.WithInstrumentationVersion(telemetry.Version))

	mp := c.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter(telemetry.ScopeName, metric.WithInstrumentationVersion(telemetry.Version))
	var err error
	if r.decisions, err = m.Int64Counter(telemetry.MetricDecisions, metric.WithUnit("{decision}"),
		metric.WithDescription("Rate-limit decisions, by allowed, source and limit.")); err != nil {
		return nil, err
	}
	if r.authority, err = m.Float64Histogram(telemetry.MetricAuthority, metric.WithUnit("s"),
		metric.WithDescription("Duration of Redis script calls, by outcome."),
		metric.WithExplicitBucketBoundaries(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)); err != nil {
		return nil, err
	}
	if r.grantSize, err = m.Int64Histogram(telemetry.MetricGrantSize, metric.WithUnit("{token}"),
		metric.WithDescription("Tokens granted per lease refill."),
		metric.WithExplicitBucketBoundaries(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)); err != nil {
		return nil, err
	}
	if r.refunds, err = m.Int64Counter(telemetry.MetricRefunds, metric.WithUnit("{token}"),
		metric.WithDescription("Unused leased tokens given back to Redis.")); err != nil {
		return nil, err
	}
	if r.transitions, err = m.Int64Counter(telemetry.MetricTransitions, metric.WithUnit("{transition}"),
		metric.WithDescription("Circuit breaker state changes, by new state.")); err != nil {
		return nil, err
	}
	if r.fallbacks, err = m.Int64Counter(telemetry.MetricFallbacks, metric.WithUnit("{decision}"),
		metric.WithDescription("Decisions made by the failure policy, by reason.")); err != nil {
		return nil, err
	}
	if r.dropped, err = m.Int64Counter(telemetry.MetricDropped, metric.WithUnit("{token}"),
		metric.WithDescription("Unused leased tokens not given back (the refund queue full, a failed send not resent, Close's final send failing); they stay debited until the bucket refills. A send whose reply was lost may have been applied: at most what stays debited.")); err != nil {
		return nil, err
	}
	if r.chargesLost, err = m.Int64Counter(telemetry.MetricChargesLost, metric.WithUnit("{token}"),
		metric.WithDescription("Tokens that settled reservations should have charged beyond their estimate but could not (Redis unreachable past the queue's bound, or a call whose outcome is unknown): admitted without being counted.")); err != nil {
		return nil, err
	}
	if r.unknown, err = m.Int64Counter(telemetry.MetricUnknown, metric.WithUnit("{token}"),
		metric.WithDescription("Tokens asked by acquire calls that a deadline cut after they were sent, whose outcome sending them again could not learn: Redis may have granted them, and they then stay debited until the bucket refills.")); err != nil {
		return nil, err
	}
	if r.saturated, err = m.Int64Counter(telemetry.MetricSaturated, metric.WithUnit("{call}"),
		metric.WithDescription("Redis calls that ran past the time budget because this process, not Redis, was behind, by outcome.")); err != nil {
		return nil, err
	}
	if r.state, err = m.Int64ObservableGauge(telemetry.MetricBreaker,
		metric.WithDescription("Circuit breaker state: 0 closed, 1 half-open, 2 open.")); err != nil {
		return nil, err
	}
	if r.keys, err = m.Int64ObservableGauge(telemetry.MetricKeys, metric.WithUnit("{key}"),
		metric.WithDescription("Keys with local state (leases, negative cache, fallback buckets).")); err != nil {
		return nil, err
	}
	if r.full, err = m.Int64ObservableCounter(telemetry.MetricKeysFull, metric.WithUnit("{key}"),
		metric.WithDescription("New keys a full shard of the local key table took in by evicting a key, or declined (decided exactly) because the key to evict held a live lease, by outcome.")); err != nil {
		return nil, err
	}
	r.meter = m

	return r, nil
}

// WithLimit returns a Recorder for a limit of the same engine: the same
// tracer and instruments, its own ratelimit.limit.name. It has no gauges
// (Observe is the engine's, on the Recorder from New) and its Close does
// nothing.
func (r *Recorder) WithLimit(name string) *Recorder {
	return &Recorder{instruments: r.instruments, scope: telemetry.AttrLimitName.String(name), sets: newLimitSets(len(r.sources))}
}

// Observe registers the callback of the breaker-state and key-table gauges
// and of the full table's counter (full: new keys evicted for and
// declined, since the start). Call it once, after everything state, keys
// and full read exists: a metric reader may collect at any moment from
// then on, even before Observe returns. Close unregisters it.
// The state gauge reads a breaker.State as its number: 0 closed, 1
// half-open, 2 open.
func (r *Recorder) Observe(state func() breaker.State, keys func() int64, full func() (evicted, declined uint64)) error {
	obs := metric.WithAttributeSet(attribute.NewSet(r.scope))
	evictedSet := metric.WithAttributeSet(attribute.NewSet(r.scope, telemetry.AttrOutcome.String(telemetry.FullEvicted)))
	declinedSet := metric.WithAttributeSet(attribute.NewSet(r.scope, telemetry.AttrOutcome.String(telemetry.FullDeclined)))
	reg, err := r.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(r.state, int64(state()), obs)
		o.ObserveInt64(r.keys, keys(), obs)
		ev, de := full()
		o.ObserveInt64(r.full, int64(ev), evictedSet)
		o.ObserveInt64(r.full, int64(de), declinedSet)
		return nil
	}, r.state, r.keys, r.full)
	if err != nil {
		return err
	}
	r.reg = reg
	return nil
}

// isGlobalDelegate reports whether tp is OpenTelemetry's global provider
// before any SDK was installed: a delegating no-op. Its tracers forward to
// an SDK installed later, which Tracing notices.
func isGlobalDelegate(tp trace.TracerProvider) bool {
	t := reflect.TypeOf(tp)
	return t != nil && t.String() == "*global.tracerProvider"
}

// Close unregisters the metric callbacks.
func (r *Recorder) Close() error {
	if r.reg != nil {
		return r.reg.Unregister()
	}
	return nil
}

// Tracing reports whether decisions should be traced: a provider was given,
// or an SDK has been installed as the global provider.
func (r *Recorder) Tracing() bool {
	if r.noTrace {
		return false
	}
	if r.globalIdle != nil {
		return otel.GetTracerProvider() != r.globalIdle
	}
	return true
}

// StartDecision starts the decision span (span mode) or returns the caller's
// span (event mode). Call only when Tracing is true.
func (r *Recorder) StartDecision(ctx context.Context) (context.Context, trace.Span) {
	if r.events {
		return context.WithValue(ctx, callersSpan{}, true), trace.SpanFromContext(ctx)
	}
	return r.tracer.Start(ctx, telemetry.DecisionSpan)
}

// callersSpan marks the context of a decision made in events mode: the
// span in it is the caller's own, not a decision span.
type callersSpan struct{}

// DecisionSpan returns the decision span in ctx, to set the attributes a
// decision learns on its way (the breaker's state, a fallback's reason),
// and whether it records. It reports false in events mode, where the span
// in ctx is the caller's: leaselimit's attributes would overwrite each
// other there, decision after decision.
func DecisionSpan(ctx context.Context) (trace.Span, bool) {
	sp := trace.SpanFromContext(ctx)
	if !sp.IsRecording() || ctx.Value(callersSpan{}) != nil {
		return sp, false
	}
	return sp, true
}

// Outcome describes a finished decision for EndDecision.
type Outcome struct {
	Allowed    bool
	Source     int // index into Config.Sources
	Cost       int64
	Remaining  int64
	RetryAfter time.Duration
	Key        string
	Err        error
	// CallerError marks Err as the caller's doing (bad input, its context
	// ending, a closed limiter): recorded, with error.type, but not as a
	// span error.
	CallerError bool
	// Shadow marks a decision of a limit in shadow mode; Allowed is then
	// what the limit decided, not what the caller was told.
	Shadow bool
	// Reason, for a decision that ended with Err, names why
	// (ratelimit.reason): "canceled", "invalid_key", "closed", … For a
	// caller's error it is also the error.type.
	Reason string
}

// errorType is error.type of a decision that ended with o.Err: the reason
// of a caller's error (low-cardinality, and it says more than the Go type
// of a wrapped sentinel), otherwise what a failed Redis call would have.
func (o Outcome) errorType() string {
	if o.CallerError && o.Reason != "" {
		return o.Reason
	}
	return errorType(o.Err)
}

// EndDecision records o on span (and ends it in span mode). Every decision
// gets ratelimit.outcome; one that ended with an error gets error.type too,
// and in span mode the Error status only when the error is not the
// caller's: bad input or a caller giving up is not a failure of the rate
// limiter, and marking it so would count every canceled request against it
// in a backend's error rate (as HTTP servers leave a 4xx span's status
// unset).
func (r *Recorder) EndDecision(span trace.Span, o Outcome) {
	if span.IsRecording() {
		attrs := make([]attribute.KeyValue, 0, 9)
		attrs = append(attrs, r.scope, telemetry.AttrCost.Int64(o.Cost))
		if o.Err != nil {
			attrs = append(attrs, telemetry.AttrOutcome.String(telemetry.OutcomeError), telemetry.AttrErrorType.String(o.errorType()))
			if o.Reason != "" {
				attrs = append(attrs, telemetry.AttrReason.String(o.Reason))
			}
		} else {
			outcome := telemetry.OutcomeDenied
			if o.Allowed {
				outcome = telemetry.OutcomeAllowed
			}
			attrs = append(attrs, telemetry.AttrOutcome.String(outcome), telemetry.AttrAllowed.Bool(o.Allowed),
				telemetry.AttrSource.String(r.sourceName(o.Source)), telemetry.AttrRemaining.Int64(o.Remaining))
			if !o.Allowed {
				attrs = append(attrs, telemetry.AttrRetryAfter.Float64(o.RetryAfter.Seconds()))
			}
			if o.Shadow {
				attrs = append(attrs, telemetry.AttrShadow.Bool(true))
			}
		}
		if r.redact != nil {
			attrs = append(attrs, telemetry.AttrKey.String(r.redact(o.Key)))
		}
		if r.events {
			span.AddEvent(telemetry.DecisionSpan, trace.WithAttributes(attrs...))
		} else {
			span.SetAttributes(attrs...)
			if o.Err != nil && !o.CallerError {
				span.SetStatus(codes.Error, o.Err.Error())
			}
		}
	}
	if !r.events {
		span.End()
	}
}

// CountDecision adds one decision to ratelimit.decisions; a decision of a
// limit in shadow mode (computed, not enforced) has ratelimit.shadow=true,
// and allowed says what the limit decided.
func (r *Recorder) CountDecision(ctx context.Context, allowed bool, source int, shadow bool) {
	a := 0
	if allowed {
		a = 1
	}
	if source < 0 || source >= len(r.sources) {
		return
	}
	slot := &r.sets.decision[a][source]
	if shadow {
		slot = &r.sets.shadow[a][source]
	}
	if o := slot.Load(); o != nil { // every decision but a limit's first of its kind
		r.decisions.Add(ctx, 1, *o...)
		return
	}
	k := kvs{a: [3]attribute.KeyValue{telemetry.AttrAllowed.Bool(allowed), telemetry.AttrSource.String(r.sources[source])}, n: 2}
	if shadow {
		k.a[2], k.n = telemetry.AttrShadow.Bool(true), 3
	}
	r.decisions.Add(ctx, 1, r.addOpts(slot, k)...)
}

// CountFallback adds one decision to ratelimit.fallbacks with a reason.
func (r *Recorder) CountFallback(ctx context.Context, reason string) {
	if i := slot(reasons[:], reason); i >= 0 {
		r.fallbacks.Add(ctx, 1, r.addOpts(&r.sets.reason[i], one(telemetry.AttrReason.String(reason)))...)
	}
}

// CountSaturated adds one call to ratelimit.saturated: it ran past the
// time budget while the process was behind, and was answered or abandoned.
func (r *Recorder) CountSaturated(ctx context.Context, outcome string) {
	if i := slot(saturatedOutcomes[:], outcome); i >= 0 {
		r.saturated.Add(ctx, 1, r.addOpts(&r.sets.saturated[i], one(telemetry.AttrOutcome.String(outcome)))...)
	}
}

// StartAuthority starts the client span of one Redis script call to ep.
func (r *Recorder) StartAuthority(ctx context.Context, want, min int64, ep Endpoint) (context.Context, trace.Span) {
	if !r.Tracing() {
		return ctx, trace.SpanFromContext(context.Background())
	}
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() && !r.events {
		// A decision span that is not sampled: keep its children out too.
		if parent.SpanContext().IsValid() {
			return ctx, trace.SpanFromContext(context.Background())
		}
	}
	ctx, span := r.tracer.Start(ctx, telemetry.AuthoritySpan, trace.WithSpanKind(trace.SpanKindClient))
	if span.IsRecording() {
		span.SetAttributes(telemetry.AttrDBSystem.String("redis"), telemetry.AttrDBOp.String("EVALSHA"), r.scope,
			telemetry.AttrWant.Int64(want), telemetry.AttrMin.Int64(min))
		span.SetAttributes(ep.attrs()...)
	}
	return ctx, span
}

// StartRefund starts the client span of one pipeline of n refunds to ep.
// It has no parent: refunds are sent by the janitor.
func (r *Recorder) StartRefund(ep Endpoint, n int) trace.Span {
	if !r.Tracing() {
		return trace.SpanFromContext(context.Background())
	}
	_, span := r.tracer.Start(context.Background(), telemetry.RefundSpan, trace.WithSpanKind(trace.SpanKindClient))
	if span.IsRecording() {
		span.SetAttributes(telemetry.AttrDBSystem.String("redis"), telemetry.AttrDBOp.String("EVALSHA"), r.scope,
			attribute.Int("db.operation.batch.size", n))
		span.SetAttributes(ep.attrs()...)
	}
	return span
}

// EndRefund ends a refund span with the tokens given back and the error.
func (r *Recorder) EndRefund(span trace.Span, tokens int64, err error) {
	if span.IsRecording() {
		span.SetAttributes(attribute.Int64("ratelimit.refund.tokens", tokens))
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
			span.SetAttributes(telemetry.AttrErrorType.String(errorType(err)))
		}
	}
	span.End()
}

// authorityOutcome is ratelimit.outcome of a Redis call.
func authorityOutcome(granted int64, err error) string {
	switch {
	case err != nil && isTimeout(err):
		return telemetry.ReasonTimeout
	case err != nil:
		return telemetry.ReasonError
	case granted == 0:
		return "denied"
	}
	return "granted"
}

// RecordAuthority records one Redis call's duration and outcome on the
// histogram, and, for a lease's refill (leased), the size of its grant:
// an exact call's grant is its request, not a lease.
func (r *Recorder) RecordAuthority(ctx context.Context, d time.Duration, granted int64, err error, leased bool) {
	outcome := authorityOutcome(granted, err)
	i := slot(outcomes[:], outcome)
	r.authority.Record(ctx, d.Seconds(), r.recordOpts(&r.sets.outcome[i], one(telemetry.AttrOutcome.String(outcome)))...)
	if leased && err == nil && granted > 0 {
		r.grantSize.Record(ctx, granted, r.recordOpts(&r.sets.limitRec, none)...)
	}
}

// FinishAuthority sets a Redis call's outcome on its span and ends it.
// errType, if set, overrides the error.type derived from err (a waiter that
// gave up knows better than its own timeout what failed).
func (r *Recorder) FinishAuthority(span trace.Span, granted int64, err error, errType string) {
	if span.IsRecording() {
		span.SetAttributes(telemetry.AttrGranted.Int64(granted), telemetry.AttrOutcome.String(authorityOutcome(granted, err)))
		if err != nil {
			if errType == "" {
				errType = errorType(err)
			}
			span.SetStatus(codes.Error, err.Error())
			span.SetAttributes(telemetry.AttrErrorType.String(errType))
		}
	}
	span.End()
}

// CountRefund adds tokens to ratelimit.lease.refunds.
func (r *Recorder) CountRefund(ctx context.Context, tokens int64) {
	r.refunds.Add(ctx, tokens, r.addOpts(&r.sets.limitAdd, none)...)
}

// CountDroppedRefund adds tokens to ratelimit.lease.refunds.dropped.
func (r *Recorder) CountDroppedRefund(ctx context.Context, tokens int64) {
	r.dropped.Add(ctx, tokens, r.addOpts(&r.sets.limitAdd, none)...)
}

// CountDroppedCharge adds tokens to ratelimit.settle.charges.dropped.
func (r *Recorder) CountDroppedCharge(ctx context.Context, tokens int64) {
	r.chargesLost.Add(ctx, tokens, r.addOpts(&r.sets.limitAdd, none)...)
}

// CountUnknown adds tokens to ratelimit.authority.unknown.
func (r *Recorder) CountUnknown(ctx context.Context, tokens int64) {
	r.unknown.Add(ctx, tokens, r.addOpts(&r.sets.limitAdd, none)...)
}

// CountTransition adds one breaker transition to state. It only records,
// so it is safe under the breaker's lock.
func (r *Recorder) CountTransition(state breaker.State) {
	if state >= 0 && int(state) < len(r.sets.state) {
		r.transitions.Add(context.Background(), 1, r.addOpts(&r.sets.state[state], one(telemetry.AttrState.String(state.String())))...)
	}
}

func (r *Recorder) sourceName(s int) string {
	if s >= 0 && s < len(r.sources) {
		return r.sources[s]
	}
	return "unknown"
}
