package httplimit

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"reflect"
	"strconv"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/fields"
	"github.com/leaselimit/leaselimit/policy"
)

// Limiter is what Middleware needs from a limiter; *leaselimit.Limiter
// implements it.
type Limiter interface {
	// AllowN decides whether n tokens may be taken for key now, and takes
	// them if so.
	AllowN(ctx context.Context, key string, n int64) (leaselimit.Decision, error)
	// Limit returns the enforced limit; its Name, Rate, Period and Burst
	// fill RateLimit-Policy. Middleware calls it once.
	Limit() policy.Limit
}

var _ Limiter = (*leaselimit.Limiter)(nil)

// Tiered is a Limiter that also enforces other limits on the same engine,
// with its own failure policy and enforcement; *leaselimit.Limiter
// implements it (the Limiter of those limits on its Client, with its
// view: see leaselimit.Client.Limiter and leaselimit.Limiter.With).
// WithLimitFunc needs one.
//
// Deprecated: its For is leaselimit's deprecated Limiter.For; use
// WithLimiterFunc, which takes the Limiter itself.
type Tiered interface {
	Limiter
	For(limit policy.Limit, more ...policy.Limit) *leaselimit.Limiter
}

var _ Tiered = (*leaselimit.Limiter)(nil)

// KeyFunc returns the rate-limit key of a request: requests with the same key
// share one bucket. An error rejects the request (see WithKeyErrorHandler).
type KeyFunc func(*http.Request) (string, error)

// ProblemTypeQuotaExceeded is the RFC 9457 problem type of a denied request,
// defined by draft-ietf-httpapi-ratelimit-headers-10, Section 5.1.
const ProblemTypeQuotaExceeded = "https://iana.org/assignments/http-problem-types#quota-exceeded"

// ProblemTypeTemporaryReducedCapacity is the RFC 9457 problem type of a
// request the failure policy refused while Redis was unavailable (see
// WithOutageHandler), defined by draft-ietf-httpapi-ratelimit-headers-10,
// Section 5.2, for "a temporary reduction in server capacity", with 503 as
// its recommended status code.
const ProblemTypeTemporaryReducedCapacity = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"

// Header field names, in Go's canonical form (HTTP field names are
// case-insensitive; HTTP/2 and HTTP/3 send them in lower case).
const (
	HeaderRateLimit       = "Ratelimit"        // RateLimit
	HeaderRateLimitPolicy = "Ratelimit-Policy" // RateLimit-Policy
	HeaderRetryAfter      = "Retry-After"
	HeaderLegacyLimit     = "X-Ratelimit-Limit"     // X-RateLimit-Limit
	HeaderLegacyRemaining = "X-Ratelimit-Remaining" // X-RateLimit-Remaining
	HeaderLegacyReset     = "X-Ratelimit-Reset"     // X-RateLimit-Reset
)

// Option configures a Middleware.
type Option func(*config)

type config struct {
	limit    func(*http.Request) policy.Limit
	cost     func(*http.Request) int64
	limiter  func(*http.Request) Limiter // WithLimiterFunc
	denied   func(http.ResponseWriter, *http.Request, leaselimit.Decision)
	outage   func(http.ResponseWriter, *http.Request, leaselimit.Decision)
	keyError func(http.ResponseWriter, *http.Request, error)
	limError func(http.ResponseWriter, *http.Request, error)
	logger   *slog.Logger
	legacy   bool
	// outageAsDenial: WithOutageAsDenial
	outageAsDenial bool
	// shadowHeaders: WithShadowHeaders
	shadowHeaders bool
}

