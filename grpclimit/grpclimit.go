// Package grpclimit is for gRPC servers and their clients: it puts a
// leaselimit Limiter in front of gRPC services with unary and stream server
// interceptors that take tokens for the calls of the limited methods, keyed
// by metadata or the peer, and refuse calls over the limit with
// codes.ResourceExhausted and a google.rpc.RetryInfo detail that says when
// to come back; and a client interceptor that honours RetryInfo.
//
//	c, _ := leaselimit.NewClient(rdb)
//	lim := c.Limiter(policy.PerSecond(100).WithName("api"))
//	srv := grpc.NewServer(
//		grpc.ChainUnaryInterceptor(grpclimit.UnaryServerInterceptor(lim, grpclimit.MetadataKey("x-api-key"))),
//		grpc.ChainStreamInterceptor(grpclimit.StreamServerInterceptor(lim, grpclimit.MetadataKey("x-api-key"))),
//	)
//
// Every decided call carries the draft-ietf-httpapi-ratelimit-headers-10
// values as response header metadata: "ratelimit-policy" and "ratelimit",
// one entry per limit (several for a multi-limit); a call refused for an
// outage, which says nothing of the caller's quota, "ratelimit-policy" only. A decision of a limit in
// shadow mode (leaselimit.WithShadow) adds no metadata and never refuses.
//
// The gRPC health service (grpc.health.v1.Health) and server reflection
// (grpc.reflection.v1 and v1alpha ServerReflection) pass untouched by
// default: Kubernetes gRPC probes, grpc-health-probe and grpcurl need no key,
// and their calls take no tokens. WithMethods chooses the limited methods.
//
// An outage looks like an outage. While Redis is unavailable the Limiter's
// failure policy decides (Decision.Source is leaselimit.SourceFallback); its
// denial (policy.FailClosed, or policy.FailLocal past this instance's share,
// which can refuse a caller within its limit: its calls may all reach one
// instance) is refused with codes.Unavailable (WithOutageCode changes the
// code) and a RetryInfo of the Decision's RetryAfter: for FailClosed until
// the breaker lets its next probe through to Redis. httplimit answers the
// same denials 503.
//
// It is a module of its own, so that the leaselimit module does not depend
// on google.golang.org/grpc.
package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/clientaddr"
	"github.com/leaselimit/leaselimit/internal/fields"
	"github.com/leaselimit/leaselimit/internal/keyfield"
	"github.com/leaselimit/leaselimit/internal/throttle"
	"github.com/leaselimit/leaselimit/policy"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Metadata keys of the rate-limit fields (gRPC metadata keys are lower case).
const (
	MetadataRateLimit       = "ratelimit"
	MetadataRateLimitPolicy = "ratelimit-policy"
)

// Limiter is what the interceptors need from a limiter; *leaselimit.Limiter
// implements it.
type Limiter interface {
	AllowN(ctx context.Context, key string, n int64) (leaselimit.Decision, error)
	Limit() policy.Limit
}

var _ Limiter = (*leaselimit.Limiter)(nil)

// KeyFunc returns the rate-limit key of a call to fullMethod. An error
// refuses the call with codes.InvalidArgument (or the code of a status
// error it returns).
type KeyFunc func(ctx context.Context, fullMethod string) (string, error)

// ErrNoKey is returned by the KeyFuncs here when the call carries no key.
var ErrNoKey = errors.New("grpclimit: the call carries no rate-limit key")

// errRepeatedKey refuses a call that sends MetadataKey's entry more than
// once.
var errRepeatedKey = errors.New("grpclimit: the call sends its rate-limit key more than once")

// MetadataKey keys calls by the value of the incoming metadata name (an
// API key, a tenant id), surrounding spaces trimmed; a call without it, with
// it blank, or with it more than once is refused (InvalidArgument), as
// httplimit.Header refuses a repeated field: keyed by one of several
// values, a client chose a fresh bucket for every call while whatever
// authenticated it read another (a review: 20 of 20 admitted on a limit of
// 1 an hour).
func MetadataKey(name string) KeyFunc {
	return func(ctx context.Context, _ string) (string, error) {
		switch k, why := keyfield.One(metadata.ValueFromIncomingContext(ctx, name)); why {
		case keyfield.Repeated:
			return "", errRepeatedKey
		case keyfield.Missing:
			return "", ErrNoKey
		default:
			return k, nil
		}
	}
}

