package grpclimit_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/grpclimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/internal/syncbuf"
	"github.com/leaselimit/leaselimit/policy"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/reflection"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
)

func TestMain(m *testing.M) {
	// The tests' own go-redis clients, whose dials fail while a test's
	// Redis is down, start go-redis's retry of a failed dial, which sleeps
	// a second between dials and ends at its next turn once its client is
	// closed: VerifyTestMain gives it that time, and still fails a client
	// left open. Only a client that counts as many failed dials as its
	// pool's size starts it; leaselimit's own connection never hands
	// go-redis a dial error (redispath's dialNoError).
	redistest.VerifyTestMain(m)
}

// serve starts a gRPC server with the test service (service, in
// example_test.go), the health service and
// server reflection behind lim's interceptors (keyed by the x-key metadata)
// on an in-memory listener, and returns a client connection to it.
func serve(t *testing.T, lim grpclimit.Limiter, client ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	return serveWith(t, lim, grpclimit.MetadataKey("x-key"), nil, client...)
}

// serveWith is serve with the interceptors' key and options.
func serveWith(t *testing.T, lim grpclimit.Limiter, key grpclimit.KeyFunc, opts []grpclimit.Option, client ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(grpclimit.UnaryServerInterceptor(lim, key, opts...)),
		grpc.ChainStreamInterceptor(grpclimit.StreamServerInterceptor(lim, key, opts...)),
	)
	testgrpc.RegisterTestServiceServer(srv, service{})
	healthpb.RegisterHealthServer(srv, health.NewServer())
	reflection.Register(srv)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	dial := append([]grpc.DialOption{
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
	}, client...)
	conn, err := grpc.NewClient("passthrough:///bufnet", dial...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// newClient returns a Client on srv with a generous time budget (the
// tests' decisions are not about timeouts unless they say so), closed when
// the test ends.
func newClient(t *testing.T, srv *redistest.Server, opts ...leaselimit.Option) *leaselimit.Client {
	t.Helper()
	c, err := leaselimit.NewClient(srv.Client(t), append([]leaselimit.Option{leaselimit.WithTimeout(10 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// newLimiter returns the Limiter of l on a Client of its own (see newClient).
func newLimiter(t *testing.T, srv *redistest.Server, l policy.Limit, opts ...leaselimit.Option) *leaselimit.Limiter {
	t.Helper()
	return newClient(t, srv, opts...).Limiter(l)
}

func keyed(key string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "x-key", key)
}

var empty = &testgrpc.Empty{}

// stream opens a StreamingOutputCall and reads its first message: the
// error is the stream interceptor's refusal, if any.
func stream(ctx context.Context, tc testgrpc.TestServiceClient) error {
	s, err := tc.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		return err
	}
	_, err = s.Recv()
	return err
}

// quotaFailure returns the QuotaFailure detail of err, if any.
func quotaFailure(err error) *errdetails.QuotaFailure {
	for _, d := range status.Convert(err).Details() {
		if qf, ok := d.(*errdetails.QuotaFailure); ok {
			return qf
		}
	}
	return nil
}

// TestUnaryAndStream: calls over the limit are refused with
// ResourceExhausted and RetryInfo; every decided call carries the
// RateLimit fields as header metadata; a stream takes its tokens once; a
// call without a key is refused with InvalidArgument.
func TestUnaryAndStream(t *testing.T) {
	srv := redistest.Start(t)
	lim := newLimiter(t, srv, policy.Limit{Name: "grpc", Rate: 3, Period: time.Hour, Burst: 3}, leaselimit.WithoutLease())
	tc := testgrpc.NewTestServiceClient(serve(t, lim))
	for i := 0; i < 2; i++ {
		var md metadata.MD
		if _, err := tc.EmptyCall(keyed("ann"), empty, grpc.Header(&md)); err != nil {
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
	if err := stream(keyed("ann"), tc); err != nil {
		t.Fatalf("stream: %v", err)
	}
	var md metadata.MD
	_, err := tc.EmptyCall(keyed("ann"), empty, grpc.Header(&md))
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("call past the limit = %v; want ResourceExhausted", err)
	}
	wait, ok := grpclimit.RetryAfter(err)
	if !ok || wait < 19*time.Minute || wait > 20*time.Minute {
		t.Errorf("RetryInfo %v, %v; want about 20m (3 per hour)", wait, ok)
	}
	if qf := quotaFailure(err); qf == nil || len(qf.GetViolations()) != 1 || qf.GetViolations()[0].GetSubject() != "grpc" {
		t.Errorf("QuotaFailure %v; want one violation of \"grpc\"", qf)
	}
	if got := md.Get(grpclimit.MetadataRateLimit); len(got) != 1 || got[0] != `"grpc";r=0;t=1200` {
		t.Errorf("refused call: ratelimit %v", got)
	}
	if err := stream(keyed("ann"), tc); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("stream past the limit = %v; want ResourceExhausted", err)
	}
	if _, err := tc.EmptyCall(context.Background(), empty); status.Code(err) != codes.InvalidArgument {
		t.Errorf("call without a key = %v; want InvalidArgument", err)
	}
}

// TestClientRetry: the client interceptor waits out RetryInfo and calls
// again, within its attempts and the call's deadline. (1 per second: a
// loaded machine took over 200 ms for two calls, and 5 per second let the
// second through.)
func TestClientRetry(t *testing.T) {
	srv := redistest.Start(t)
	lim := newLimiter(t, srv, policy.Limit{Name: "retry", Rate: 1, Period: time.Second, Burst: 1}, leaselimit.WithoutLease())
	patient := testgrpc.NewTestServiceClient(serve(t, lim, grpc.WithChainUnaryInterceptor(grpclimit.UnaryClientInterceptor(3))))
	hasty := testgrpc.NewTestServiceClient(serve(t, lim))
	if _, err := patient.EmptyCall(keyed("k"), empty); err != nil {
		t.Fatal(err)
	}
	if _, err := hasty.EmptyCall(keyed("k"), empty); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("second call within 1s = %v; want ResourceExhausted", err)
	}
	start := time.Now()
	if _, err := patient.EmptyCall(keyed("k"), empty); err != nil {
		t.Fatalf("the retrying client = %v; want it to wait out RetryInfo and succeed", err)
	}
	t.Logf("the retrying client got through after %v", time.Since(start))
	ctx, cancel := context.WithTimeout(keyed("k"), time.Millisecond)
	defer cancel()
	if _, err := patient.EmptyCall(ctx, empty); status.Code(err) != codes.ResourceExhausted && status.Code(err) != codes.DeadlineExceeded {
		t.Errorf("a call whose deadline cannot cover the wait = %v; want it refused at once", err)
	}
}

// TestMultiLimitAndShadow: a multi-limit sends one entry per limit; a
// shadow limit sends none and refuses nothing.
func TestMultiLimitAndShadow(t *testing.T) {
	srv := redistest.Start(t)
	burst := policy.Limit{Name: "burst", Rate: 10, Period: time.Minute, Burst: 10}
	daily := policy.Quota("daily", 1, policy.Day, nil)
	c := newClient(t, srv, leaselimit.WithoutLease())
	tc := testgrpc.NewTestServiceClient(serve(t, c.Limiter(burst, daily)))
	var md metadata.MD
	if _, err := tc.EmptyCall(keyed("m"), empty, grpc.Header(&md)); err != nil {
		t.Fatal(err)
	}
	if got := md.Get(grpclimit.MetadataRateLimitPolicy); len(got) != 2 {
		t.Errorf("ratelimit-policy %v; want one entry per limit", got)
	}
	_, err := tc.EmptyCall(keyed("m"), empty)
	if st, _ := status.FromError(err); st.Code() != codes.ResourceExhausted || st.Message() == "" {
		t.Errorf("call past the daily quota = %v", err)
	}

	shadow := testgrpc.NewTestServiceClient(serve(t, c.Limiter(daily.WithName("trial")).With(leaselimit.WithShadow())))
	for i := 0; i < 3; i++ {
		var md metadata.MD
		if _, err := shadow.EmptyCall(keyed("s"), empty, grpc.Header(&md)); err != nil {
			t.Fatalf("shadow call %d = %v; a shadow limit must not refuse", i, err)
		}
		if len(md.Get(grpclimit.MetadataRateLimit)) != 0 {
			t.Errorf("shadow call %d sent ratelimit metadata", i)
		}
	}
}

// counting is a Limiter that counts the decisions asked of it.
type counting struct {
	grpclimit.Limiter
	calls atomic.Int64
}

func (c *counting) AllowN(ctx context.Context, key string, n int64) (leaselimit.Decision, error) {
	c.calls.Add(1)
	return c.Limiter.AllowN(ctx, key, n)
}

// keySpy is a KeyFunc (MetadataKey("x-key")) that records the methods it
// was asked about.
type keySpy struct {
	mu      sync.Mutex
	methods []string
}

func (s *keySpy) key(ctx context.Context, fullMethod string) (string, error) {
	s.mu.Lock()
	s.methods = append(s.methods, fullMethod)
	s.mu.Unlock()
	return grpclimit.MetadataKey("x-key")(ctx, fullMethod)
}

func (s *keySpy) asked() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.methods)
}

// The methods of server reflection: v1, and v1alpha, which grpcurl still
// tries (its messages are v1's on the wire; its generated code is
// deprecated).
const (
	reflectionV1      = reflectionpb.ServerReflection_ServerReflectionInfo_FullMethodName
	reflectionV1alpha = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
)

// listServices asks server reflection at method for the services over one
// stream and returns their names.
func listServices(ctx context.Context, conn *grpc.ClientConn, method string) ([]string, error) {
	s, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, method)
	if err != nil {
		return nil, err
	}
	// io.EOF: the server has ended the stream; RecvMsg says how.
	if err := s.SendMsg(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil && err != io.EOF {
		return nil, err
	}
	r := new(reflectionpb.ServerReflectionResponse)
	if err := s.RecvMsg(r); err != nil {
		return nil, err
	}
	var names []string
	for _, svc := range r.GetListServicesResponse().GetService() {
		names = append(names, svc.GetName())
	}
	return names, s.CloseSend()
}

// TestHealthAndReflectionExempt: by default the health service and server
// reflection pass untouched, unary and streaming, with no key and while
// the caller's limit is exhausted: the key function is not asked, no
// decision is made, no metadata sent; the limited service still demands a
// key and refuses calls over the limit.
func TestHealthAndReflectionExempt(t *testing.T) {
	srv := redistest.Start(t)
	lim := &counting{Limiter: newLimiter(t, srv, policy.Limit{Name: "probe", Rate: 1, Period: time.Hour, Burst: 1}, leaselimit.WithoutLease())}
	spy := &keySpy{}
	conn := serveWith(t, lim, spy.key, nil)
	tc, hc := testgrpc.NewTestServiceClient(conn), healthpb.NewHealthClient(conn)

	if _, err := tc.EmptyCall(keyed("ann"), empty); err != nil {
		t.Fatal(err)
	}
	if _, err := tc.EmptyCall(keyed("ann"), empty); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("call past the limit = %v; want ResourceExhausted", err)
	}
	if _, err := tc.EmptyCall(context.Background(), empty); status.Code(err) != codes.InvalidArgument {
		t.Errorf("limited call without a key = %v; want InvalidArgument", err)
	}
	asked, decided := len(spy.asked()), lim.calls.Load()

	for name, ctx := range map[string]context.Context{"no key": context.Background(), "an exhausted key": keyed("ann")} {
		var md metadata.MD
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Header(&md))
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health Check with %s = %v, %v; want SERVING", name, r.GetStatus(), err)
		}
		if len(md.Get(grpclimit.MetadataRateLimit)) != 0 || len(md.Get(grpclimit.MetadataRateLimitPolicy)) != 0 {
			t.Errorf("health Check with %s sent rate-limit metadata %v", name, md)
		}
		w, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if r, err := w.Recv(); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health Watch with %s = %v, %v; want SERVING", name, r.GetStatus(), err)
		}
		for _, method := range []string{reflectionV1, reflectionV1alpha} {
			names, err := listServices(ctx, conn, method)
			if err != nil || !slices.Contains(names, "grpc.testing.TestService") {
				t.Errorf("%s with %s = %v, %v; want the services listed", method, name, names, err)
			}
		}
	}
	if got := spy.asked(); len(got) != asked {
		t.Errorf("the key function was asked about %v; want only the limited calls", got[asked:])
	}
	if got := lim.calls.Load(); got != decided {
		t.Errorf("%d decisions for exempt calls; want none", got-decided)
	}
}