// WithLimiterFunc chooses the Limiter of each request, for plans and tiers:
//
//	plans := map[string]*leaselimit.Limiter{
//		"free": client.Limiter(freeLimit, dailyQuota),
//		"pro":  client.Limiter(proLimit, dailyQuota),
//	}
//	httplimit.Middleware(plans["free"], key, httplimit.WithLimiterFunc(func(r *http.Request) httplimit.Limiter {
//		return plans[planOf(r)]
//	}))
//
// The request is decided by limiter(r), a Limiter of one limit or of
// several together (see leaselimit.Client.Limiter), and RateLimit-Policy
// and RateLimit describe its limits; a nil one leaves the request to
// Middleware's own Limiter. The fields of a *leaselimit.Limiter seen before
// are formatted once (Client.Limiter returns the same one for the same
// limits), so a request costs no allocation; other Limiter types have them
// formatted per request. limiter runs once per request, before the key
// function; keep it cheap (a map lookup, or Client.Limiter itself).
func WithLimiterFunc(limiter func(*http.Request) Limiter) Option {
	return func(c *config) { c.limiter = limiter }
}

// WithLimitFunc chooses the limit of each request, for plans and tiers:
//
//	httplimit.Middleware(lim, key, httplimit.WithLimitFunc(func(r *http.Request) policy.Limit {
//		return plans[planOf(r)]
//	}))
//
// The request is decided by the Limiter of limit(r) on lim's Client, with
// lim's failure policy and enforcement (lim.For), and RateLimit-Policy and
// RateLimit describe that limit. lim must implement Tiered (a
// *leaselimit.Limiter does), or Middleware panics. An invalid
// limit gets the error handler's response (by default 500). limit runs once
// per request, before the key function; keep it cheap (a map lookup).
//
// Deprecated: use WithLimiterFunc, whose function returns the Limiter
// (leaselimit.Client.Limiter of the request's limits, several of them if
// need be): it needs no Tiered, whose For is deprecated.
func WithLimitFunc(limit func(*http.Request) policy.Limit) Option {
	return func(c *config) { c.limit = limit }
}

// WithCost sets the number of tokens a request takes (default 1). A cost of
// 0 lets the request through uncharged, with no RateLimit member from this
// Middleware (nothing was decided). A cost above the limit's Burst (of
// several limits, the smallest) can never be admitted: the request is
// refused with 429 and a problem+json body that says so, and no
// Retry-After, since waiting does not help; it takes no tokens. A cost
// below 0 is the cost function's bug: the Limiter returns
// leaselimit.ErrInvalidCost and the request gets the error handler's
// response (by default 500).
func WithCost(cost func(*http.Request) int64) Option {
	return func(c *config) { c.cost = cost }
}

// WithDeniedHandler replaces the response to a denied request. When h runs,
// RateLimit-Policy, RateLimit, Retry-After (and the legacy fields, if
// enabled) are already set on w.Header(); h writes the status and body, and
// may change the header fields. The default writes 429 with an RFC 9457
// problem+json body of type ProblemTypeQuotaExceeded. A denial by the
// failure policy while Redis is unavailable goes to the outage handler
// instead (WithOutageHandler), unless WithOutageAsDenial is set.
func WithDeniedHandler(h func(w http.ResponseWriter, r *http.Request, d leaselimit.Decision)) Option {
	return func(c *config) { c.denied = h }
}

// WithOutageHandler replaces the response to a request that the failure
// policy denied while Redis was unavailable: a denial with
// d.Source == leaselimit.SourceFallback, which policy.FailClosed gives
// every request and policy.FailLocal a request above this instance's share
// of the limit. When h runs, RateLimit-Policy and Retry-After are set on
// w.Header() — d.RetryAfter in whole seconds, rounded up, at least 1: for
// FailClosed, until the circuit breaker lets a probe through; for
// FailLocal, until the share has the tokens — and no RateLimit member or
// legacy field of this Middleware is: the failure policy's Remaining is
// not the key's bucket. The default writes 503 Service Unavailable with an
// RFC 9457 problem+json body of type ProblemTypeTemporaryReducedCapacity,
// so that clients and dashboards tell an outage from a client's overuse.
// A limit in shadow mode never refuses, so h never runs for one.
func WithOutageHandler(h func(w http.ResponseWriter, r *http.Request, d leaselimit.Decision)) Option {
	return func(c *config) { c.outage = h }
}

