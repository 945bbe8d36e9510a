package leaselimit

import (
	"context"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

// newMini starts a miniredis for the test and a client on it, both closed
// when the test ends; opts, if set, are the client's options (its Addr is
// filled in).
func newMini(t *testing.T, opts *redis.Options) (*miniredis.Miniredis, *redis.Client) {
	t.Helper()
	m := miniredis.RunT(t)
	if opts == nil {
		opts = &redis.Options{}
	}
	opts.Addr = m.Addr()
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	return m, c
}

// meteredLimiter returns a Limiter of limit on c with opts, its metrics
// read by the reader it returns; both are closed when the test ends.
func meteredLimiter(t *testing.T, c redis.UniversalClient, limit policy.Limit, opts ...Option) (*Limiter, *sdkmetric.ManualReader) {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	l, err := New(c, limit, append(opts[:len(opts):len(opts)], WithMeterProvider(mp))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l, reader
}