// PeerKey keys calls by the peer's address without its port: for TCP the
// client's IP, an IPv4 address whole and an IPv6 one by its /64
// ("2001:db8:1:2::/64", as httplimit.ClientIP; keyed by whole address, a
// client with a /64 had 2^64 buckets); the whole address for other
// transports. It logs a warning to slog.Default(), once, when it keys a
// call that a proxy forwarded (metadata x-forwarded-for, forwarded or
// x-real-ip) or a call from a Unix socket's client, which has no address
// of its own: every client behind the proxy, or on the socket, then
// shares one bucket; key such calls by something the client sends
// (MetadataKey) instead.
func PeerKey() KeyFunc {
	var warned atomic.Bool
	return func(ctx context.Context, _ string) (string, error) {
		p, ok := peer.FromContext(ctx)
		if !ok || p.Addr == nil {
			return "", ErrNoKey
		}
		if !warned.Load() {
			warnSharedPeer(ctx, &warned, p.Addr)
		}
		a := p.Addr.String()
		host, _, splitErr := net.SplitHostPort(a)
		if splitErr != nil {
			host = strings.TrimSuffix(strings.TrimPrefix(a, "["), "]") // an IP address without a port
		}
		ip, err := netip.ParseAddr(host)
		switch {
		case err == nil:
			return clientaddr.Key(ip.Unmap().WithZone("")), nil
		case splitErr != nil:
			return a, nil // another transport's address
		}
		return host, nil
	}
}

// forwardingMetadata are the metadata keys that say a proxy forwarded a
// call.
var forwardingMetadata = [...]string{"x-forwarded-for", "forwarded", "x-real-ip"}

// warnSharedPeer logs, once (warned), that PeerKey keys by addr calls that
// many clients share: a call a proxy forwarded, or one from a Unix
// socket's client (Linux names it "@", or nothing).
func warnSharedPeer(ctx context.Context, warned *atomic.Bool, addr net.Addr) {
	why := ""
	if u, isUnix := addr.(*net.UnixAddr); isUnix && (u.Name == "" || u.Name == "@") {
		why = "a client of a Unix socket has no address of its own"
	} else if md, ok := metadata.FromIncomingContext(ctx); ok {
		for _, k := range forwardingMetadata {
			if len(md.Get(k)) > 0 {
				why = "the call was forwarded by a proxy (metadata " + k + ")"
				break
			}
		}
	}
	if why == "" || !warned.CompareAndSwap(false, true) {
		return
	}
	slog.Default().LogAttrs(ctx, slog.LevelWarn,
		"grpclimit: PeerKey keys calls by an address many clients share: they share one bucket; key them by something each client sends (MetadataKey); logged once",
		slog.String("why", why), slog.String("peer", addr.String()))
}

// Option configures the server interceptors.
type Option func(*config)

type config struct {
	cost    func(ctx context.Context, fullMethod string) int64
	limited func(fullMethod string) bool
	outage  codes.Code
	logger  *slog.Logger
}

// WithLogger sets where the interceptors log a call they could not rate
// limit (the Limiter's error, a panic in the key or cost function): never
// the key or the caller's address. Default slog.Default(). A client's own
// cancellation is not logged.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger = l }
}

// WithCost sets the tokens a call takes (default 1); 0 lets it through
// uncharged and undecided, without reading its key. A cost above the
// limit's Burst (of several limits, the smallest) can never be admitted:
// the call gets ResourceExhausted with a QuotaFailure that says so and no
// RetryInfo, and takes no tokens. A cost below 0 is the cost function's
// bug: Internal.
func WithCost(cost func(ctx context.Context, fullMethod string) int64) Option {
	return func(c *config) { c.cost = cost }
}