// WithOutageAsDenial answers a failure policy's denial during a Redis
// outage like any other denial: with a RateLimit member (the policy's
// Remaining, and t until its RetryAfter), the legacy fields if enabled,
// Retry-After, and the denied handler's response (by default 429
// quota-exceeded), as httplimit did before WithOutageHandler existed: for
// clients that back off from a 429 and from nothing else.
func WithOutageAsDenial() Option {
	return func(c *config) { c.outageAsDenial = true }
}

// WithKeyErrorHandler replaces the response to a request whose KeyFunc
// failed, or returned an empty key or one longer than
// leaselimit.MaxKeyLen. The default writes 400 Bad Request with a
// problem+json body; its detail is the KeyError's Detail when err holds a
// *KeyError, and a generic text otherwise (so a KeyFunc's internal errors are
// not shown to clients).
func WithKeyErrorHandler(h func(w http.ResponseWriter, r *http.Request, err error)) Option {
	return func(c *config) { c.keyError = h }
}

// WithErrorHandler replaces the response to a request for which the Limiter
// returned an error (see the package documentation). The default logs the
// error to the logger (WithLogger), except for the request's own context
// ending, and writes a problem+json body that does not include the error
// text: 500 Internal Server Error for leaselimit.ErrInvalidCost (the cost
// function returned a cost the limit can never admit), otherwise
// 503 Service Unavailable with Retry-After: 1.
func WithErrorHandler(h func(w http.ResponseWriter, r *http.Request, err error)) Option {
	return func(c *config) { c.limError = h }
}

// WithLogger sets the logger of the default error handler. Default
// slog.Default(); slog.New(slog.DiscardHandler) silences it. It logs the
// policy name and the error, never the key, the path or the client address.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger = l }
}

// WithShadowHeaders sends RateLimit-Policy and RateLimit for decisions of
// a limit in shadow mode (leaselimit.WithShadow, WithEnforce) too; by
// default a shadow limit adds no header field. Either way a shadow
// decision never changes the response: the request goes on, and its
// would-be denial is only counted and traced.
func WithShadowHeaders() Option {
	return func(c *config) { c.shadowHeaders = true }
}

// WithLegacyHeaders adds X-RateLimit-Limit (Burst), X-RateLimit-Remaining
// (Remaining) and X-RateLimit-Reset (seconds until the bucket is full again,
// rounded up) to responses. They hold one policy only: with several
// Middlewares, the most restrictive decision — the denying one, or else the
// one with the fewest tokens remaining (on a tie, the later reset).
func WithLegacyHeaders() Option {
	return func(c *config) { c.legacy = true }
}

type middleware struct {
	lim      Limiter
	tiered   Tiered // lim, when WithLimitFunc is set
	key      KeyFunc
	cfg      config
	policy   *fields.Policy   // lim's limit
	group    []*fields.Policy // lim's limits, when it enforces several together (see leaselimit.Client.Limiter)
	policies policyCache      // WithLimitFunc's limits
	limiters limiterCache     // WithLimiterFunc's Limiters
}

// nilLimiter reports whether l is nil, also as a nil pointer (or map,
// func...) in the interface: a plan missing from a map of
// *leaselimit.Limiter, which WithLimiterFunc's own example returns,
// panicked on every request.
func nilLimiter(l Limiter) bool {
	if l == nil {
		return true
	}
	if ll, ok := l.(*leaselimit.Limiter); ok {
		return ll == nil
	}
	switch v := reflect.ValueOf(l); v.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Func, reflect.Chan, reflect.Slice, reflect.Interface:
		return v.IsNil()
	}
	return false
}

// multiLimiter is a Limiter that may enforce several limits together;
// *leaselimit.Limiter is one.
type multiLimiter interface {
	Limits() []policy.Limit
}

