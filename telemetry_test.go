package leaselimit_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

type telemetryRig struct {
	spans  *tracetest.SpanRecorder
	reader *sdkmetric.ManualReader
	tp     *sdktrace.TracerProvider
	mp     *sdkmetric.MeterProvider
}

func newTelemetryRig(t testing.TB) *telemetryRig {
	r := &telemetryRig{spans: tracetest.NewSpanRecorder(), reader: sdkmetric.NewManualReader()}
	r.tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(r.spans))
	r.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(r.reader))
	t.Cleanup(func() {
		_ = r.tp.Shutdown(context.Background())
		_ = r.mp.Shutdown(context.Background())
	})
	return r
}

func (r *telemetryRig) opts() []leaselimit.Option {
	return []leaselimit.Option{leaselimit.WithTracerProvider(r.tp), leaselimit.WithMeterProvider(r.mp)}
}

// decisions sums ratelimit.decisions by "allowed/source".
func (r *telemetryRig) decisions(t *testing.T) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != telemetry.ScopeName {
			t.Errorf("scope %q; want %q", sm.Scope.Name, telemetry.ScopeName)
		}
		for _, m := range sm.Metrics {
			if m.Name != telemetry.MetricDecisions {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				a, _ := dp.Attributes.Value(telemetry.AttrAllowed)
				s, _ := dp.Attributes.Value(telemetry.AttrSource)
				out[fmt.Sprintf("%v/%v", a.AsBool(), s.AsString())] += dp.Value
			}
		}
	}
	return out
}

func (r *telemetryRig) metricNames(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	for _, m := range r.metrics(t) {
		names[m.Name] = true
		checkNoKey(t, "metric "+m.Name, fmt.Sprintf("%+v", m.Data))
	}
	return names
}

// metrics collects every metric of every scope.
func (r *telemetryRig) metrics(t *testing.T) []metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var all []metricdata.Metrics
	for _, sm := range rm.ScopeMetrics {
		all = append(all, sm.Metrics...)
	}
	return all
}

const secretKey = "user-SECRET-42"

func checkNoKey(t *testing.T, where, s string) {
	t.Helper()
	if strings.Contains(s, "SECRET") {
		t.Errorf("%s contains the raw key: %s", where, s)
	}
}

func attrMap(kvs []attribute.KeyValue) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range kvs {
		m[kv.Key] = kv.Value
	}
	return m
}

