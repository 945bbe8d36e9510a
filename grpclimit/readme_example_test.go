package grpclimit_test

import (
	"context"
	"net"
	"strings"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/grpclimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
)

// readmeServer is the root README's gRPC snippet (the root's
// TestREADMESnippetsCompile checks that the README shows it as it is here).
func readmeServer(client *leaselimit.Client) *grpc.Server {
	api := client.Limiter(policy.PerMinute(600).WithName("api"))
	key := grpclimit.MetadataKey("x-api-key") // or grpclimit.PeerKey(): the client's address
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(grpclimit.UnaryServerInterceptor(api, key)),
		grpc.ChainStreamInterceptor(grpclimit.StreamServerInterceptor(api, key)), // one decision per stream
	)
	return srv
}

// TestREADMEServer serves a call through the README's server on an
// embedded Redis: admitted, with its RateLimit metadata.
func TestREADMEServer(t *testing.T) {
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	c, err := leaselimit.NewClient(rdb)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	srv := readmeServer(c)
	testgrpc.RegisterTestServiceServer(srv, service{})
	lis := bufconn.Listen(1 << 20)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	conn, err := grpc.NewClient("passthrough:///readme",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx := metadata.AppendToOutgoingContext(context.Background(), "x-api-key", "key-1")
	var md metadata.MD
	if _, err := testgrpc.NewTestServiceClient(conn).EmptyCall(ctx, &testgrpc.Empty{}, grpc.Header(&md)); err != nil {
		t.Fatal(err)
	}
	if got := md.Get(grpclimit.MetadataRateLimitPolicy); len(got) != 1 || !strings.Contains(got[0], `"api";q=600`) {
		t.Errorf("ratelimit-policy %v; want the api limit", got)
	}
}
