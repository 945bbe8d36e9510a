package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/url"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/telemetry"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// Tracing in the demo. With an OTLP endpoint (-otlp, or the standard
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT), every
// leaselimit Limiter traces through one SDK TracerProvider that samples
// -trace-ratio of the decisions and exports them over OTLP/HTTP in batches.
// Without one, one instance of design (c) in act 1 and one FailLocal
// instance in act 2 trace every decision into memory, and a few of the
// spans are printed at the end.

const (
	serviceName = "leaselimit-demo"
	// exportTimeout bounds one export (with its retries) and the final
	// flush: an unreachable collector costs the demo seconds, not minutes.
	exportTimeout = 5 * time.Second
	// sampleSecret keys the digest of the keys on the sampled Limiters.
	sampleSecret = "leaselimit-demo"
	// perKind is how many decision spans of each source × allowed the
	// sample keeps.
	perKind = 8
)

// Environment variables that configure the exporter's endpoint; the
// exporter reads them itself.
const (
	envEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
)

// otlpURL turns -otlp into the URL spans are posted to. Like
// OTEL_EXPORTER_OTLP_ENDPOINT it is a base URL: /v1/traces is appended to
// its path. HOST:PORT without a scheme means plain HTTP.
func otlpURL(s string) (*url.URL, error) {
	raw := strings.TrimSpace(s)
	if !strings.Contains(raw, "://") {
		raw = "http://" + raw
	}
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("-otlp %q: %v", s, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("-otlp %q: the scheme must be http or https (OTLP over HTTP)", s)
	}
	if u.Host == "" {
		return nil, fmt.Errorf("-otlp %q: no host; give http://HOST:PORT or HOST:PORT", s)
	}
	u.Path = path.Join("/", u.Path, "v1/traces")
	u.RawPath = ""
	return u, nil
}

// envTracesURL returns where the exporter sends spans when configured by
// the environment (for display only), and the variable that said so; ""
// when neither variable is set.
func envTracesURL() (where, from string) {
	if v := strings.TrimSpace(os.Getenv(envTracesEndpoint)); v != "" {
		return redactURL(v), envTracesEndpoint
	}
	if v := strings.TrimSpace(os.Getenv(envEndpoint)); v != "" {
		if u, err := url.Parse(v); err == nil {
			u.Path = path.Join("/", u.Path, "v1/traces")
			u.RawPath = ""
			return u.Redacted(), envEndpoint
		}
		return v, envEndpoint
	}
	return "", ""
}

func redactURL(s string) string {
	if u, err := url.Parse(s); err == nil {
		return u.Redacted()
	}
	return s
}

// tracing is the demo's tracing set-up: either an exporter or the in-memory
// sample.
type tracing struct {
	// Exporting over OTLP/HTTP.
	tp       *sdktrace.TracerProvider
	exp      *countingExporter
	where    string // the URL, for display
	from     string // "-otlp" or the environment variable
	ratio    float64
	service  string // service.name
	instance string // service.instance.id
	errs     *errorSink
	setupErr error // the exporter could not be built: no tracing
	resErr   error // OTEL_RESOURCE_ATTRIBUTES or OTEL_SERVICE_NAME could not be used

	// The in-memory sample.
	sample   *spanSample
	sampleTP *sdktrace.TracerProvider
	// outageAct says whether act 2 runs, whose FailLocal instance feeds
	// the sample too: with -redis or -outage 0 it does not, and the
	// report must not say it traced (a new user's trial).
	outageAct bool

	closeOnce sync.Once
	closeErr  error
}

