package httplimit

import (
	"net/http"
	"strconv"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/fields"
	"github.com/leaselimit/leaselimit/policy"
)

// AddFields adds to h the RateLimit-Policy and RateLimit members of
// decision d of lim, the ones a Middleware of lim sends for the same
// decision, for a decision made outside a Middleware: in a handler that
// calls lim.Reserve, AllowN or WaitN itself. Call it for every decision,
// before the response is written:
//
//	res, err := lim.Reserve(ctx, key, estimate)
//	...
//	d := res.Decision()
//	httplimit.AddFields(w.Header(), lim, d)
//	if !d.Allowed {
//		httplimit.Refuse(w, d)
//		return
//	}
//
// lim says which limits to describe: every limit of a multi-limit (see
// leaselimit.Client.Limiter), in their order, or lim.Limit() (the limit as
// configured, also while a failure policy's share decides). Members are
// appended to the lists already in h, as a Middleware's are, so a decision
// made inside a Middleware's handler comes after the Middleware's own. As
// in Middleware, a failure policy's denial during a Redis outage adds the
// RateLimit-Policy members only (its Remaining is not the key's bucket),
// and a shadow decision adds nothing (see WithShadowHeaders); neither does
// a Decision returned with an error. AddFields never adds Retry-After
// (Refuse does) or the legacy X-RateLimit fields.
func AddFields(h http.Header, lim Limiter, d leaselimit.Decision) {
	if d.Shadow || d.Source == leaselimit.SourceNone {
		return
	}
	var ps []*fields.Policy
	if ml, ok := lim.(multiLimiter); ok {
		if ls := ml.Limits(); len(ls) > 1 {
			for _, l := range ls {
				ps = append(ps, newPolicy(l))
			}
		}
	}
	if ps == nil {
		ps = []*fields.Policy{newPolicy(lim.Limit())}
	}
	if d.Limit == (policy.Limit{}) {
		d.Limit = ps[0].Limit
	}
	addFields(h, ps, d, isOutage(d), false)
}

// Refuse answers a denied decision as Middleware does by default: it sets
// Retry-After (d.RetryAfter in whole seconds, rounded up, at least 1) and
// writes 429 Too Many Requests with an RFC 9457 problem+json body of type
// ProblemTypeQuotaExceeded naming d.Limit in "violated-policies"; or, for
// a failure policy's denial while Redis is unavailable (d.Source ==
// leaselimit.SourceFallback), 503 Service Unavailable with a body of type
// ProblemTypeTemporaryReducedCapacity (see WithOutageHandler). It writes
// the status and the body, so call AddFields before it. For an allowed
// decision, a shadow one included, Refuse writes nothing.
func Refuse(w http.ResponseWriter, d leaselimit.Decision) {
	if d.Allowed {
		return
	}
	setRetryAfter(w.Header(), d)
	refuse(w, d, d.Source == leaselimit.SourceFallback)
}

// isOutage reports whether d is a failure policy's denial (or, for a
// shadow limit, would-be denial) while Redis was unavailable.
func isOutage(d leaselimit.Decision) bool {
	return d.Source == leaselimit.SourceFallback && (!d.Allowed || d.ShadowDenied)
}

// addFields adds the RateLimit-Policy members of ps (one Policy for one
// limit; one per limit of a multi-limit, in their order) and the RateLimit
// members of d under them, and, if legacy, the X-RateLimit fields. For an
// outage's denial (see isOutage) it adds the RateLimit-Policy members only.
func addFields(h http.Header, ps []*fields.Policy, d leaselimit.Decision, outage, legacy bool) {
	appendPolicies(h, ps)
	if outage {
		return
	}
	for i := range fields.Count(ps, d) {
		appendMember(h, HeaderRateLimit, fields.Member(ps, i, d))
	}
	if legacy {
		tight := ps[0].Limit // the limit the legacy fields describe
		if len(ps) > 1 {
			tight = d.Limit
		}
		remaining, t := fields.Of(tight, d)
		reset := fields.CeilSeconds(fields.ResetAfter(tight, d))
		if !d.Allowed {
			reset = max(reset, t)
		}
		setLegacy(h, tight, d.Allowed, remaining, reset)
	}
}

// appendPolicies adds the RateLimit-Policy members of ps.
func appendPolicies(h http.Header, ps []*fields.Policy) {
	for _, p := range ps {
		appendMember(h, HeaderRateLimitPolicy, p.Member)
	}
}

// retryAfter is the Retry-After of a denied decision d, in seconds: its
// RetryAfter rounded up, at least 1 (the t of its RateLimit member).
func retryAfter(d leaselimit.Decision) int64 {
	return max(fields.CeilSeconds(d.RetryAfter), 1)
}

// setRetryAfter sets the Retry-After of a denied decision d.
func setRetryAfter(h http.Header, d leaselimit.Decision) {
	h[HeaderRetryAfter] = []string{strconv.FormatInt(retryAfter(d), 10)}
}

// refuseForever answers a request whose cost n is above the Burst of
// limit l: no wait would let it through, so 429 without Retry-After, and a
// detail that says why.
func refuseForever(w http.ResponseWriter, n int64, l policy.Limit) {
	writeProblem(w, problem{
		Type:     ProblemTypeQuotaExceeded,
		Title:    "Request cannot be satisfied as assigned quota has been exceeded",
		Status:   http.StatusTooManyRequests,
		Detail:   "The request " + fields.CannotAdmit(n, l) + ".",
		Violated: []string{l.Name},
	})
}

// refuse writes the problem+json response to a denied decision d: 503
// temporary-reduced-capacity for an outage's denial, else 429
// quota-exceeded.
func refuse(w http.ResponseWriter, d leaselimit.Decision, outage bool) {
	retry := strconv.FormatInt(retryAfter(d), 10)
	if outage {
		writeProblem(w, problem{
			Type:   ProblemTypeTemporaryReducedCapacity,
			Title:  "Request cannot be satisfied due to temporary server capacity constraints",
			Status: http.StatusServiceUnavailable,
			Detail: "Policy \"" + d.Limit.Name + "\" is running at reduced capacity; retry after " + retry + " s.",
		})
		return
	}
	// A request for more tokens than are left (a weighted one) is refused
	// with some left: "exhausted" beside a RateLimit field whose r is 700
	// told the client the wrong thing (a new user's trial).
	state := "is exhausted"
	if d.Remaining > 0 {
		state = "has " + strconv.FormatInt(d.Remaining, 10) + " left, fewer than the request needs"
	}
	writeProblem(w, problem{
		Type:     ProblemTypeQuotaExceeded,
		Title:    "Request cannot be satisfied as assigned quota has been exceeded",
		Status:   http.StatusTooManyRequests,
		Detail:   "The quota of policy \"" + d.Limit.Name + "\" " + state + "; retry after " + retry + " s.",
		Violated: []string{d.Limit.Name},
	})
}