// TestHealthOrReflection: the methods exempt by default, by their full
// names as grpc's generated code spells them.
func TestHealthOrReflection(t *testing.T) {
	for m, want := range map[string]bool{
		healthpb.Health_Check_FullMethodName:          true,
		healthpb.Health_Watch_FullMethodName:          true,
		healthpb.Health_List_FullMethodName:           true,
		reflectionV1:                                  true,
		reflectionV1alpha:                             true,
		testgrpc.TestService_EmptyCall_FullMethodName: false,
		"/grpc.health.v1.HealthX/Check":               false,
		"/grpc.health.v2.Health/Check":                false,
		"/my.grpc.health.v1.Health/Check":             false,
		"grpc.health.v1.Health/Check":                 false,
		"/grpc.health.v1.Health":                      false,
		"/grpc.health.v1.Health/../x.Svc/M":           false, // grpc-go routes on the last '/'
		"":                                            false,
	} {
		if got := grpclimit.HealthOrReflection(m); got != want {
			t.Errorf("HealthOrReflection(%q) = %v; want %v", m, got, want)
		}
	}
}

// TestWithMethods: WithMethods replaces the default; nil restores it.
func TestWithMethods(t *testing.T) {
	srv := redistest.Start(t)
	lim := newLimiter(t, srv, policy.PerHour(10).WithName("methods"), leaselimit.WithoutLease())
	key := grpclimit.MetadataKey("x-key")

	// Only health Check is limited: it demands a key, the rest do not.
	onlyCheck := serveWith(t, lim, key, []grpclimit.Option{grpclimit.WithMethods(func(m string) bool {
		return m == healthpb.Health_Check_FullMethodName
	})})
	if _, err := healthpb.NewHealthClient(onlyCheck).Check(context.Background(), &healthpb.HealthCheckRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("limited health Check without a key = %v; want InvalidArgument", err)
	}
	var md metadata.MD
	if _, err := healthpb.NewHealthClient(onlyCheck).Check(keyed("k"), &healthpb.HealthCheckRequest{}, grpc.Header(&md)); err != nil || len(md.Get(grpclimit.MetadataRateLimit)) != 1 {
		t.Errorf("limited health Check with a key = %v, metadata %v; want it decided", err, md)
	}
	tc := testgrpc.NewTestServiceClient(onlyCheck)
	if _, err := tc.EmptyCall(context.Background(), empty); err != nil {
		t.Errorf("unlimited EmptyCall without a key = %v", err)
	}
	if err := stream(context.Background(), tc); err != nil {
		t.Errorf("unlimited stream without a key = %v", err)
	}
	if _, err := listServices(context.Background(), onlyCheck, reflectionV1alpha); err != nil {
		t.Errorf("reflection without a key = %v", err)
	}

	// Every method limited: reflection demands a key too.
	all := serveWith(t, lim, key, []grpclimit.Option{grpclimit.WithMethods(func(string) bool { return true })})
	if _, err := listServices(context.Background(), all, reflectionV1); status.Code(err) != codes.InvalidArgument {
		t.Errorf("limited reflection without a key = %v; want InvalidArgument", err)
	}

	// nil: the default again.
	def := serveWith(t, lim, key, []grpclimit.Option{grpclimit.WithMethods(nil)})
	if _, err := healthpb.NewHealthClient(def).Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Errorf("health Check under WithMethods(nil) = %v; want it exempt", err)
	}
	if _, err := testgrpc.NewTestServiceClient(def).EmptyCall(context.Background(), empty); status.Code(err) != codes.InvalidArgument {
		t.Errorf("EmptyCall without a key under WithMethods(nil) = %v; want InvalidArgument", err)
	}
}