// TestTelemetryAllPaths: N decisions give N decision spans with the
// documented attributes and ratelimit.decisions summing to N, on the
// authority, cache and fallback paths (a burst of 3 makes no lease
// decision: TestTelemetryLeaseHits covers those); the raw key appears
// nowhere.
func TestTelemetryAllPaths(t *testing.T) {
	mostlyWaits(t)
	rig := newTelemetryRig(t)
	m, c := newMini(t)
	ctx := context.Background()
	lim := mustNew(t, c, policy.PerHour(3).WithName("tel"), append(rig.opts(),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}))...)
	calls := 0
	sources := map[leaselimit.Source]int{}
	allow := func(key string) leaselimit.Decision {
		t.Helper()
		d, err := lim.Allow(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		calls++
		sources[d.Source]++
		return d
	}
	for i := 0; i < 5; i++ { // authority, then lease or authority, then denials and cache
		allow(secretKey)
	}
	m.Close() // Redis goes away: the next miss trips the breaker
	for i := 0; i < 3; i++ {
		allow(secretKey + "-other")
	}
	t.Logf("sources: %v", sources)
	for _, s := range []leaselimit.Source{leaselimit.SourceAuthority, leaselimit.SourceCache, leaselimit.SourceFallback} {
		if sources[s] == 0 {
			t.Errorf("no %v decision in the scenario; sources %v", s, sources)
		}
	}

	var decisionSpans int
	var authoritySpans int
	for _, sp := range rig.spans.Ended() {
		checkNoKey(t, "span "+sp.Name(), fmt.Sprintf("%v %v %v", sp.Name(), sp.Attributes(), sp.Events()))
		a := attrMap(sp.Attributes())
		switch sp.Name() {
		case telemetry.DecisionSpan:
			decisionSpans++
			for _, k := range []attribute.Key{telemetry.AttrLimitName, telemetry.AttrAllowed, telemetry.AttrSource, telemetry.AttrCost, telemetry.AttrRemaining} {
				if _, ok := a[k]; !ok {
					t.Errorf("decision span lacks %s: %v", k, sp.Attributes())
				}
			}
			if a[telemetry.AttrLimitName].AsString() != "tel" {
				t.Errorf("limit name %v", a[telemetry.AttrLimitName])
			}
			if !a[telemetry.AttrAllowed].AsBool() {
				if _, ok := a[telemetry.AttrRetryAfter]; !ok {
					t.Errorf("denied decision span lacks retry_after: %v", sp.Attributes())
				}
			}
			if src := a[telemetry.AttrSource].AsString(); src == "fallback" || src == "authority" {
				if _, ok := a[telemetry.AttrBreaker]; !ok {
					t.Errorf("%s decision span lacks the breaker state: %v", src, sp.Attributes())
				}
			}
			if sp.Status().Code == codes.Error {
				t.Errorf("a decision (denial or fallback) has an error status: %v", sp.Status())
			}
		case telemetry.AuthoritySpan:
			authoritySpans++
			if sp.SpanKind() != trace.SpanKindClient {
				t.Errorf("authority span kind %v", sp.SpanKind())
			}
			if !sp.Parent().IsValid() {
				t.Errorf("authority span has no parent")
			}
			if a[telemetry.AttrOutcome].AsString() == telemetry.ReasonError && sp.Status().Code != codes.Error {
				t.Errorf("failed Redis call without error status")
			}
			if a[telemetry.AttrOutcome].AsString() == telemetry.ReasonError {
				if _, ok := a[telemetry.AttrErrorType]; !ok {
					t.Errorf("failed Redis call without error.type: %v", sp.Attributes())
				}
			}
		}
	}
	if decisionSpans != calls {
		t.Errorf("%d decision spans for %d calls", decisionSpans, calls)
	}
	if authoritySpans == 0 {
		t.Error("no authority spans")
	}
	got := rig.decisions(t)
	var sum int64
	for _, v := range got {
		sum += v
	}
	if sum != int64(calls) {
		t.Errorf("ratelimit.decisions sums to %d for %d calls: %v", sum, calls, got)
	}
	if got["false/fallback"]+got["true/fallback"] != int64(sources[leaselimit.SourceFallback]) {
		t.Errorf("fallback decisions counted %v; made %d", got, sources[leaselimit.SourceFallback])
	}
	names := rig.metricNames(t)
	for _, n := range []string{telemetry.MetricDecisions, telemetry.MetricAuthority, telemetry.MetricGrantSize,
		telemetry.MetricBreaker, telemetry.MetricTransitions, telemetry.MetricKeys, telemetry.MetricKeysFull, telemetry.MetricFallbacks} {
		if !names[n] {
			t.Errorf("metric %s not reported; have %v", n, names)
		}
	}
}

// histogramCount is how many values the histogram name recorded.
func (r *telemetryRig) histogramCount(t *testing.T, name string) uint64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			switch h := m.Data.(type) {
			case metricdata.Histogram[int64]:
				for _, dp := range h.DataPoints {
					n += dp.Count
				}
			case metricdata.Histogram[float64]:
				for _, dp := range h.DataPoints {
					n += dp.Count
				}
			}
		}
	}
	return n
}

// TestGrantSizeOfLeasesOnly: ratelimit.lease.grant.size records the grants
// of lease refills, not exact calls, whose grant is the request itself.
// Regression: every admitted exact call was recorded as a lease grant.
func TestGrantSizeOfLeasesOnly(t *testing.T) {
	ctx := context.Background()
	for _, exact := range []bool{true, false} {
		rig := newTelemetryRig(t)
		_, c := newMini(t)
		opts := rig.opts()
		if exact {
			opts = append(opts, leaselimit.WithoutLease())
		}
		lim := mustNew(t, c, hotLimit, opts...)
		for range 300 {
			if _, err := lim.Allow(ctx, "k"); err != nil {
				t.Fatal(err)
			}
		}
		calls := rig.histogramCount(t, telemetry.MetricAuthority)
		grants := rig.histogramCount(t, telemetry.MetricGrantSize)
		switch {
		case calls == 0:
			t.Errorf("exact=%v: no Redis call recorded", exact)
		case exact && grants != 0:
			t.Errorf("exact mode: %d lease grants recorded for %d Redis calls; want none", grants, calls)
		case !exact && grants == 0:
			t.Errorf("lease mode: no lease grant recorded for %d Redis calls", calls)
		}
	}
}

