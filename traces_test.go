package leaselimit_test

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// attrOf returns the value of key on span s.
func attrOf(s sdktrace.ReadOnlySpan, key attribute.Key) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if kv.Key == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

func spansNamed(r *telemetryRig, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range r.spans.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

// TestTracesForOperators: on a real redis-server, Redis client spans carry
// the database semantic conventions (server.address, server.port,
// db.namespace), refunds have spans, exact-mode decisions say the breaker
// state and that they were not coalesced, and a decision that ended with
// the caller's error says so in ratelimit.outcome and ratelimit.reason.
func TestTracesForOperators(t *testing.T) {
	srv := redistest.Start(t)
	rig := newTelemetryRig(t)
	ctx := context.Background()
	host, port, _ := net.SplitHostPort(srv.Addr)

	exact := mustNew(t, srv.Client(t), policy.PerSecond(100).WithName("tr-exact"), append(rig.opts(), leaselimit.WithoutLease())...)
	if _, err := exact.Allow(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	auth := spansNamed(rig, telemetry.AuthoritySpan)
	if len(auth) != 1 {
		t.Fatalf("%d authority spans; want 1", len(auth))
	}
	for key, want := range map[attribute.Key]string{
		telemetry.AttrServerAddress: host, telemetry.AttrServerPort: port, telemetry.AttrDBNamespace: "0",
		telemetry.AttrDBSystem: "redis", "service.peer.name": "redis", "peer.service": "redis",
	} {
		if v, ok := attrOf(auth[0], key); !ok || v.String() != want {
			t.Errorf("authority span %s = %q; want %q", key, v.String(), want)
		}
	}
	dec := spansNamed(rig, telemetry.DecisionSpan)
	if len(dec) != 1 {
		t.Fatalf("%d decision spans", len(dec))
	}
	if v, ok := attrOf(dec[0], telemetry.AttrBreaker); !ok || v.AsString() != "closed" {
		t.Errorf("exact-mode decision span: ratelimit.breaker.state %q, %v", v.String(), ok)
	}
	if v, ok := attrOf(dec[0], telemetry.AttrCoalesced); !ok || v.AsBool() {
		t.Errorf("exact-mode decision span: ratelimit.coalesced %v, %v; want false", v.String(), ok)
	}

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, _ = exact.Allow(cctx, "k2")
	_, _ = exact.Allow(ctx, "")
	for _, s := range spansNamed(rig, telemetry.DecisionSpan)[1:] {
		out, _ := attrOf(s, telemetry.AttrOutcome)
		reason, _ := attrOf(s, telemetry.AttrReason)
		if out.AsString() != "error" || (reason.AsString() != "canceled" && reason.AsString() != "invalid_key") {
			t.Errorf("decision span of a caller error: outcome %q, reason %q", out.String(), reason.String())
		}
	}

	leased := mustNew(t, srv.Client(t), policy.PerSecond(1_000_000).WithName("tr-lease"), rig.opts()...)
	for i := 0; i < 2000; i++ {
		if _, err := leased.Allow(ctx, "hot"); err != nil {
			t.Fatal(err)
		}
	}
	if err := leased.Close(); err != nil {
		t.Fatal(err)
	}
	refunds := spansNamed(rig, telemetry.RefundSpan)
	if len(refunds) == 0 {
		t.Fatal("no refund span after Close gave leased tokens back")
	}
	if v, ok := attrOf(refunds[len(refunds)-1], telemetry.AttrServerPort); !ok || v.String() != port {
		t.Errorf("refund span server.port = %q", v.String())
	}
}

// TestTimedOutCallSpanEndsFirst: when Redis hangs, the authority span of a
// call given up at the budget ends no later than its decision span, and the
// decision span has the breaker state from before the call, which the
// timeout then trips.
func TestTimedOutCallSpanEndsFirst(t *testing.T) {
	srv := redistest.Start(t)
	rig := newTelemetryRig(t)
	ctx := context.Background()
	lim := mustNew(t, srv.Client(t), policy.PerSecond(100).WithName("tr-hung"),
		append(rig.opts(), leaselimit.WithoutLease(), leaselimit.WithTimeout(100*time.Millisecond),
			leaselimit.WithBreaker(breaker.Settings{Failures: 1}))...)
	if _, err := lim.Allow(ctx, "warm"); err != nil {
		t.Fatal(err)
	}
	srv.Pause(t)
	d, err := lim.Allow(ctx, "k")
	srv.Resume(t)
	if err != nil || d.Source != leaselimit.SourceFallback {
		t.Fatalf("Allow with Redis hung = %+v, %v; want a fallback", d, err)
	}
	var decision, call sdktrace.ReadOnlySpan
	for _, s := range rig.spans.Ended() {
		switch {
		case s.Name() == telemetry.DecisionSpan && s.StartTime().After(rig.spans.Ended()[0].EndTime()):
			decision = s
		case s.Name() == telemetry.AuthoritySpan && decision == nil && s.Parent().IsValid():
			call = s
		}
	}
	if decision == nil || call == nil {
		t.Fatalf("spans: %d ended; want the hung decision and its call", len(rig.spans.Ended()))
	}
	if call.Parent().SpanID() != decision.SpanContext().SpanID() {
		t.Fatal("the call span is not the decision's child")
	}
	if call.EndTime().After(decision.EndTime()) {
		t.Errorf("the call span ended %v after its decision span", call.EndTime().Sub(decision.EndTime()))
	}
	if v, _ := attrOf(call, telemetry.AttrErrorType); v.AsString() != "timeout" {
		t.Errorf("hung call error.type %q; want timeout", v.String())
	}
	if v, _ := attrOf(decision, telemetry.AttrBreaker); v.AsString() != "closed" || lim.BreakerState() != breaker.Open {
		t.Errorf("decision span ratelimit.breaker.state %q, breaker now %v; want closed (before the call), open (after)", v.String(), lim.BreakerState())
	}
}

// TestRefusedConnectionIsNetwork: calls to an address where nothing
// listens are classified as network errors, not timeouts, under go-redis's
// default retries.
func TestRefusedConnectionIsNetwork(t *testing.T) {
	mostlyWaits(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	// Default options (the call detached from its waiter) and
	// ContextTimeoutEnabled (the call bounded by its context).
	for _, direct := range []bool{false, true} {
		t.Run(map[bool]string{false: "detached", true: "direct"}[direct], func(t *testing.T) {
			c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: direct})
			t.Cleanup(func() { _ = c.Close() })
			rig := newTelemetryRig(t)
			lim := mustNew(t, c, policy.PerSecond(10).WithName("tr-refused"),
				append(rig.opts(), leaselimit.WithoutLease(), leaselimit.WithTimeout(100*time.Millisecond))...)
			ctx := context.Background()
			for i := 0; i < 8; i++ {
				_, _ = lim.Allow(ctx, "k"+strconv.Itoa(i))
			}
			types := map[string]int{}
			for _, s := range spansNamed(rig, telemetry.AuthoritySpan) {
				v, _ := attrOf(s, telemetry.AttrErrorType)
				types[v.AsString()]++
			}
			t.Logf("authority spans by error.type: %v", types)
			if types["network"] == 0 || types["timeout"] > 0 {
				t.Errorf("refused connections by error.type: %v; want network, no timeout", types)
			}
		})
	}
}

// decisionRecord is one decision as traced: a ratelimit.decision span, or
// an event of that name with the status of the span it is on.
type decisionRecord struct {
	attrs  map[attribute.Key]attribute.Value
	status codes.Code
}

// decisionRecords returns the decisions rig recorded, in the order they
// ended: spans, or in event mode the events on the caller's spans.
func decisionRecords(rig *telemetryRig, events bool) []decisionRecord {
	var out []decisionRecord
	for _, s := range rig.spans.Ended() {
		if !events && s.Name() == telemetry.DecisionSpan {
			out = append(out, decisionRecord{attrMap(s.Attributes()), s.Status().Code})
		}
		if events {
			for _, ev := range s.Events() {
				if ev.Name == telemetry.DecisionSpan {
					out = append(out, decisionRecord{attrMap(ev.Attributes), s.Status().Code})
				}
			}
		}
	}
	return out
}

// TestDecisionSpanOutcomes: every decision span (and event) says its
// ratelimit.outcome; one that ended in the caller's error, of each kind,
// has outcome error, error.type and ratelimit.reason naming the kind, and
// its status stays Unset (the caller's error is not the rate limiter's
// failure); one that ended in Redis's error is a span error with error.type.
func TestDecisionSpanOutcomes(t *testing.T) {
	mostlyWaits(t)
	cases := []struct {
		reason string
		hung   bool // Redis does not answer
		call   func(ctx context.Context, lim *leaselimit.Limiter) error
	}{
		{"invalid_key", false, func(ctx context.Context, lim *leaselimit.Limiter) error {
			_, err := lim.Allow(ctx, "")
			return err
		}},
		{"invalid_cost", false, func(ctx context.Context, lim *leaselimit.Limiter) error {
			_, err := lim.AllowN(ctx, "k", 0)
			return err
		}},
		{"invalid_limit", false, func(ctx context.Context, lim *leaselimit.Limiter) error {
			_, err := lim.For(policy.Limit{Name: "tr-invalid"}).Allow(ctx, "k")
			return err
		}},
		{"canceled", false, func(ctx context.Context, lim *leaselimit.Limiter) error {
			if _, err := lim.Allow(ctx, "k"); err != nil { // the bucket's one token
				return err
			}
			ctx, cancel := context.WithCancel(ctx)
			time.AfterFunc(20*time.Millisecond, cancel) // while Wait waits for the next
			return lim.Wait(ctx, "k")
		}},
		{"deadline_exceeded", true, func(ctx context.Context, lim *leaselimit.Limiter) error {
			// Redis hangs, the budget is ample: the caller's deadline ends the wait.
			ctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			defer cancel()
			_, err := lim.Allow(ctx, "k")
			return err
		}},
		{"would_exceed_deadline", false, func(ctx context.Context, lim *leaselimit.Limiter) error {
			if _, err := lim.Allow(ctx, "k"); err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(ctx, time.Minute) // the next token is an hour away
			defer cancel()
			return lim.Wait(ctx, "k")
		}},
		{"closed", false, func(ctx context.Context, lim *leaselimit.Limiter) error {
			if err := lim.Close(); err != nil {
				return err
			}
			_, err := lim.Allow(ctx, "k")
			return err
		}},
	}
	for _, events := range []bool{false, true} {
		for _, c := range cases {
			t.Run(fmt.Sprintf("%s/events=%v", c.reason, events), func(t *testing.T) {
				rig := newTelemetryRig(t)
				m, rdb := newMini(t)
				if c.hung {
					proxy := redistest.NewProxy(t, m.Addr())
					proxy.Blackhole(true)
					// A short read timeout, so that Close does not wait long for the call.
					rdb = redisClientOpts(t, &redis.Options{Addr: proxy.Addr, ReadTimeout: 100 * time.Millisecond})
				}
				opts := append(rig.opts(), leaselimit.WithoutLease())
				ctx := context.Background()
				var parent trace.Span
				if events {
					opts = append(opts, leaselimit.WithDecisionEvents())
					ctx, parent = rig.tp.Tracer("test").Start(ctx, "handler")
				}
				lim := mustNew(t, rdb, policy.PerHour(1).WithName("tr-outcome"), opts...)
				err := c.call(ctx, lim)
				if parent != nil {
					parent.End()
				}
				if err == nil {
					t.Fatalf("the call returned no error; want one that is %s", c.reason)
				}
				recs := decisionRecords(rig, events)
				if len(recs) == 0 {
					t.Fatal("no decision recorded")
				}
				for i, r := range recs {
					if _, ok := r.attrs[telemetry.AttrOutcome]; !ok {
						t.Errorf("decision %d has no ratelimit.outcome: %v", i, r.attrs)
					}
					if r.status != codes.Unset {
						t.Errorf("decision %d: status %v; want Unset", i, r.status)
					}
				}
				for i, r := range recs[:len(recs)-1] { // the token taken before Wait
					if got := r.attrs[telemetry.AttrOutcome].AsString(); got != telemetry.OutcomeAllowed {
						t.Errorf("decision %d: ratelimit.outcome %q; want %q", i, got, telemetry.OutcomeAllowed)
					}
					if _, ok := r.attrs[telemetry.AttrErrorType]; ok {
						t.Errorf("decision %d, admitted, has error.type: %v", i, r.attrs)
					}
				}
				last := recs[len(recs)-1].attrs
				for key, want := range map[attribute.Key]string{
					telemetry.AttrOutcome: telemetry.OutcomeError, telemetry.AttrReason: c.reason, telemetry.AttrErrorType: c.reason,
				} {
					if got := last[key].AsString(); got != want {
						t.Errorf("decision that ended with %v: %s = %q; want %q", err, key, got, want)
					}
				}
				if _, ok := last[telemetry.AttrAllowed]; ok {
					t.Errorf("decision that ended with an error has ratelimit.allowed: %v", last)
				}
			})
		}
	}

	t.Run("denied", func(t *testing.T) {
		rig := newTelemetryRig(t)
		_, rdb := newMini(t)
		lim := mustNew(t, rdb, policy.PerHour(1).WithName("tr-denied"), rig.opts()...)
		for range 2 {
			if _, err := lim.Allow(context.Background(), "k"); err != nil {
				t.Fatal(err)
			}
		}
		recs := decisionRecords(rig, false)
		var got []string
		for _, r := range recs {
			got = append(got, r.attrs[telemetry.AttrOutcome].AsString())
		}
		if want := []string{telemetry.OutcomeAllowed, telemetry.OutcomeDenied}; !slices.Equal(got, want) {
			t.Errorf("ratelimit.outcome of an admission and a denial: %q; want %q", got, want)
		}
	})

	// Not the caller's error: Redis refuses the script (an ACL without
	// TIME), which is returned, not hidden behind the failure policy.
	t.Run("redis_error", func(t *testing.T) {
		srv := redistest.Start(t)
		srv.Do(t, "ACL", "SETUSER", "tr-narrow", "reset", "on", ">pw", "~leaselimit:*", "resetchannels", "-@all", "+evalsha", "+eval")
		rdb := redisClientOpts(t, &redis.Options{Addr: srv.Addr, Username: "tr-narrow", Password: "pw"})
		rig := newTelemetryRig(t)
		lim := mustNew(t, rdb, policy.PerSecond(10).WithName("tr-redis-error"), append(rig.opts(), leaselimit.WithoutLease())...)
		if _, err := lim.Allow(context.Background(), "k"); err == nil {
			t.Fatal("Allow with an ACL lacking TIME returned no error")
		}
		recs := decisionRecords(rig, false)
		if len(recs) != 1 {
			t.Fatalf("%d decision spans; want 1", len(recs))
		}
		r := recs[0]
		if got := r.attrs[telemetry.AttrOutcome].AsString(); got != telemetry.OutcomeError {
			t.Errorf("ratelimit.outcome %q; want %q", got, telemetry.OutcomeError)
		}
		if got := r.attrs[telemetry.AttrReason].AsString(); got != "redis_error" {
			t.Errorf("ratelimit.reason %q; want redis_error", got)
		}
		t.Logf("error.type %q", r.attrs[telemetry.AttrErrorType].AsString())
		if et := r.attrs[telemetry.AttrErrorType].AsString(); et == "" || et == "redis_error" {
			t.Errorf("error.type %q; want the Redis error's own type", et)
		}
		if r.status != codes.Error {
			t.Errorf("status %v; want Error", r.status)
		}
	})
}
