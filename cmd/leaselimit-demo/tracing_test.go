package main

import (
	"context"
	"regexp"
	"testing"

	"github.com/leaselimit/leaselimit"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/resource"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// uuidV4 is the form of a random (version 4) UUID.
var uuidV4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// resourceAttr returns the value of key in res, "" if it has none.
func resourceAttr(res *resource.Resource, key attribute.Key) string {
	v, _ := res.Set().Value(key)
	return v.AsString()
}

// TestServiceResource: the exported spans' resource names the service, its
// version (leaselimit.Version) and the instance (a random UUID per
// process), so that a tracing backend can tell the demo's runs apart; the
// standard environment variables override each of them.
func TestServiceResource(t *testing.T) {
	noOTLPEnv(t)
	t.Setenv("OTEL_SERVICE_NAME", "")
	t.Setenv("OTEL_RESOURCE_ATTRIBUTES", "")
	ctx := context.Background()

	t.Run("exported", func(t *testing.T) {
		c := newCollector(t)
		tr := newTracing(ctx, &config{otlp: c.URL, traceRatio: 1})
		t.Cleanup(func() { _ = tr.close() })
		if tr.tp == nil {
			t.Fatalf("no exporting provider: %v", tr.setupErr)
		}
		if tr.resErr != nil {
			t.Errorf("resource error: %v", tr.resErr)
		}
		rec := tracetest.NewSpanRecorder()
		tr.tp.RegisterSpanProcessor(rec)
		_, sp := tr.tp.Tracer("test").Start(ctx, "probe")
		sp.End()
		ended := rec.Ended()
		if len(ended) != 1 {
			t.Fatalf("%d spans recorded; want 1", len(ended))
		}
		res := ended[0].Resource()
		for key, want := range map[attribute.Key]string{
			semconv.ServiceNameKey:    serviceName,
			semconv.ServiceVersionKey: leaselimit.Version,
		} {
			if got := resourceAttr(res, key); got != want {
				t.Errorf("resource %s = %q; want %q", key, got, want)
			}
		}
		if id := resourceAttr(res, semconv.ServiceInstanceIDKey); !uuidV4.MatchString(id) {
			t.Errorf("resource service.instance.id = %q; want a random UUID", id)
		}
		if got := res.SchemaURL(); got != semconv.SchemaURL {
			t.Errorf("resource schema URL %q; want %q", got, semconv.SchemaURL)
		}
	})

	t.Run("per process", func(t *testing.T) {
		a, errA := serviceResource(ctx)
		b, errB := serviceResource(ctx)
		if errA != nil || errB != nil {
			t.Fatal(errA, errB)
		}
		idA, idB := resourceAttr(a, semconv.ServiceInstanceIDKey), resourceAttr(b, semconv.ServiceInstanceIDKey)
		if idA == "" || idA == idB {
			t.Errorf("service.instance.id of two processes: %q and %q; want two different ids", idA, idB)
		}
	})

	t.Run("environment", func(t *testing.T) {
		t.Setenv("OTEL_SERVICE_NAME", "demo-canary")
		t.Setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7,service.version=1.2.3")
		res, err := serviceResource(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for key, want := range map[attribute.Key]string{
			semconv.ServiceNameKey:       "demo-canary",
			semconv.ServiceVersionKey:    "1.2.3",
			semconv.ServiceInstanceIDKey: "pod-7",
		} {
			if got := resourceAttr(res, key); got != want {
				t.Errorf("resource %s = %q; want %q from the environment", key, got, want)
			}
		}
	})
}