// describe returns the fields of lim's limit and, when it enforces several
// together, of each of them.
func describe(lim Limiter) (pf *fields.Policy, group []*fields.Policy) {
	pf = newPolicy(lim.Limit())
	if ml, ok := lim.(multiLimiter); ok {
		if ls := ml.Limits(); len(ls) > 1 {
			for _, l := range ls {
				group = append(group, newPolicy(l))
			}
		}
	}
	return pf, group
}

// Middleware returns a middleware that takes tokens from lim for every
// request, keyed by key, before passing the request on; see the package
// documentation for the response header fields, denials, errors and
// composition. It panics if lim or key is nil. It calls lim.Limit() once.
func Middleware(lim Limiter, key KeyFunc, opts ...Option) func(http.Handler) http.Handler {
	if nilLimiter(lim) {
		panic("httplimit: Middleware with a nil Limiter")
	}
	if key == nil {
		panic("httplimit: Middleware with a nil KeyFunc")
	}
	m := &middleware{lim: lim, key: key}
	m.policy, m.group = describe(lim)
	for _, o := range opts {
		if o != nil {
			o(&m.cfg)
		}
	}
	if m.cfg.limit != nil && m.cfg.limiter != nil {
		panic("httplimit: WithLimitFunc and WithLimiterFunc together: keep WithLimiterFunc")
	}
	if m.cfg.limit != nil {
		t, ok := lim.(Tiered)
		if !ok {
			panic("httplimit: WithLimitFunc with a Limiter that has no For method")
		}
		m.tiered = t
	}
	if m.cfg.logger == nil {
		m.cfg.logger = slog.Default()
	}
	if m.cfg.denied == nil {
		m.cfg.denied = m.quotaExceeded
	}
	if m.cfg.outage == nil {
		m.cfg.outage = reducedCapacity
	}
	if m.cfg.keyError == nil {
		m.cfg.keyError = badKey
	}
	return func(next http.Handler) http.Handler {
		if next == nil {
			panic("httplimit: Middleware wrapping a nil http.Handler")
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			m.serve(w, r, next)
		})
	}
}

func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	h := w.Header()
	lim, pf := m.lim, m.policy
	group := m.group
	if m.cfg.limit != nil {
		l := m.cfg.limit(r)
		lim, pf, group = m.tiered.For(l), m.policies.get(l), nil
	}
	if m.cfg.limiter != nil {
		if l := m.cfg.limiter(r); !nilLimiter(l) {
			pf, group = m.limiters.get(l)
			lim = l
		}
	}
	policies := []*fields.Policy{pf}
	if len(group) > 0 {
		policies = group
	}
	key, err := m.key(r)
	if err == nil && (len(key) == 0 || len(key) > leaselimit.MaxKeyLen) {
		err = &KeyError{Detail: "The request's rate-limit key is empty or longer than " +
			strconv.Itoa(leaselimit.MaxKeyLen) + " bytes."}
	}
	if err != nil {
		appendPolicies(h, policies)
		m.cfg.keyError(w, r, err)
		return
	}
	n := int64(1)
	if m.cfg.cost != nil {
		if n = m.cfg.cost(r); n == 0 {
			appendPolicies(h, policies)
			next.ServeHTTP(w, r)
			return
		}
	}
	d, err := lim.AllowN(r.Context(), key, n)
	if err == nil && d.Shadow && !m.cfg.shadowHeaders {
		// A limit in shadow mode leaves the response alone.
		next.ServeHTTP(w, r)
		return
	}
	if err != nil {
		appendPolicies(h, policies)
		if errors.Is(err, leaselimit.ErrInvalidKey) {
			m.cfg.keyError(w, r, &KeyError{Detail: "The request's rate-limit key is not valid.", Err: err})
			return
		}
		if errors.Is(err, leaselimit.ErrInvalidCost) && n > 0 {
			refuseForever(w, n, fields.Narrowest(policies))
			return
		}
		if m.cfg.limError != nil {
			m.cfg.limError(w, r, err)
		} else {
			m.limiterError(w, r, err, pf.Limit.Name)
		}
		return
	}
	if d.Limit == (policy.Limit{}) {
		d.Limit = pf.Limit
	}
	// The failure policy's refusal (or, for a shadow limit, would-be
	// refusal) while Redis was unavailable: its Remaining is not the key's
	// bucket, so no RateLimit member and no legacy field.
	outage := isOutage(d) && !m.cfg.outageAsDenial
	addFields(h, policies, d, outage, m.cfg.legacy)
	if d.Allowed {
		next.ServeHTTP(w, r)
		return
	}
	setRetryAfter(h, d)
	if outage {
		m.cfg.outage(w, r, d)
		return
	}
	m.cfg.denied(w, r, d)
}