// TestCostZeroNeedsNoKey: a call WithCost lets through uncharged is not
// asked for its key.
func TestCostZeroNeedsNoKey(t *testing.T) {
	srv := redistest.Start(t)
	lim := &counting{Limiter: newLimiter(t, srv, policy.PerHour(10).WithName("free"), leaselimit.WithoutLease())}
	spy := &keySpy{}
	conn := serveWith(t, lim, spy.key, []grpclimit.Option{grpclimit.WithCost(func(context.Context, string) int64 { return 0 })})
	if _, err := testgrpc.NewTestServiceClient(conn).EmptyCall(context.Background(), empty); err != nil {
		t.Errorf("free call without a key = %v", err)
	}
	if got := spy.asked(); len(got) != 0 || lim.calls.Load() != 0 {
		t.Errorf("free call: key asked for %v, %d decisions; want none", got, lim.calls.Load())
	}
}

// scripted is a Limiter whose every decision is d.
type scripted struct{ d leaselimit.Decision }

func (s scripted) AllowN(context.Context, string, int64) (leaselimit.Decision, error) {
	return s.d, nil
}
func (s scripted) Limit() policy.Limit { return s.d.Limit }

// TestRefusals: which code each kind of denial gets, with RetryInfo always
// and QuotaFailure only for a limit decision.
func TestRefusals(t *testing.T) {
	limit := policy.Limit{Name: "api", Rate: 4, Period: time.Minute, Burst: 4}
	deny := func(src leaselimit.Source) leaselimit.Decision {
		return leaselimit.Decision{Limit: limit, RetryAfter: 3 * time.Second, Source: src}
	}
	shadow := deny(leaselimit.SourceFallback)
	shadow.Allowed, shadow.Shadow, shadow.ShadowDenied = true, true, true
	for _, tc := range []struct {
		name  string
		lim   grpclimit.Limiter
		opts  []grpclimit.Option
		cost  int64
		code  codes.Code
		quota bool // a QuotaFailure detail
	}{
		{"overuse", scripted{deny(leaselimit.SourceAuthority)}, nil, 1, codes.ResourceExhausted, true},
		{"cached overuse", scripted{deny(leaselimit.SourceCache)}, nil, 1, codes.ResourceExhausted, true},
		{"outage", scripted{deny(leaselimit.SourceFallback)}, nil, 1, codes.Unavailable, false},
		{"outage as overuse", scripted{deny(leaselimit.SourceFallback)},
			[]grpclimit.Option{grpclimit.WithOutageCode(codes.ResourceExhausted)}, 1, codes.ResourceExhausted, false},
		{"shadow", scripted{shadow}, nil, 1, codes.OK, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cost := tc.cost
			opts := append([]grpclimit.Option{grpclimit.WithCost(func(context.Context, string) int64 { return cost })}, tc.opts...)
			tsc := testgrpc.NewTestServiceClient(serveWith(t, tc.lim, grpclimit.MetadataKey("x-key"), opts))
			var md metadata.MD
			_, err := tsc.EmptyCall(keyed("k"), empty, grpc.Header(&md))
			if tc.code != codes.OK {
				// An outage's refusal says nothing of the caller's quota.
				if got, want := len(md.Get(grpclimit.MetadataRateLimit)), map[bool]int{true: 1, false: 0}[tc.quota]; got != want {
					t.Errorf("unary call: %d ratelimit entries %v; want %d", got, md, want)
				}
				if len(md.Get(grpclimit.MetadataRateLimitPolicy)) != 1 {
					t.Errorf("unary call: ratelimit-policy %v; want the limit's", md.Get(grpclimit.MetadataRateLimitPolicy))
				}
			}
			for _, call := range []struct {
				kind string
				err  error
			}{
				{"unary", err},
				{"stream", stream(keyed("k"), tsc)},
			} {
				if got := status.Code(call.err); got != tc.code {
					t.Fatalf("%s call = %v; want %v", call.kind, call.err, tc.code)
				}
				if tc.code == codes.OK {
					continue
				}
				if wait, ok := grpclimit.RetryAfter(call.err); !ok || wait != 3*time.Second {
					t.Errorf("%s call: RetryInfo %v, %v; want 3s", call.kind, wait, ok)
				}
				if got := quotaFailure(call.err) != nil; got != tc.quota {
					t.Errorf("%s call: QuotaFailure %v; want %v", call.kind, got, tc.quota)
				}
				if msg := status.Convert(call.err).Message(); !strings.Contains(msg, `"api"`) || !strings.Contains(msg, "retry after 3s") {
					t.Errorf("%s call: message %q; want the limit's name and the wait", call.kind, msg)
				}
			}
		})
	}
}

