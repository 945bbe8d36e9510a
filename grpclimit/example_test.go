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
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
)

// A gRPC server whose calls are limited per API key, 2 per minute.
func Example() {
	mr, _ := miniredis.Run() // an embedded Redis for the example; use your own
	defer mr.Close()
	mr.SetTime(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC))
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	lim, err := leaselimit.New(rdb, policy.PerMinute(2).WithName("api"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer lim.Close()

	lis := bufconn.Listen(1 << 20) // an in-memory listener for the example
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(grpclimit.UnaryServerInterceptor(lim, grpclimit.MetadataKey("x-api-key"))))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	conn, _ := grpc.NewClient("passthrough:///example",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	defer conn.Close()

	client := healthpb.NewHealthClient(conn)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "x-api-key", "key-1")
	for i := 0; i < 3; i++ {
		var md metadata.MD
		_, err := client.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Header(&md))
		wait, _ := grpclimit.RetryAfter(err)
		fmt.Println(status.Code(err), md.Get("ratelimit"), wait)
	}
	// Output:
	// OK ["api";r=1;t=30] 0s
	// OK ["api";r=0;t=30] 0s
	// ResourceExhausted ["api";r=0;t=30] 30s
}