// newTracing sets up tracing for cfg. It never fails the demo: when the
// exporter cannot be built, the demo runs without traces and says why.
func newTracing(ctx context.Context, cfg *config) *tracing {
	t := &tracing{ratio: cfg.traceRatio}
	var opts []otlptracehttp.Option
	switch {
	case cfg.otlp != "":
		u, err := otlpURL(cfg.otlp) // validated by parseFlags
		if err != nil {
			t.setupErr = err
			return t
		}
		t.where, t.from = u.Redacted(), "-otlp"
		opts = append(opts, otlptracehttp.WithEndpointURL(u.String()))
	default:
		t.where, t.from = envTracesURL()
	}
	if t.where == "" {
		t.sample = newSpanSample()
		t.sampleTP = sdktrace.NewTracerProvider(
			sdktrace.WithSampler(sdktrace.AlwaysSample()),
			sdktrace.WithSpanProcessor(t.sample))
		return t
	}

	// From here on, OpenTelemetry's errors go to the sink, to be reported
	// once at the end.
	t.errs = installErrorSink()
	res, err := serviceResource(ctx)
	if err != nil {
		t.resErr = err // reported on its own: it is not an export error
	}
	t.service = serviceName
	if v, ok := res.Set().Value(semconv.ServiceNameKey); ok {
		t.service = v.AsString()
	}
	if v, ok := res.Set().Value(semconv.ServiceInstanceIDKey); ok {
		t.instance = v.AsString()
	}
	opts = append(opts,
		otlptracehttp.WithTimeout(exportTimeout),
		otlptracehttp.WithRetry(otlptracehttp.RetryConfig{
			Enabled:         true,
			InitialInterval: 250 * time.Millisecond,
			MaxInterval:     time.Second,
			MaxElapsedTime:  exportTimeout,
		}))
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		t.setupErr = err
		t.errs.uninstall()
		return t
	}
	t.exp = &countingExporter{SpanExporter: exp}
	t.tp = sdktrace.NewTracerProvider(
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(t.ratio))),
		sdktrace.WithBatcher(t.exp, sdktrace.WithExportTimeout(exportTimeout)))
	// Resource errors (here and in the SDK's default resource) are reported
	// on their own: they are not export errors.
	t.errs.reset()
	return t
}