// setLegacy sets the X-RateLimit fields unless an outer Middleware already
// set them from a more restrictive decision.
func setLegacy(h http.Header, l policy.Limit, allowed bool, remaining, reset int64) {
	if allowed {
		if v := h[HeaderLegacyRemaining]; len(v) == 1 {
			if old, err := strconv.ParseInt(v[0], 10, 64); err == nil {
				oldReset := int64(-1)
				if rv := h[HeaderLegacyReset]; len(rv) == 1 {
					oldReset, _ = strconv.ParseInt(rv[0], 10, 64)
				}
				if old < remaining || old == remaining && oldReset >= reset {
					return
				}
			}
		}
	}
	h[HeaderLegacyLimit] = []string{strconv.FormatInt(max(l.Burst, 0), 10)}
	h[HeaderLegacyRemaining] = []string{strconv.FormatInt(remaining, 10)}
	h[HeaderLegacyReset] = []string{strconv.FormatInt(reset, 10)}
}

// quotaExceeded is the default denied handler: Refuse's 429, also for an
// outage's denial under WithOutageAsDenial.
func (m *middleware) quotaExceeded(w http.ResponseWriter, _ *http.Request, d leaselimit.Decision) {
	if d.Limit.Name == "" {
		d.Limit.Name = m.policy.Limit.Name
	}
	refuse(w, d, false)
}

// reducedCapacity is the default outage handler: Refuse's 503.
func reducedCapacity(w http.ResponseWriter, _ *http.Request, d leaselimit.Decision) {
	refuse(w, d, true)
}

// badKey is the default key error handler.
func badKey(w http.ResponseWriter, _ *http.Request, err error) {
	detail := "The request does not identify its client as this endpoint's rate limit requires."
	var ke *KeyError
	if errors.As(err, &ke) && ke.Detail != "" {
		detail = ke.Detail
	}
	writeProblem(w, problem{
		Type:   "about:blank",
		Title:  http.StatusText(http.StatusBadRequest),
		Status: http.StatusBadRequest,
		Detail: detail,
	})
}

// limiterError is the default error handler; name is that of the limit of
// the Limiter that decided the request (WithLimiterFunc's choice, not the
// Middleware's own).
func (m *middleware) limiterError(w http.ResponseWriter, r *http.Request, err error, name string) {
	if r.Context().Err() == nil || !errors.Is(err, r.Context().Err()) {
		m.cfg.logger.LogAttrs(r.Context(), slog.LevelError, "httplimit: limiter error",
			slog.String("policy", name), slog.String("error", err.Error()))
	}
	if errors.Is(err, leaselimit.ErrInvalidCost) || errors.Is(err, policy.ErrInvalidLimit) || errors.Is(err, leaselimit.ErrInvalidOption) {
		writeProblem(w, problem{
			Type:   "about:blank",
			Title:  http.StatusText(http.StatusInternalServerError),
			Status: http.StatusInternalServerError,
			Detail: "The request could not be rate limited.",
		})
		return
	}
	w.Header()[HeaderRetryAfter] = []string{"1"}
	writeProblem(w, problem{
		Type:   "about:blank",
		Title:  http.StatusText(http.StatusServiceUnavailable),
		Status: http.StatusServiceUnavailable,
		Detail: "The request's rate limit could not be checked; try again later.",
	})
}