// TestOutageCodeOK: an outage code that would let refused calls through,
// or that is no gRPC code, is refused at construction.
func TestOutageCodeOK(t *testing.T) {
	for _, code := range []codes.Code{codes.OK, codes.Unauthenticated + 1, 999} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("WithOutageCode(%d) did not panic", code)
				}
			}()
			grpclimit.UnaryServerInterceptor(scripted{}, grpclimit.PeerKey(), grpclimit.WithOutageCode(code))
		}()
	}
	// The last code is taken.
	grpclimit.UnaryServerInterceptor(scripted{}, grpclimit.PeerKey(), grpclimit.WithOutageCode(codes.Unauthenticated))
}

// sequence is a Limiter whose decisions are ds in turn, then the last.
type sequence struct {
	ds []leaselimit.Decision
	i  atomic.Int64
}

func (s *sequence) AllowN(context.Context, string, int64) (leaselimit.Decision, error) {
	return s.ds[min(int(s.i.Add(1))-1, len(s.ds)-1)], nil
}
func (s *sequence) Limit() policy.Limit { return s.ds[0].Limit }

// TestClientRetriesOutage: the client interceptor waits out the RetryInfo
// of an outage (Unavailable) as it does an overuse's.
func TestClientRetriesOutage(t *testing.T) {
	limit := policy.PerSecond(10).WithName("back")
	lim := &sequence{ds: []leaselimit.Decision{
		{Limit: limit, RetryAfter: 50 * time.Millisecond, Source: leaselimit.SourceFallback},
		{Allowed: true, Limit: limit, Remaining: 9, Source: leaselimit.SourceAuthority},
	}}
	tc := testgrpc.NewTestServiceClient(serve(t, lim, grpc.WithChainUnaryInterceptor(grpclimit.UnaryClientInterceptor(2))))
	start := time.Now()
	if _, err := tc.EmptyCall(keyed("k"), empty); err != nil {
		t.Fatalf("call through an outage refusal = %v; want it retried after RetryInfo", err)
	}
	if waited := time.Since(start); waited < 50*time.Millisecond {
		t.Errorf("retried after %v; want the 50ms of RetryInfo waited out", waited)
	}
	if got := lim.i.Load(); got != 2 {
		t.Errorf("%d decisions; want 2 (one refusal, one retry)", got)
	}
}

