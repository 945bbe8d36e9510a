package grpclimit_test

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/grpclimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
)

// service stands for your services: grpc's test service, whose EmptyCall
// answers at once and whose StreamingOutputCall sends one response.
type service struct {
	testgrpc.UnimplementedTestServiceServer
}

func (service) EmptyCall(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) {
	return &testgrpc.Empty{}, nil
}

func (service) StreamingOutputCall(_ *testgrpc.StreamingOutputCallRequest, s testgrpc.TestService_StreamingOutputCallServer) error {
	return s.Send(&testgrpc.StreamingOutputCallResponse{})
}

// A gRPC server whose calls are limited per API key, 2 per minute; its
// health service answers probes that carry no key.
func Example() {
	mr, _ := miniredis.Run() // an embedded Redis for the example; use your own
	defer mr.Close()
	mr.SetTime(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC))
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	c, err := leaselimit.NewClient(rdb)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()
	lim := c.Limiter(policy.PerMinute(2).WithName("api"))

	lis := bufconn.Listen(1 << 20) // an in-memory listener for the example
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(grpclimit.UnaryServerInterceptor(lim, grpclimit.MetadataKey("x-api-key"))))
	testgrpc.RegisterTestServiceServer(srv, service{})
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	conn, _ := grpc.NewClient("passthrough:///example",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	defer conn.Close()

	client := testgrpc.NewTestServiceClient(conn)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "x-api-key", "key-1")
	for i := 0; i < 3; i++ {
		var md metadata.MD
		_, err := client.EmptyCall(ctx, &testgrpc.Empty{}, grpc.Header(&md))
		wait, _ := grpclimit.RetryAfter(err)
		fmt.Println(status.Code(err), md.Get("ratelimit"), wait)
	}
	// The health service is not limited: no key, no tokens.
	r, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
	fmt.Println(r.GetStatus(), status.Code(err))
	// Output:
	// OK ["api";r=1;t=30] 0s
	// OK ["api";r=0;t=30] 0s
	// ResourceExhausted ["api";r=0;t=30] 30s
	// SERVING OK
}