// serviceResource is the resource of the demo's spans: service.name,
// service.version (leaselimit.Version: the demo is a command of the
// leaselimit module and is released with it), service.instance.id (a
// random UUID v4 per process, as the semantic conventions recommend: the
// simulated instances of a run share one process and one exporter) and the
// SDK's telemetry.sdk.*. OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
// override any of them (an instance id the deployment assigns, say). On error
// the resource returned still has what could be detected.
func serviceResource(ctx context.Context) (*resource.Resource, error) {
	res, err := resource.New(ctx,
		resource.WithSchemaURL(semconv.SchemaURL),
		resource.WithService(), // service.instance.id, and a service.name the next option replaces
		resource.WithAttributes(semconv.ServiceName(serviceName), semconv.ServiceVersion(leaselimit.Version)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv())
	if res == nil {
		res = resource.NewSchemaless(semconv.ServiceName(serviceName), semconv.ServiceVersion(leaselimit.Version))
	}
	return res, err
}

// describe is the header line about tracing.
func (t *tracing) describe() string {
	switch {
	case t.setupErr != nil:
		return fmt.Sprintf("tracing: off, the OTLP exporter could not be set up (%v)", t.setupErr)
	case t.tp != nil:
		return fmt.Sprintf("tracing: every leaselimit Limiter samples %s of its decisions (ParentBased(TraceIDRatioBased(%v)))\n"+
			"  and exports them over OTLP/HTTP to %s (from %s)", pctFloat(t.ratio), t.ratio, t.where, t.from)
	}
	who := "one instance of design (c) records"
	if t.outageAct {
		who = "one instance of design (c) and one FailLocal instance record"
	}
	return "tracing: " + who + " every decision in memory;\n" +
		"  a few sample spans are printed at the end (-otlp ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT exports them)"
}

// options returns the telemetry options of a Limiter; sampled selects the
// Limiters that feed the in-memory sample.
func (t *tracing) options(sampled bool) []leaselimit.Option {
	switch {
	case t.tp != nil:
		return []leaselimit.Option{leaselimit.WithTracerProvider(t.tp)}
	case t.sampleTP != nil && sampled:
		return []leaselimit.Option{
			leaselimit.WithTracerProvider(t.sampleTP),
			leaselimit.WithKeyRedactor(telemetry.KeyDigest([]byte(sampleSecret))),
		}
	}
	return nil
}

// record turns the in-memory sample on for a measured run (not the
// warm-up) and off after it.
func (t *tracing) record(on bool) {
	if t.sample != nil {
		t.sample.record(on)
	}
}

// close flushes and shuts the providers down, within exportTimeout. It is
// safe to call more than once.
func (t *tracing) close() error {
	t.closeOnce.Do(func() {
		if t.tp != nil {
			ctx, cancel := context.WithTimeout(context.Background(), exportTimeout)
			t.closeErr = t.tp.Shutdown(ctx)
			cancel()
			t.errs.uninstall()
		}
		if t.sampleTP != nil {
			t.closeErr = t.sampleTP.Shutdown(context.Background())
		}
	})
	return t.closeErr
}

// report shuts tracing down and writes the result: one line on where the
// traces went (and, on stderr, what went wrong), or the sample spans.
func (t *tracing) report(out, stderr io.Writer) {
	err := t.close()
	if t.resErr != nil {
		fmt.Fprintf(stderr, "leaselimit-demo: trace resource: %v\n", t.resErr)
	}
	switch {
	case t.setupErr != nil:
		fmt.Fprintf(out, "\nTraces: none, the OTLP exporter could not be set up.\n")
		fmt.Fprintf(stderr, "leaselimit-demo: trace export to %s: %v\n", t.where, t.setupErr)
	case t.tp != nil:
		errs, first := t.errs.summary()
		if err != nil {
			if first == nil {
				first = err
			}
			errs++
		}
		spans := t.exp.spans.Load()
		if errs == 0 {
			fmt.Fprintf(out, "\nTraces: %s spans (%s of decisions) exported over OTLP/HTTP to %s, service.name %q, service.instance.id %q.\n",
				num(float64(spans)), pctFloat(t.ratio), t.where, t.service, t.instance)
			return
		}
		plural := "s"
		if errs == 1 {
			plural = ""
		}
		fmt.Fprintf(out, "\nTraces: export over OTLP/HTTP to %s failed (%s spans exported, %d error%s; see stderr).\n",
			t.where, num(float64(spans)), errs, plural)
		more := ""
		if errs > 1 {
			more = fmt.Sprintf(" %d times, the first", errs)
		}
		fmt.Fprintf(stderr, "leaselimit-demo: trace export to %s failed%s: %v\n", t.where, more, first)
	case t.sample != nil:
		t.printSample(out)
	}
}

func pctFloat(r float64) string {
	return strconv.FormatFloat(100*r, 'g', 3, 64) + "%"
}

// countingExporter counts the spans exported successfully.
type countingExporter struct {
	sdktrace.SpanExporter
	spans atomic.Int64
}

func (e *countingExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	err := e.SpanExporter.ExportSpans(ctx, spans)
	if err == nil {
		e.spans.Add(int64(len(spans)))
	}
	return err
}

// errorSink collects the errors OpenTelemetry reports through its global
// error handler (failed exports, mostly), to report them once at the end
// instead of one log line per failed batch.
type errorSink struct {
	mu    sync.Mutex
	n     int
	first error
}

func (s *errorSink) Handle(err error) {
	if s == nil || err == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.first == nil {
		s.first = err
	}
	s.n++
}

// reset forgets the errors reported so far.
func (s *errorSink) reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n, s.first = 0, nil
}