// waitOpen waits (at most 5 s) until lim's breaker is open: on a loaded
// machine the breaker may hear of a failed call only when the call ends.
func waitOpen(t *testing.T, c *leaselimit.Client) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); c.BreakerState() != breaker.Open; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("breaker %v with Redis down; want open", c.BreakerState())
		}
	}
}

// TestOutage: with redis-server killed under FailClosed, a limited call is
// refused with Unavailable and a RetryInfo until the breaker's next probe
// (about an hour here), not as overuse; WithOutageCode answers
// ResourceExhausted instead; health checks still pass; the client
// interceptor does not wait an hour its deadline does not have.
func TestOutage(t *testing.T) {
	srv := redistest.Start(t)
	c := newClient(t, srv, leaselimit.WithoutLease(),
		leaselimit.WithFailureMode(policy.FailClosed), leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}))
	lim := c.Limiter(policy.PerHour(10).WithName("outage"))
	conn := serve(t, lim)
	tc := testgrpc.NewTestServiceClient(conn)
	patient := testgrpc.NewTestServiceClient(serve(t, lim, grpc.WithChainUnaryInterceptor(grpclimit.UnaryClientInterceptor(3))))
	if _, err := tc.EmptyCall(keyed("ann"), empty); err != nil {
		t.Fatalf("call with Redis up = %v", err)
	}
	srv.Kill(t)
	if _, err := tc.EmptyCall(keyed("ann"), empty); status.Code(err) != codes.Unavailable {
		t.Fatalf("call as Redis goes down = %v; want Unavailable", err)
	}
	waitOpen(t, c)

	ctx, cancel := context.WithTimeout(keyed("ann"), time.Second)
	defer cancel()
	start := time.Now()
	var md metadata.MD
	_, err := patient.EmptyCall(ctx, empty, grpc.Header(&md))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("call with the breaker open = %v; want Unavailable", err)
	}
	if got := md.Get(grpclimit.MetadataRateLimit); len(got) != 0 {
		t.Errorf("outage refusal: ratelimit %v; want none (nothing is known of the caller's quota)", got)
	}
	if waited := time.Since(start); waited > 500*time.Millisecond {
		t.Errorf("the client interceptor took %v over a refusal its deadline cannot wait out", waited)
	}
	if wait, ok := grpclimit.RetryAfter(err); !ok || wait < breaker.MaxOpenFor-10*time.Second || wait > breaker.MaxOpenFor {
		t.Errorf("RetryInfo %v, %v; want about %v (until the breaker's probe)", wait, ok, breaker.MaxOpenFor)
	}
	if qf := quotaFailure(err); qf != nil {
		t.Errorf("outage refusal carries QuotaFailure %v; no quota was exhausted", qf)
	}
	t.Logf("outage refusal: %v", err)
	if err := stream(keyed("ann"), tc); status.Code(err) != codes.Unavailable {
		t.Errorf("stream with the breaker open = %v; want Unavailable", err)
	}
	if r, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health Check during the outage = %v, %v; want SERVING", r.GetStatus(), err)
	}

	asOveruse := testgrpc.NewTestServiceClient(serveWith(t, lim, grpclimit.MetadataKey("x-key"),
		[]grpclimit.Option{grpclimit.WithOutageCode(codes.ResourceExhausted)}))
	_, err = asOveruse.EmptyCall(keyed("ann"), empty)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("call with WithOutageCode(ResourceExhausted) = %v", err)
	}
	if wait, ok := grpclimit.RetryAfter(err); !ok || wait < breaker.MaxOpenFor-10*time.Second || wait > breaker.MaxOpenFor {
		t.Errorf("WithOutageCode(ResourceExhausted): RetryInfo %v, %v; want about %v", wait, ok, breaker.MaxOpenFor)
	}
}