// WithMethods chooses the limited methods: a call to a method for which
// limited returns false passes untouched, its key not read (it needs none),
// no tokens taken and no metadata sent. fullMethod is
// "/package.Service/Method". The default limits every method but those of
// the health and reflection services (HealthOrReflection); nil restores it.
// To exempt more methods and keep those exempt too:
//
//	grpclimit.WithMethods(func(m string) bool {
//		return !grpclimit.HealthOrReflection(m) && !strings.HasPrefix(m, "/admin.v1.Admin/")
//	})
func WithMethods(limited func(fullMethod string) bool) Option {
	return func(c *config) { c.limited = limited }
}

// WithOutageCode sets the code of a call the failure policy refuses because
// Redis is unavailable (policy.FailClosed; see the package documentation):
// default codes.Unavailable, which tells clients, retry policies and
// dashboards that the service is down for now, not that the caller asked
// too much. codes.ResourceExhausted answers an outage as overuse. The
// refusal carries a RetryInfo until the breaker's next probe either way.
// The interceptors panic on codes.OK, which would let refused calls through,
// and on a value that is no gRPC code (above codes.Unauthenticated).
func WithOutageCode(code codes.Code) Option {
	return func(c *config) { c.outage = code }
}

// HealthOrReflection reports whether fullMethod ("/package.Service/Method")
// is a method of the gRPC health service (grpc.health.v1.Health) or of
// server reflection (grpc.reflection.v1.ServerReflection,
// grpc.reflection.v1alpha.ServerReflection): the methods the interceptors
// leave alone unless WithMethods says otherwise.
func HealthOrReflection(fullMethod string) bool {
	rest, ok := strings.CutPrefix(fullMethod, "/")
	if !ok {
		return false
	}
	service, method, ok := strings.Cut(rest, "/")
	if !ok || strings.Contains(method, "/") {
		// grpc-go routes on the last '/': "/grpc.health.v1.Health/../x.Svc/M"
		// is no method of the health service.
		return false
	}
	switch service {
	case "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection":
		return true
	}
	return false
}

// limitedByDefault is the default of WithMethods.
func limitedByDefault(fullMethod string) bool { return !HealthOrReflection(fullMethod) }

// interceptor is what the unary and stream interceptors share.
type interceptor struct {
	lim    Limiter
	key    KeyFunc
	cfg    config
	policy []*fields.Policy        // one per limit of lim
	logged [logKinds]throttle.Gate // one per kind of line
}

func newInterceptor(lim Limiter, key KeyFunc, opts []Option) *interceptor {
	if ll, ok := lim.(*leaselimit.Limiter); lim == nil || ok && ll == nil || key == nil {
		panic("grpclimit: nil Limiter or KeyFunc")
	}
	in := &interceptor{lim: lim, key: key, cfg: config{limited: limitedByDefault, outage: codes.Unavailable}}
	for _, o := range opts {
		if o != nil {
			o(&in.cfg)
		}
	}
	if in.cfg.limited == nil {
		in.cfg.limited = limitedByDefault
	}
	if in.cfg.logger == nil {
		in.cfg.logger = slog.Default()
	}
	if in.cfg.outage == codes.OK {
		panic("grpclimit: WithOutageCode(codes.OK) would let refused calls through")
	}
	if in.cfg.outage > codes.Unauthenticated {
		// No gRPC code: clients and dashboards would read it as Unknown.
		panic(fmt.Sprintf("grpclimit: WithOutageCode(%d) is not a gRPC status code", uint32(in.cfg.outage)))
	}
	limits := []policy.Limit{lim.Limit()}
	if ml, ok := lim.(interface{ Limits() []policy.Limit }); ok {
		limits = ml.Limits()
	}
	for _, l := range limits {
		in.policy = append(in.policy, fields.NewPolicy(l))
	}
	return in
}