// TestTelemetryLeaseHits: lease-served decisions are traced and counted too.
func TestTelemetryLeaseHits(t *testing.T) {
	rig := newTelemetryRig(t)
	_, c := newMini(t)
	ctx := context.Background()
	lim := mustNew(t, c, hotLimit, rig.opts()...)
	const n = 3000
	for i := 0; i < n; i++ {
		if _, err := lim.Allow(ctx, secretKey); err != nil {
			t.Fatal(err)
		}
	}
	got := rig.decisions(t)
	if got["true/lease"] == 0 || got["true/lease"]+got["true/authority"] != n {
		t.Errorf("decisions %v; want %d allowed, mostly from the lease", got, n)
	}
	spans := 0
	for _, sp := range rig.spans.Ended() {
		if sp.Name() == telemetry.DecisionSpan {
			spans++
		}
	}
	if spans != n {
		t.Errorf("%d decision spans for %d calls", spans, n)
	}
}

// TestTelemetryEventsAndRedaction: with WithDecisionEvents, decisions are
// events on the caller's span; with a redactor, its digest (and never the
// key) is recorded.
func TestTelemetryEventsAndRedaction(t *testing.T) {
	rig := newTelemetryRig(t)
	_, c := newMini(t)
	redact := telemetry.KeyDigest([]byte("s3cret"))
	lim := mustNew(t, c, policy.PerMinute(10).WithName("ev"), append(rig.opts(),
		leaselimit.WithDecisionEvents(), leaselimit.WithKeyRedactor(redact))...)
	ctx, parent := rig.tp.Tracer("test").Start(context.Background(), "handler")
	for i := 0; i < 4; i++ {
		if _, err := lim.Allow(ctx, secretKey); err != nil {
			t.Fatal(err)
		}
	}
	if err := lim.Wait(ctx, secretKey); err != nil {
		t.Fatal(err)
	}
	parent.End()
	var events int
	for _, sp := range rig.spans.Ended() {
		if sp.Name() == telemetry.DecisionSpan {
			t.Errorf("a decision span in event mode")
		}
		checkNoKey(t, "span "+sp.Name(), fmt.Sprintf("%v %v", sp.Attributes(), sp.Events()))
		if sp.Name() != "handler" {
			continue
		}
		// Regression: the breaker's state and whether the call was
		// coalesced were set on the caller's own span, each decision
		// overwriting the last's.
		for _, kv := range sp.Attributes() {
			if strings.HasPrefix(string(kv.Key), "ratelimit.") {
				t.Errorf("the caller's span has leaselimit's attribute %v", kv)
			}
		}
		for _, ev := range sp.Events() {
			if ev.Name != telemetry.DecisionSpan {
				continue
			}
			events++
			a := attrMap(ev.Attributes)
			if a[telemetry.AttrKey].AsString() != redact(secretKey) {
				t.Errorf("event key attribute %v; want the digest %s", a[telemetry.AttrKey], redact(secretKey))
			}
		}
	}
	if events != 5 {
		t.Errorf("%d decision events on the caller's span; want 5", events)
	}
}

// TestCollectDuringNew: a metric reader that collects in a loop (a periodic
// reader, a Prometheus scrape) while Limiters are made and closed never
// sees a half-built one. Regression: the breaker-state gauge's callback was
// registered before New had made the breakers, and a collection in that
// window crashed the process (nil pointer in breakers.worst).
func TestCollectDuringNew(t *testing.T) {
	rig := newTelemetryRig(t)
	_, c := newMini(t)
	ctx := context.Background()
	stop := make(chan struct{})
	done := make(chan struct{})
	var collections int
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			var rm metricdata.ResourceMetrics
			if err := rig.reader.Collect(ctx, &rm); err != nil {
				t.Error(err)
				return
			}
			collections++
		}
	}()
	for i := range 1000 {
		lim, err := leaselimit.New(c, policy.PerSecond(10).WithName("collect"), rig.opts()...)
		if err != nil {
			t.Fatalf("New #%d: %v", i, err)
		}
		if err := lim.Close(); err != nil {
			t.Fatalf("Close #%d: %v", i, err)
		}
	}
	close(stop)
	<-done
	t.Logf("1000 New/Close with %d collections in between", collections)
}

// TestShadowDenialSpanRetryAfter: a request shadow mode admits though the
// limit denied it has, on its decision span, the retry-after the limit
// decided (the caller is told 0). Regression: the span said 0 too.
func TestShadowDenialSpanRetryAfter(t *testing.T) {
	rig := newTelemetryRig(t)
	_, c := newMini(t)
	ctx := context.Background()
	lim := mustNew(t, c, policy.PerHour(1).WithName("shadow-span"), append(rig.opts(), leaselimit.WithoutLease(), leaselimit.WithShadow())...)
	for range 2 {
		if _, err := lim.Allow(ctx, "k"); err != nil {
			t.Fatal(err)
		}
	}
	found := false
	for _, sp := range rig.spans.Ended() {
		a := attrMap(sp.Attributes())
		if sp.Name() != telemetry.DecisionSpan || a[telemetry.AttrAllowed].AsBool() {
			continue
		}
		found = true
		if r := a[telemetry.AttrRetryAfter].AsFloat64(); r < 3500 || r > 3600 {
			t.Errorf("shadow denial's span: %s = %v; want the limit's, about 3600 s", telemetry.AttrRetryAfter, r)
		}
	}
	if !found {
		t.Fatal("no decision span of a shadow denial")
	}
}

