package leaselimit_test

import (
	"context"
	"log"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// Traces to a collector over OTLP/HTTP (the endpoint from
// OTEL_EXPORTER_OTLP_ENDPOINT), with a resource that names the service, its
// release and the process, sampling 1% of the decisions: the README's
// snippet, compiled (it needs a Redis and a collector, so it is not run).
func ExampleWithTracerProvider() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	const version = "1.4.2" // your service's release

	res, err := resource.New(ctx,
		resource.WithService(), // service.instance.id: a random UUID per process
		resource.WithAttributes(semconv.ServiceName("checkout"), semconv.ServiceVersion(version)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
	)
	if err != nil {
		log.Fatal(err)
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		log.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithResource(res),
		sdktrace.WithBatcher(exp),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0.01))),
	)
	defer tp.Shutdown(ctx)
	c, err := leaselimit.NewClient(rdb,
		leaselimit.WithTracerProvider(tp),
		leaselimit.WithKeyRedactor(telemetry.KeyDigest([]byte("a secret shared by the fleet"))), // optional
	)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	api := c.Limiter(policy.PerSecond(100).WithName("api"))
	_, _ = api.Allow(ctx, "user:42") // one ratelimit.decision span, sampled as the parent says
}