// decide takes the call's tokens. It returns the metadata to send (nil for
// none) and the error that refuses the call, if any.
func (in *interceptor) decide(ctx context.Context, fullMethod string) (md metadata.MD, err error) {
	finished := false
	defer func() {
		// grpc-go recovers no handler's panic: one in the key or cost
		// function or a Limiter of the user's took the whole server down.
		// finished, not recover's value, tells: panic(nil) recovers as nil
		// under GODEBUG=panicnil=1, and the call went through undecided.
		if finished {
			return
		}
		p := recover()
		if in.due(logPanic) {
			in.cfg.logger.LogAttrs(ctx, slog.LevelError, "grpclimit: panic in the key function, the cost function or the Limiter; the call gets Internal (logged at most once per 10s)",
				slog.String("method", fullMethod), slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
		}
		md, err = nil, status.Error(codes.Internal, "the call could not be rate limited")
	}()
	md, err = in.decideCall(ctx, fullMethod)
	finished = true
	return md, err
}

// The kinds of log lines, each written at most once per logEvery: a
// client can make every call fail (a panic on its metadata), and a line
// with a stack per call would flood the log.
const (
	logPanic = iota
	logLimiterError
	logKinds
)

const logEvery = 10 * time.Second

// due reports whether a line of kind may be written now, and claims it.
func (in *interceptor) due(kind int) bool { return in.logged[kind].Due(logEvery) }

// decideCall is decide without its recovery.
func (in *interceptor) decideCall(ctx context.Context, fullMethod string) (metadata.MD, error) {
	n := int64(1)
	if in.cfg.cost != nil {
		if n = in.cfg.cost(ctx, fullMethod); n == 0 {
			return nil, nil
		}
	}
	if n < 0 {
		// The server's cost function is wrong, not the call: said before
		// the key is read (a call without one was told InvalidArgument,
		// its client blamed for the server's bug).
		if in.due(logLimiterError) {
			in.cfg.logger.LogAttrs(ctx, slog.LevelError, "grpclimit: the cost function returned a negative cost; the call gets Internal (logged at most once per 10s)",
				slog.String("policy", in.lim.Limit().Name), slog.String("method", fullMethod), slog.Int64("cost", n))
		}
		return nil, status.Error(codes.Internal, "the call could not be rate limited")
	}
	key, err := in.key(ctx, fullMethod)
	if err != nil {
		// A status error keeps its code, unless it is OK: the call would
		// end without its handler, seen by the client as a success.
		if st, ok := status.FromError(err); ok && st.Code() != codes.OK && !errors.Is(err, ErrNoKey) {
			return nil, err
		}
		return nil, status.Error(codes.InvalidArgument, "the call does not identify its client as this service's rate limit requires")
	}
	d, err := in.lim.AllowN(ctx, key, n)
	if err != nil && !errors.Is(err, leaselimit.ErrInvalidKey) && !(errors.Is(err, leaselimit.ErrInvalidCost) && n > 0) && ctx.Err() == nil && in.due(logLimiterError) {
		in.cfg.logger.LogAttrs(ctx, slog.LevelError, "grpclimit: limiter error (logged at most once per 10s)",
			slog.String("policy", in.lim.Limit().Name), slog.String("method", fullMethod), slog.String("error", err.Error()))
	}
	switch {
	case errors.Is(err, leaselimit.ErrInvalidKey):
		return nil, status.Error(codes.InvalidArgument, "the call's rate-limit key is not valid")
	case errors.Is(err, leaselimit.ErrInvalidCost) && n > 0:
		return nil, in.refusedForever(n)
	case errors.Is(err, leaselimit.ErrInvalidCost), errors.Is(err, policy.ErrInvalidLimit), errors.Is(err, leaselimit.ErrInvalidOption):
		return nil, status.Error(codes.Internal, "the call could not be rate limited")
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return nil, status.FromContextError(err).Err()
	case err != nil:
		return nil, status.Error(codes.Unavailable, "the call's rate limit could not be checked; try again later")
	}
	if d.Shadow {
		return nil, nil // a shadow limit leaves the call alone
	}
	if d.Limit == (policy.Limit{}) {
		// A Limiter of the user's that names no limit: the refusal names
		// the Limiter's, as httplimit does ("" otherwise).
		d.Limit = in.lim.Limit()
	}
	if d.Allowed {
		return in.fields(d, true), nil
	}
	outage := d.Source == leaselimit.SourceFallback // see the package doc
	return in.fields(d, !outage), in.refusal(d, outage)
}

// refusedForever is the status error of a call whose cost n is above the
// Burst of a limit (of several, the smallest): no wait would let it
// through, so ResourceExhausted with a QuotaFailure that says why and no
// RetryInfo (UnaryClientInterceptor does not retry it).
func (in *interceptor) refusedForever(n int64) error {
	l := fields.Narrowest(in.policy)
	why := "the call " + fields.CannotAdmit(n, l)
	st := status.New(codes.ResourceExhausted, why)
	if withInfo, err := st.WithDetails(&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{
		{Subject: l.Name, Description: why}}}); err == nil {
		st = withInfo
	}
	return st.Err()
}