// TestOutageFailLocal: with redis-server killed under FailLocal (a fleet
// of 2, 4 an hour: a share of 2), calls within the share pass, and the
// share's denial is an outage's (Unavailable, a RetryInfo until the share
// admits again, no QuotaFailure), as httplimit's 503: the caller may be
// within its limit, its calls all on this instance.
func TestOutageFailLocal(t *testing.T) {
	srv := redistest.Start(t)
	c := newClient(t, srv, leaselimit.WithoutLease(),
		leaselimit.WithFailureMode(policy.FailLocal), leaselimit.WithFleetSize(2),
		leaselimit.WithBreaker(breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}))
	lim := c.Limiter(policy.PerHour(4).WithName("local"))
	tc := testgrpc.NewTestServiceClient(serveWith(t, lim, grpclimit.MetadataKey("x-key"), nil))
	srv.Kill(t)
	_, _ = tc.EmptyCall(keyed("warm"), empty) // the failure that opens the breaker
	waitOpen(t, c)

	for i := 0; i < 2; i++ {
		if _, err := tc.EmptyCall(keyed("ann"), empty); err != nil {
			t.Fatalf("call %d within the local share = %v", i, err)
		}
	}
	_, err := tc.EmptyCall(keyed("ann"), empty)
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("call past the local share = %v; want Unavailable", err)
	}
	if wait, ok := grpclimit.RetryAfter(err); !ok || wait < 29*time.Minute || wait > 30*time.Minute {
		t.Errorf("RetryInfo %v, %v; want about 30m (a share of 2 per hour)", wait, ok)
	}
	if quotaFailure(err) != nil {
		t.Error("an outage's refusal carries a QuotaFailure")
	}
}

// TestCostAboveBurst: a call whose cost no wait can admit (above the
// smaller Burst of two limits) is refused for good: ResourceExhausted, a
// QuotaFailure that names the limit and says why, no RetryInfo (the client
// interceptor does not retry it), no tokens taken; a negative cost is the
// cost function's bug, Internal.
func TestCostAboveBurst(t *testing.T) {
	srv := redistest.Start(t)
	c := newClient(t, srv, leaselimit.WithoutLease())
	small := policy.Limit{Name: "small", Rate: 5, Period: time.Minute, Burst: 5}
	big := policy.PerHour(100).WithName("big")
	lim := c.Limiter(big, small)
	cost := int64(6)
	conn := serveWith(t, lim, grpclimit.MetadataKey("x-key"),
		[]grpclimit.Option{grpclimit.WithCost(func(context.Context, string) int64 { return cost })},
		grpc.WithChainUnaryInterceptor(grpclimit.UnaryClientInterceptor(3)))
	tsc := testgrpc.NewTestServiceClient(conn)
	_, err := tsc.EmptyCall(keyed("k"), empty)
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), "costs 6 tokens") || !strings.Contains(st.Message(), `"small" admits at most 5`) {
		t.Fatalf("call of cost 6 = %v; want ResourceExhausted naming the cost and the small limit's burst", err)
	}
	if wait, ok := grpclimit.RetryAfter(err); ok {
		t.Errorf("RetryInfo %v on a call no wait admits", wait)
	}
	var quota bool
	for _, d := range st.Details() {
		if q, ok := d.(*errdetails.QuotaFailure); ok && len(q.Violations) == 1 && q.Violations[0].Subject == "small" {
			quota = true
		}
	}
	if !quota {
		t.Errorf("details %v; want a QuotaFailure naming small", st.Details())
	}
	if d, err := lim.Peek(context.Background(), "k"); err != nil || d.Parts[1].Remaining != 5 {
		t.Errorf("Peek after the refused call = %+v, %v; want small's 5 tokens untouched", d, err)
	}
	cost = -1
	if _, err := tsc.EmptyCall(keyed("k"), empty); status.Code(err) != codes.Internal {
		t.Errorf("call of cost -1 = %v; want Internal", err)
	}
}

// TestKeyFuncPanic: a panic in the key function (the user's code) fails
// the call with Internal and is logged; the server keeps serving. grpc-go
// recovers no handler panic, and it took the whole process down.
func TestKeyFuncPanic(t *testing.T) {
	var out syncbuf.Buffer
	lim := scripted{leaselimit.Decision{Allowed: true, Limit: policy.Limit{Name: "api", Rate: 1, Period: time.Second, Burst: 1}}}
	key := func(ctx context.Context, method string) (string, error) {
		if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("x-key")) > 0 && md.Get("x-key")[0] == "boom" {
			panic("the key function's bug")
		}
		return "k", nil
	}
	conn := serveWith(t, lim, key, []grpclimit.Option{grpclimit.WithLogger(slog.New(slog.NewTextHandler(&out, nil)))})
	tc := testgrpc.NewTestServiceClient(conn)
	for _, call := range []func(context.Context) error{
		func(ctx context.Context) error { _, err := tc.EmptyCall(ctx, empty); return err },
		func(ctx context.Context) error { return stream(ctx, tc) },
	} {
		if err := call(keyed("boom")); status.Code(err) != codes.Internal {
			t.Errorf("a call whose key function panics = %v; want Internal", err)
		}
		if err := call(keyed("fine")); err != nil {
			t.Errorf("the next call = %v; want served", err)
		}
	}
	if !strings.Contains(out.String(), "panic in the key function") {
		t.Errorf("the panic was not logged:\n%s", out.String())
	}
}

// TestLimiterErrorLogged: a call the Limiter could not decide is logged
// (a closed Client, an invalid limit): they answered Unavailable or
// Internal with nothing in any log.
func TestLimiterErrorLogged(t *testing.T) {
	srv := redistest.Start(t)
	var out syncbuf.Buffer
	c := newClient(t, srv)
	lim := c.Limiter(policy.Limit{Name: "closed-api", Rate: 1, Period: time.Second, Burst: 1})
	conn := serveWith(t, lim, grpclimit.MetadataKey("x-key"), []grpclimit.Option{grpclimit.WithLogger(slog.New(slog.NewTextHandler(&out, nil)))})
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := testgrpc.NewTestServiceClient(conn).EmptyCall(keyed("k"), empty); status.Code(err) != codes.Unavailable {
		t.Errorf("a call on a closed Client = %v; want Unavailable", err)
	}
	if !strings.Contains(out.String(), "limiter error") || !strings.Contains(out.String(), "closed-api") {
		t.Errorf("the limiter's error was not logged with its policy:\n%s", out.String())
	}
}