// TestReserveErrorTraced: a Reserve that fails before deciding (a closed
// Client, an invalid limit) has its decision span with the error's reason,
// as Allow's has. Regression: it returned the error with no span.
func TestReserveErrorTraced(t *testing.T) {
	rig := newTelemetryRig(t)
	_, c := newMini(t)
	ctx := context.Background()
	cl, err := leaselimit.NewClient(c, rig.opts()...)
	if err != nil {
		t.Fatal(err)
	}
	invalid := cl.Limiter(policy.Limit{Name: "bad", Rate: 0, Period: time.Second, Burst: 1})
	if _, err := invalid.Reserve(ctx, "k", 1); !errors.Is(err, policy.ErrInvalidLimit) {
		t.Fatalf("Reserve on an invalid limit: %v; want ErrInvalidLimit", err)
	}
	lim := cl.Limiter(policy.PerHour(10).WithName("closed"))
	_ = cl.Close()
	if _, err := lim.Reserve(ctx, "k", 1); !errors.Is(err, leaselimit.ErrClosed) {
		t.Fatalf("Reserve after Close: %v; want ErrClosed", err)
	}
	reasons := map[string]int{}
	for _, sp := range rig.spans.Ended() {
		if sp.Name() == telemetry.DecisionSpan {
			reasons[attrMap(sp.Attributes())[telemetry.AttrReason].AsString()]++
		}
	}
	if reasons["invalid_limit"] != 1 || reasons["closed"] != 1 {
		t.Errorf("decision spans by reason %v; want one invalid_limit and one closed", reasons)
	}
}

// full reads ratelimit.keys.full by outcome.
func (r *telemetryRig) full(t *testing.T) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for _, m := range r.metrics(t) {
		if m.Name != telemetry.MetricKeysFull {
			continue
		}
		sum := m.Data.(metricdata.Sum[int64])
		if !sum.IsMonotonic {
			t.Errorf("%s is not monotonic", m.Name)
		}
		for _, dp := range sum.DataPoints {
			o, _ := dp.Attributes.Value(telemetry.AttrOutcome)
			out[o.AsString()] += dp.Value
		}
	}
	return out
}

// TestFullTableMetric: a table of one key per shard (WithMaxKeys(64)) fed
// 1,000 keys, each asked for twice in a row, counts on ratelimit.keys.full
// the new keys it declined (a limit whose leases stay live: the key to
// evict holds one) and those it took in by evicting one (a limit of one
// token an hour: the first decision spends it, the refill is denied, and
// the key holds no lease).
func TestFullTableMetric(t *testing.T) {
	for _, tc := range []struct {
		limit policy.Limit
		want  string
	}{
		{policy.PerSecond(1_000_000).WithName("full-live"), telemetry.FullDeclined},
		{policy.Limit{Name: "full-spent", Rate: 1, Period: time.Hour, Burst: 1}, telemetry.FullEvicted},
	} {
		t.Run(tc.want, func(t *testing.T) {
			_, rc := newMini(t)
			rig := newTelemetryRig(t)
			lim := mustNew(t, rc, tc.limit, append(rig.opts(), leaselimit.WithMaxKeys(64))...)
			if got := rig.full(t); got[telemetry.FullEvicted]+got[telemetry.FullDeclined] != 0 {
				t.Fatalf("ratelimit.keys.full before any key: %v; want 0 of each", got)
			}
			for i := range 1000 {
				for range 2 {
					if _, err := lim.Allow(context.Background(), "full-"+strconv.Itoa(i)); err != nil {
						t.Fatal(err)
					}
				}
			}
			got := rig.full(t)
			t.Logf("ratelimit.keys.full: %v; local keys %d", got, lim.LocalKeys())
			if n := int64(1000 - lim.LocalKeys()); got[telemetry.FullEvicted]+got[telemetry.FullDeclined] != n {
				t.Errorf("ratelimit.keys.full = %v; want %d in all, a count for each key that found its shard full", got, n)
			}
			if got[tc.want] < 500 {
				t.Errorf("ratelimit.keys.full{%s} = %d after 1,000 keys through 64 places; want most of the 936 that found no room", tc.want, got[tc.want])
			}
		})
	}
}