// refusal is the status error of a denial d: an outage's (see the package doc) with
// the outage code, else ResourceExhausted with a QuotaFailure naming the
// limit; RetryInfo carries d.RetryAfter either way.
func (in *interceptor) refusal(d leaselimit.Decision, outage bool) error {
	retry := &errdetails.RetryInfo{RetryDelay: durationpb.New(d.RetryAfter)}
	after := "; retry after " + strconv.FormatInt(fields.CeilSeconds(d.RetryAfter), 10) + "s"
	if outage {
		st := status.New(in.cfg.outage, "rate limit \""+d.Limit.Name+"\" cannot be checked: its store is unavailable"+after)
		if withInfo, err := st.WithDetails(retry); err == nil {
			st = withInfo
		}
		return st.Err()
	}
	st := status.New(codes.ResourceExhausted, "rate limit \""+d.Limit.Name+"\" exceeded"+after)
	if withInfo, err := st.WithDetails(retry, &errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{
		{Subject: d.Limit.Name, Description: "quota exhausted"}}}); err == nil {
		st = withInfo
	}
	return st.Err()
}

// fields returns the RateLimit-Policy metadata and, when d says something
// of the caller's quota (an outage's denial does not), d's RateLimit.
func (in *interceptor) fields(d leaselimit.Decision, quota bool) metadata.MD {
	md := metadata.MD{}
	for _, p := range in.policy {
		md.Append(MetadataRateLimitPolicy, p.Member)
	}
	if !quota {
		return md
	}
	for i := range fields.Count(in.policy, d) {
		md.Append(MetadataRateLimit, fields.Member(in.policy, i, d))
	}
	return md
}

// UnaryServerInterceptor takes tokens from lim for every unary call of a
// limited method (WithMethods), keyed by key, before the handler runs.
func UnaryServerInterceptor(lim Limiter, key KeyFunc, opts ...Option) grpc.UnaryServerInterceptor {
	in := newInterceptor(lim, key, opts)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if !in.cfg.limited(info.FullMethod) {
			return handler(ctx, req)
		}
		md, err := in.decide(ctx, info.FullMethod)
		if md != nil {
			_ = grpc.SetHeader(ctx, md)
		}
		if err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

// StreamServerInterceptor takes tokens from lim once per stream of a
// limited method (WithMethods), keyed by key, before the handler runs.
func StreamServerInterceptor(lim Limiter, key KeyFunc, opts ...Option) grpc.StreamServerInterceptor {
	in := newInterceptor(lim, key, opts)
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if !in.cfg.limited(info.FullMethod) {
			return handler(srv, ss)
		}
		md, err := in.decide(ss.Context(), info.FullMethod)
		if md != nil {
			_ = ss.SetHeader(md)
		}
		if err != nil {
			return err
		}
		return handler(srv, ss)
	}
}

// RetryAfter returns the delay of the google.rpc.RetryInfo detail of err, if
// it is a status error with one.
func RetryAfter(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}

// UnaryClientInterceptor retries a call refused with codes.ResourceExhausted
// or codes.Unavailable (an outage, see WithOutageCode) and a RetryInfo
// detail after the delay it names, up to attempts calls in all, and only
// while the call's deadline (if any) leaves room for the wait. Other errors,
// and refusals without RetryInfo, return at once.
func UnaryClientInterceptor(attempts int) grpc.UnaryClientInterceptor {
	attempts = max(attempts, 1)
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		for i := 1; ; i++ {
			err := invoker(ctx, method, req, reply, cc, opts...)
			if c := status.Code(err); (c != codes.ResourceExhausted && c != codes.Unavailable) || i >= attempts {
				return err
			}
			wait, ok := RetryAfter(err)
			if !ok {
				return err
			}
			if dl, ok := ctx.Deadline(); ok && time.Now().Add(wait).After(dl) {
				return err
			}
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return err
			case <-t.C:
			}
		}
	}
}