// TestNilLimiterPanicsClearly: a nil *leaselimit.Limiter gets the
// interceptors' own panic message (it was dereferenced).
func TestNilLimiterPanicsClearly(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "nil Limiter") {
			t.Errorf("UnaryServerInterceptor((*leaselimit.Limiter)(nil)) = %v; want a panic naming the nil Limiter", r)
		}
	}()
	grpclimit.UnaryServerInterceptor((*leaselimit.Limiter)(nil), grpclimit.PeerKey())
}

// TestPeerKey: an IPv4 peer is keyed by its address, an IPv6 one by its
// /64 (keyed by whole address, a client with a /64 had 2^64 buckets).
func TestPeerKey(t *testing.T) {
	for _, tc := range []struct {
		addr net.Addr
		want string
	}{
		{&net.TCPAddr{IP: net.ParseIP("203.0.113.7"), Port: 443}, "203.0.113.7"},
		{&net.TCPAddr{IP: net.ParseIP("::ffff:203.0.113.7"), Port: 443}, "203.0.113.7"},
		{&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2::1"), Port: 443}, "2001:db8:1:2::/64"},
		{&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:ffff::9"), Port: 443}, "2001:db8:1:2::/64"},
		{&net.TCPAddr{IP: net.ParseIP("fe80::1"), Port: 443, Zone: "eth0"}, "fe80::1"}, // link-local: no network's /64
		{&net.UnixAddr{Name: "/run/app.sock", Net: "unix"}, "/run/app.sock"},
		{&net.IPAddr{IP: net.ParseIP("2001:db8:1:2::7")}, "2001:db8:1:2::/64"}, // no port
		{&net.IPAddr{IP: net.ParseIP("203.0.113.7")}, "203.0.113.7"},
	} {
		ctx := peer.NewContext(context.Background(), &peer.Peer{Addr: tc.addr})
		if got, err := grpclimit.PeerKey()(ctx, "/x.Svc/M"); err != nil || got != tc.want {
			t.Errorf("PeerKey of %v = %q, %v; want %q", tc.addr, got, err, tc.want)
		}
	}
}

// unnamed is a Limiter whose denials name no limit.
type unnamed struct{ l policy.Limit }

func (u unnamed) AllowN(context.Context, string, int64) (leaselimit.Decision, error) {
	return leaselimit.Decision{RetryAfter: time.Second, Source: leaselimit.SourceAuthority}, nil
}
func (u unnamed) Limit() policy.Limit { return u.l }

// TestRefusalNamesTheLimiter: a denial whose decision names no limit is
// named after the Limiter's (it said `rate limit "" exceeded`).
func TestRefusalNamesTheLimiter(t *testing.T) {
	l := policy.Limit{Name: "custom", Rate: 1, Period: time.Second, Burst: 1}
	conn := serve(t, unnamed{l})
	_, err := testgrpc.NewTestServiceClient(conn).EmptyCall(keyed("k"), empty)
	qf := quotaFailure(err)
	if status.Code(err) != codes.ResourceExhausted || qf == nil || len(qf.Violations) != 1 || qf.Violations[0].Subject != "custom" {
		t.Errorf("a denial naming no limit = %v (%v); want ResourceExhausted with a QuotaFailure on \"custom\"", err, qf)
	}
}

// TestKeyFuncPanicNil: a key function that panics with nil fails the call
// too. Under GODEBUG=panicnil=1 recover returns nil for it, and the call
// went through undecided.
func TestKeyFuncPanicNil(t *testing.T) {
	lim := scripted{leaselimit.Decision{Allowed: false, Limit: policy.Limit{Name: "api", Rate: 1, Period: time.Second, Burst: 1}, RetryAfter: time.Second}}
	var nilValue any
	key := func(context.Context, string) (string, error) { panic(nilValue) }
	conn := serveWith(t, lim, key, []grpclimit.Option{grpclimit.WithLogger(slog.New(slog.DiscardHandler))})
	if _, err := testgrpc.NewTestServiceClient(conn).EmptyCall(keyed("k"), empty); status.Code(err) != codes.Internal {
		t.Errorf("a call whose key function panics with nil = %v; want Internal", err)
	}
}

// TestMetadataKeyRefusesAmbiguity: MetadataKey keys by the one value of its
// entry, trimmed, and refuses (InvalidArgument) a call that sends it twice
// or blank. Regression (a review): keyed by the first of repeated values, a
// client sending a fresh value first and the real one after got 20 calls
// of 20 through a limit of 1 an hour, and a blank value was a key.
func TestMetadataKeyRefusesAmbiguity(t *testing.T) {
	key := grpclimit.MetadataKey("x-key")
	for _, tc := range []struct {
		values []string
		want   string // "" for refused
	}{
		{[]string{"tenant-1"}, "tenant-1"},
		{[]string{"  tenant-1 "}, "tenant-1"},
		{[]string{"junk-1", "victim"}, ""},
		{[]string{" "}, ""},
		{[]string{""}, ""},
		{nil, ""},
	} {
		md := metadata.MD{}
		for _, v := range tc.values {
			md.Append("x-key", v)
		}
		got, err := key(metadata.NewIncomingContext(context.Background(), md), "/x.Svc/M")
		if (err == nil) != (tc.want != "") || got != tc.want {
			t.Errorf("MetadataKey of %q = %q, %v; want %q", tc.values, got, err, tc.want)
		}
	}
	srv := redistest.Start(t)
	conn := serve(t, newLimiter(t, srv, policy.Limit{Name: "api", Rate: 1, Period: time.Hour, Burst: 1}, leaselimit.WithoutLease()))
	tc := testgrpc.NewTestServiceClient(conn)
	served := 0
	for i := range 5 {
		ctx := metadata.AppendToOutgoingContext(context.Background(), "x-key", fmt.Sprint("junk-", i), "x-key", "victim")
		_, err := tc.EmptyCall(ctx, empty)
		switch status.Code(err) {
		case codes.OK:
			served++
		case codes.InvalidArgument:
		default:
			t.Fatalf("a call sending its key twice = %v; want InvalidArgument", err)
		}
	}
	if served > 0 {
		t.Errorf("%d calls of 5 sending their key twice served; want none", served)
	}
}

// TestPeerKeyWarnsOfASharedAddress: PeerKey logs once when it keys calls
// many clients share (forwarded by a proxy, or from a Unix socket's
// client, which Linux names "@"): they share one bucket, and nothing said
// so (a review).
func TestPeerKeyWarnsOfASharedAddress(t *testing.T) {
	// slog.SetDefault points the log package at the new handler, and
	// setting the old one back does not undo that: its writer and flags
	// are restored too.
	old, w, f := slog.Default(), log.Writer(), log.Flags()
	t.Cleanup(func() { slog.SetDefault(old); log.SetOutput(w); log.SetFlags(f) })
	for _, tc := range []struct {
		name string
		addr net.Addr
		md   metadata.MD
		warn string // "" for none
	}{
		{"direct", &net.TCPAddr{IP: net.ParseIP("203.0.113.7"), Port: 443}, nil, ""},
		{"forwarded", &net.TCPAddr{IP: net.ParseIP("10.0.0.2"), Port: 443}, metadata.Pairs("x-forwarded-for", "198.51.100.9"), "metadata x-forwarded-for"},
		{"unix client", &net.UnixAddr{Name: "@", Net: "unix"}, nil, "Unix socket"},
	} {
		var out syncbuf.Buffer
		slog.SetDefault(slog.New(slog.NewTextHandler(&out, nil)))
		key := grpclimit.PeerKey()
		ctx := peer.NewContext(context.Background(), &peer.Peer{Addr: tc.addr})
		if tc.md != nil {
			ctx = metadata.NewIncomingContext(ctx, tc.md)
		}
		for range 3 {
			if _, err := key(ctx, "/x.Svc/M"); err != nil {
				t.Fatalf("%s: PeerKey = %v", tc.name, err)
			}
		}
		n := out.Count("PeerKey keys calls by an address many clients share")
		switch {
		case tc.warn == "" && n != 0:
			t.Errorf("%s: %d warnings; want none:\n%s", tc.name, n, out.String())
		case tc.warn != "" && (n != 1 || !strings.Contains(out.String(), tc.warn)):
			t.Errorf("%s: %d warnings; want one naming %q:\n%s", tc.name, n, tc.warn, out.String())
		}
	}
}

// okStatus is a key function's error that claims status OK.
type okStatus struct{}

func (okStatus) Error() string              { return "no key, says OK" }
func (okStatus) GRPCStatus() *status.Status { return status.New(codes.OK, "") }

// TestKeyErrorWithStatusOK: a key function's error whose status is OK
// refuses the call with InvalidArgument; returned as it was, the call
// ended without its handler and the client saw a success (a stream) or a
// cardinality violation (a review).
func TestKeyErrorWithStatusOK(t *testing.T) {
	lim := scripted{leaselimit.Decision{Allowed: true, Limit: policy.Limit{Name: "api", Rate: 1, Period: time.Second, Burst: 1}}}
	conn := serveWith(t, lim, func(context.Context, string) (string, error) { return "", okStatus{} }, nil)
	tc := testgrpc.NewTestServiceClient(conn)
	if _, err := tc.EmptyCall(context.Background(), empty); status.Code(err) != codes.InvalidArgument {
		t.Errorf("unary call whose key function fails with status OK = %v; want InvalidArgument", err)
	}
	if err := stream(context.Background(), tc); status.Code(err) != codes.InvalidArgument {
		t.Errorf("stream whose key function fails with status OK = %v; want InvalidArgument", err)
	}
}

// TestNegativeCost: a cost function that returns a negative cost is the
// server's bug: Internal and a log line, whether or not the call has a
// key (without one, the client was told InvalidArgument, and nothing was
// logged; a review).
func TestNegativeCost(t *testing.T) {
	var out syncbuf.Buffer
	lim := scripted{leaselimit.Decision{Allowed: true, Limit: policy.Limit{Name: "api", Rate: 1, Period: time.Second, Burst: 1}}}
	conn := serveWith(t, lim, grpclimit.MetadataKey("x-key"), []grpclimit.Option{
		grpclimit.WithCost(func(context.Context, string) int64 { return -3 }),
		grpclimit.WithLogger(slog.New(slog.NewTextHandler(&out, nil)))})
	tc := testgrpc.NewTestServiceClient(conn)
	for _, ctx := range []context.Context{context.Background(), keyed("k")} {
		if _, err := tc.EmptyCall(ctx, empty); status.Code(err) != codes.Internal {
			t.Errorf("a call costing -3 = %v; want Internal", err)
		}
	}
	if !strings.Contains(out.String(), "negative cost") {
		t.Errorf("the negative cost was not logged:\n%s", out.String())
	}
}
