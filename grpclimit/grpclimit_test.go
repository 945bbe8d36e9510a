package grpclimit_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/grpclimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// serve starts a gRPC server with the health service behind lim's
// interceptors (keyed by the x-key metadata) on an in-memory listener, and
// returns a client connection to it.
func serve(t *testing.T, lim grpclimit.Limiter, client ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	key := grpclimit.MetadataKey("x-key")
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(grpclimit.UnaryServerInterceptor(lim, key)),
		grpc.ChainStreamInterceptor(grpclimit.StreamServerInterceptor(lim, key)),
	)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	opts := append([]grpc.DialOption{
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
	}, client...)
	conn, err := grpc.NewClient("passthrough:///bufnet", opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func newLimiter(t *testing.T, srv *redistest.Server, l policy.Limit, opts ...leaselimit.Option) *leaselimit.Limiter {
	t.Helper()
	lim, err := leaselimit.New(srv.Client(t), l, append([]leaselimit.Option{leaselimit.WithTimeout(10 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lim.Close() })
	return lim
}

func keyed(key string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "x-key", key)
}

// TestUnaryAndStream: calls over the limit are refused with
// ResourceExhausted and RetryInfo; every decided call carries the
// RateLimit fields as header metadata; a stream takes its tokens once; a
// call without a key is refused with InvalidArgument.
func TestUnaryAndStream(t *testing.T) {
	srv := redistest.Start(t)
	lim := newLimiter(t, srv, policy.Limit{Name: "grpc", Rate: 3, Period: time.Hour, Burst: 3}, leaselimit.WithoutLease())
	hc := healthpb.NewHealthClient(serve(t, lim))
	for i := 0; i < 2; i++ {
		var md metadata.MD
		if _, err := hc.Check(keyed("ann"), &healthpb.HealthCheckRequest{}, grpc.Header(&md)); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if got, want := md.Get(grpclimit.MetadataRateLimitPolicy), []string{`"grpc";q=3;w=3600`}; len(got) != 1 || got[0] != want[0] {
			t.Errorf("call %d: ratelimit-policy %v; want %v", i, got, want)
		}
		if got := md.Get(grpclimit.MetadataRateLimit); len(got) != 1 || got[0] != []string{`"grpc";r=2;t=1200`, `"grpc";r=1;t=1200`}[i] {
			t.Errorf("call %d: ratelimit %v", i, got)
		}
	}
	// A stream takes one token when it opens.
	stream, err := hc.Watch(keyed("ann"), &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("stream: %v", err)
	}
	var md metadata.MD
	_, err = hc.Check(keyed("ann"), &healthpb.HealthCheckRequest{}, grpc.Header(&md))
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("call past the limit = %v; want ResourceExhausted", err)
	}
	wait, ok := grpclimit.RetryAfter(err)
	if !ok || wait < 19*time.Minute || wait > 20*time.Minute {
		t.Errorf("RetryInfo %v, %v; want about 20m (3 per hour)", wait, ok)
	}
	if got := md.Get(grpclimit.MetadataRateLimit); len(got) != 1 || got[0] != `"grpc";r=0;t=1200` {
		t.Errorf("refused call: ratelimit %v", got)
	}
	if _, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("call without a key = %v; want InvalidArgument", err)
	}
}

// TestClientRetry: the client interceptor waits out RetryInfo and calls
// again, within its attempts and the call's deadline.
func TestClientRetry(t *testing.T) {
	srv := redistest.Start(t)
	lim := newLimiter(t, srv, policy.Limit{Name: "retry", Rate: 5, Period: time.Second, Burst: 1}, leaselimit.WithoutLease())
	patient := healthpb.NewHealthClient(serve(t, lim, grpc.WithChainUnaryInterceptor(grpclimit.UnaryClientInterceptor(3))))
	hasty := healthpb.NewHealthClient(serve(t, lim))
	if _, err := patient.Check(keyed("k"), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := hasty.Check(keyed("k"), &healthpb.HealthCheckRequest{}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("second call within 200ms = %v; want ResourceExhausted", err)
	}
	start := time.Now()
	if _, err := patient.Check(keyed("k"), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("the retrying client = %v; want it to wait out RetryInfo and succeed", err)
	}
	t.Logf("the retrying client got through after %v", time.Since(start))
	ctx, cancel := context.WithTimeout(keyed("k"), time.Millisecond)
	defer cancel()
	if _, err := patient.Check(ctx, &healthpb.HealthCheckRequest{}); status.Code(err) != codes.ResourceExhausted && status.Code(err) != codes.DeadlineExceeded {
		t.Errorf("a call whose deadline cannot cover the wait = %v; want it refused at once", err)
	}
}

// TestMultiLimitAndShadow: a multi-limit sends one entry per limit; a
// shadow limit sends none and refuses nothing.
func TestMultiLimitAndShadow(t *testing.T) {
	srv := redistest.Start(t)
	burst := policy.Limit{Name: "burst", Rate: 10, Period: time.Minute, Burst: 10}
	daily := policy.Quota("daily", 1, policy.Day, nil)
	root := newLimiter(t, srv, burst, leaselimit.WithoutLease())
	hc := healthpb.NewHealthClient(serve(t, root.For(burst, daily)))
	var md metadata.MD
	if _, err := hc.Check(keyed("m"), &healthpb.HealthCheckRequest{}, grpc.Header(&md)); err != nil {
		t.Fatal(err)
	}
	if got := md.Get(grpclimit.MetadataRateLimitPolicy); len(got) != 2 {
		t.Errorf("ratelimit-policy %v; want one entry per limit", got)
	}
	_, err := hc.Check(keyed("m"), &healthpb.HealthCheckRequest{})
	if st, _ := status.FromError(err); st.Code() != codes.ResourceExhausted || st.Message() == "" {
		t.Errorf("call past the daily quota = %v", err)
	}

	shadow := healthpb.NewHealthClient(serve(t, root.For(daily.WithName("trial")).Enforcing(0)))
	for i := 0; i < 3; i++ {
		var md metadata.MD
		if _, err := shadow.Check(keyed("s"), &healthpb.HealthCheckRequest{}, grpc.Header(&md)); err != nil {
			t.Fatalf("shadow call %d = %v; a shadow limit must not refuse", i, err)
		}
		if len(md.Get(grpclimit.MetadataRateLimit)) != 0 {
			t.Errorf("shadow call %d sent ratelimit metadata", i)
		}
	}
}