// summary returns how many errors were reported and the first one.
func (s *errorSink) summary() (int, error) {
	if s == nil {
		return 0, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n, s.first
}

// The global error handler is installed once and forwards to the sink of
// the run in progress; with none, it logs like OpenTelemetry's default.
var (
	handlerOnce sync.Once
	activeSink  atomic.Pointer[errorSink]
)

type forwardingHandler struct{}

func (forwardingHandler) Handle(err error) {
	if s := activeSink.Load(); s != nil {
		s.Handle(err)
		return
	}
	log.Print(err)
}

func installErrorSink() *errorSink {
	handlerOnce.Do(func() { otel.SetErrorHandler(forwardingHandler{}) })
	s := &errorSink{}
	activeSink.Store(s)
	return s
}

func (s *errorSink) uninstall() {
	if s != nil {
		activeSink.CompareAndSwap(s, nil)
	}
}

// spanSample is a span processor that keeps the first few decision spans of
// each kind (source × allowed) with their authority child spans, and hands
// them to a tracetest.SpanRecorder: a bounded sample, whatever the load.
type spanSample struct {
	rec  *tracetest.SpanRecorder
	on   atomic.Bool
	seen atomic.Int64 // decision spans that ended while recording

	mu      sync.Mutex
	kept    map[string]int
	pending map[trace.SpanID][]sdktrace.ReadOnlySpan // authority spans whose decision has not ended
}

var _ sdktrace.SpanProcessor = (*spanSample)(nil)

func newSpanSample() *spanSample {
	return &spanSample{rec: tracetest.NewSpanRecorder(), kept: map[string]int{}, pending: map[trace.SpanID][]sdktrace.ReadOnlySpan{}}
}

func (s *spanSample) record(on bool) {
	s.on.Store(on)
	if !on {
		s.mu.Lock()
		clear(s.pending)
		s.mu.Unlock()
	}
}

func (s *spanSample) OnStart(context.Context, sdktrace.ReadWriteSpan) {}

func (s *spanSample) OnEnd(sp sdktrace.ReadOnlySpan) {
	if !s.on.Load() {
		return
	}
	switch sp.Name() {
	case telemetry.AuthoritySpan:
		// A child ends before its decision span: hold it until then.
		parent := sp.Parent().SpanID()
		if !parent.IsValid() {
			return
		}
		s.mu.Lock()
		if len(s.pending) < 4096 {
			s.pending[parent] = append(s.pending[parent], sp)
		}
		s.mu.Unlock()
	case telemetry.DecisionSpan:
		s.seen.Add(1)
		k := kindOf(sp)
		s.mu.Lock()
		kids := s.pending[sp.SpanContext().SpanID()]
		delete(s.pending, sp.SpanContext().SpanID())
		keep := s.kept[k] < perKind
		if keep {
			s.kept[k]++
		}
		s.mu.Unlock()
		if keep {
			for _, c := range kids {
				s.rec.OnEnd(c)
			}
			s.rec.OnEnd(sp)
		}
	}
}

func (s *spanSample) Shutdown(ctx context.Context) error   { return s.rec.Shutdown(ctx) }
func (s *spanSample) ForceFlush(ctx context.Context) error { return s.rec.ForceFlush(ctx) }

// kindOf is a decision span's "source/allowed", e.g. "lease/true"; "error"
// for a decision that failed.
func kindOf(sp sdktrace.ReadOnlySpan) string {
	src, allowed := "", ""
	for _, a := range sp.Attributes() {
		switch a.Key {
		case telemetry.AttrSource:
			src = a.Value.AsString()
		case telemetry.AttrAllowed:
			allowed = strconv.FormatBool(a.Value.AsBool())
		}
	}
	if src == "" {
		return "error"
	}
	return src + "/" + allowed
}

// sampleOrder is the order in which kinds of decision are shown, and what
// each one is.
var sampleOrder = []struct{ kind, what string }{
	{"authority/true", "admitted by Redis: one call of the token-bucket script, which took ratelimit.granted tokens (a lease)"},
	{"lease/true", "admitted from the local lease: no Redis call"},
	{"cache/false", "denied from the negative cache: no Redis call"},
	{"authority/false", "denied by Redis"},
	{"lease/false", "denied locally"},
	{"fallback/true", "Redis down: the failure policy (FailLocal) admitted"},
	{"fallback/false", "Redis down: the failure policy (FailLocal) denied"},
	{"error", "the decision failed"},
}

// maxShown bounds the spans printed: the first four kinds found in act 1,
// and one fallback from act 2.
const maxShown = 5

// printSample writes a few of the recorded decision spans, each with its
// attributes and its authority child span.
func (t *tracing) printSample(w io.Writer) {
	ended := t.sample.rec.Ended()
	children := map[trace.SpanID][]sdktrace.ReadOnlySpan{}
	byKind := map[string][]sdktrace.ReadOnlySpan{}
	for _, sp := range ended {
		switch sp.Name() {
		case telemetry.AuthoritySpan:
			p := sp.Parent().SpanID()
			children[p] = append(children[p], sp)
		case telemetry.DecisionSpan:
			k := kindOf(sp)
			byKind[k] = append(byKind[k], sp)
		}
	}
	// pick prefers a span with a Redis call under it, and among those the
	// one whose call granted the most tokens (a lease, not a single token).
	pick := func(spans []sdktrace.ReadOnlySpan) sdktrace.ReadOnlySpan {
		best, bestGrant := spans[0], int64(-1)
		for _, sp := range spans {
			for _, c := range children[sp.SpanContext().SpanID()] {
				g := int64(0)
				for _, a := range c.Attributes() {
					if a.Key == telemetry.AttrGranted {
						g = a.Value.AsInt64()
					}
				}
				if g > bestGrant {
					best, bestGrant = sp, g
				}
			}
		}
		return best
	}
	type shown struct {
		sp   sdktrace.ReadOnlySpan
		what string
	}
	var act1, fallback []shown
	for _, o := range sampleOrder {
		spans := byKind[o.kind]
		if len(spans) == 0 {
			continue
		}
		if strings.HasPrefix(o.kind, "fallback/") {
			fallback = append(fallback, shown{pick(spans), o.what})
		} else {
			act1 = append(act1, shown{pick(spans), o.what})
		}
	}
	n := maxShown
	if len(fallback) > 0 {
		n--
	}
	list := act1[:min(n, len(act1))]
	if len(fallback) > 0 {
		list = append(list, fallback[0])
	}

	who, those := "one instance of design (c) in act 1 and one FailLocal instance in act 2", "Those two have"
	if !t.outageAct {
		who, those = "one instance of design (c) in act 1", "It has"
	}
	fmt.Fprintf(w, "\nSample decision spans: %s traced\n", who)
	fmt.Fprintf(w, "every decision (%s) into memory (tracetest.SpanRecorder, the first %d of each source × allowed kept);\n",
		num(float64(t.sample.seen.Load())), perKind)
	fmt.Fprintf(w, "the other Limiters traced nothing. %s WithKeyRedactor(telemetry.KeyDigest(secret)), so\n", those)
	fmt.Fprintf(w, "ratelimit.key is a keyed digest; without a redactor no form of the key is recorded. -otlp ENDPOINT\n")
	fmt.Fprintf(w, "(or OTEL_EXPORTER_OTLP_ENDPOINT) exports the spans of every Limiter to a collector instead.\n")
	if len(list) == 0 {
		fmt.Fprintf(w, "  (none recorded)\n")
		return
	}
	for i, s := range list {
		fmt.Fprintf(w, "\n  %d. %s\n", i+1, s.what)
		writeSpan(w, s.sp, "     ")
		for _, c := range children[s.sp.SpanContext().SpanID()] {
			writeSpan(w, c, "       └ ")
		}
	}
}

// writeSpan writes one span: its name, kind, duration and status on one
// line, then its attributes, a few to a line.
func writeSpan(w io.Writer, sp sdktrace.ReadOnlySpan, indent string) {
	line := fmt.Sprintf("%s%s", indent, sp.Name())
	if k := sp.SpanKind(); k != trace.SpanKindInternal && k != trace.SpanKindUnspecified {
		line += "  kind " + k.String()
	}
	line += "  " + dur(sp.EndTime().Sub(sp.StartTime()))
	if st := sp.Status(); st.Code == codes.Error {
		line += "  status Error: " + st.Description
	}
	fmt.Fprintln(w, line)

	attrs := append([]attribute.KeyValue(nil), sp.Attributes()...)
	// The decision first, then the rest in a stable order.
	rank := func(k attribute.Key) int {
		switch k {
		case telemetry.AttrSource:
			return 0
		case telemetry.AttrAllowed:
			return 1
		}
		return 2
	}
	sort.SliceStable(attrs, func(i, j int) bool {
		ri, rj := rank(attrs[i].Key), rank(attrs[j].Key)
		if ri != rj {
			return ri < rj
		}
		return ri == 2 && attrs[i].Key < attrs[j].Key
	})
	pad := strings.Repeat(" ", len([]rune(indent))+2)
	const width = 110
	cur := pad
	for _, a := range attrs {
		f := string(a.Key) + "=" + attrValue(a.Value)
		if cur != pad && len(cur)+2+len(f) > width {
			fmt.Fprintln(w, cur)
			cur = pad
		}
		if cur != pad {
			cur += "  "
		}
		cur += f
	}
	if cur != pad {
		fmt.Fprintln(w, cur)
	}
}

func attrValue(v attribute.Value) string {
	if v.Type() == attribute.FLOAT64 {
		return strconv.FormatFloat(v.AsFloat64(), 'g', 4, 64)
	}
	return v.String()
}
