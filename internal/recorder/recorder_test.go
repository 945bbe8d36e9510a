package recorder

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/leaselimit/leaselimit/telemetry"

	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace/noop"
)

// replyError is an error reply as go-redis returns one (a redis.Error).
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

func TestErrorType(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{context.DeadlineExceeded, "timeout"},
		{fmt.Errorf("%w: no reply", circuit.ErrBudget), "timeout"},
		{fmt.Errorf("%w: %w", circuit.ErrUnreachable, fmt.Errorf("%w: no reply", circuit.ErrBudget)), "network"},
		{&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, "network"},
		{&net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded}, "network"}, // a dial timeout
		{&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, "timeout"},
		{&net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, "network"},
		{replyError("LOADING Redis is loading the dataset in memory"), "LOADING"},
		{fmt.Errorf("evalsha: %w", redis.ErrNoScript), "NOSCRIPT"},
		{errors.New("LOADING as plain text, not a Redis reply"), "*errors.errorString"},
		{errors.New("something else"), "*errors.errorString"},
	} {
		if got := errorType(tc.err); got != tc.want {
			t.Errorf("errorType(%v) = %q; want %q", tc.err, got, tc.want)
		}
	}
}

// TestReasonSlots: every fallback reason has its pre-built attribute set,
// so ratelimit.fallbacks counts it (CountFallback drops a reason it has no
// slot for).
func TestReasonSlots(t *testing.T) {
	for _, r := range []string{telemetry.ReasonBreakerOpen, telemetry.ReasonTimeout, telemetry.ReasonUnreachable, telemetry.ReasonError, telemetry.ReasonSaturated} {
		if slot(reasons[:], r) < 0 {
			t.Errorf("fallback reason %q has no slot in reasons", r)
		}
	}
}

// TestNoopProviderIsNotTraced: an explicit no-op provider turns tracing off,
// so a decision starts no span and allocates nothing for tracing.
func TestNoopProviderIsNotTraced(t *testing.T) {
	r, err := New(Config{TracerProvider: noop.NewTracerProvider(), LimitName: "x"})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Tracing() {
		t.Error("Tracing() with a no-op provider")
	}
	if n := testing.AllocsPerRun(100, func() { r.CountDecision(context.Background(), true, 0, false) }); n != 0 {
		t.Errorf("CountDecision allocates %v times", n)
	}
}

// TestEndDecisionOutcome: EndDecision gives every decision span and event
// a ratelimit.outcome; an error adds error.type (a caller's error: its
// reason) and, only for an error that is not the caller's, the Error status
// of a decision span.
func TestEndDecisionOutcome(t *testing.T) {
	for _, tc := range []struct {
		name    string
		o       Outcome
		outcome string
		errType string // "" for none
		status  codes.Code
	}{
		{"allowed", Outcome{Allowed: true}, telemetry.OutcomeAllowed, "", codes.Unset},
		{"denied", Outcome{}, telemetry.OutcomeDenied, "", codes.Unset},
		{"caller", Outcome{Err: context.Canceled, CallerError: true, Reason: "canceled"}, telemetry.OutcomeError, "canceled", codes.Unset},
		{"caller without a reason", Outcome{Err: context.Canceled, CallerError: true}, telemetry.OutcomeError, "*errors.errorString", codes.Unset},
		{"redis", Outcome{Err: replyError("NOPERM no"), Reason: "redis_error"}, telemetry.OutcomeError, "NOPERM", codes.Error},
	} {
		for _, events := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/events=%v", tc.name, events), func(t *testing.T) {
				rec := tracetest.NewSpanRecorder()
				tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
				defer tp.Shutdown(context.Background())
				r, err := New(Config{TracerProvider: tp, LimitName: "x", Sources: []string{"lease"}, Events: events})
				if err != nil {
					t.Fatal(err)
				}
				defer r.Close()
				ctx, parent := tp.Tracer("test").Start(context.Background(), "handler")
				_, span := r.StartDecision(ctx)
				r.EndDecision(span, tc.o)
				parent.End()

				var attrs []attribute.KeyValue
				status := codes.Unset
				for _, s := range rec.Ended() {
					if !events && s.Name() == telemetry.DecisionSpan {
						attrs, status = s.Attributes(), s.Status().Code
					}
					for _, ev := range s.Events() {
						if events && ev.Name == telemetry.DecisionSpan {
							attrs, status = ev.Attributes, s.Status().Code
						}
					}
				}
				got := attribute.NewSet(attrs...)
				if v, _ := got.Value(telemetry.AttrOutcome); v.AsString() != tc.outcome {
					t.Errorf("ratelimit.outcome %q; want %q (%v)", v.AsString(), tc.outcome, attrs)
				}
				if v, ok := got.Value(telemetry.AttrErrorType); v.AsString() != tc.errType || ok != (tc.errType != "") {
					t.Errorf("error.type %q, %v; want %q", v.AsString(), ok, tc.errType)
				}
				want := tc.status
				if events {
					want = codes.Unset // the caller's span is the caller's to mark
				}
				if status != want {
					t.Errorf("status %v; want %v", status, want)
				}
			})
		}
	}
}
