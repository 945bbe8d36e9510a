// Package httplimit is for services that serve HTTP: it puts a
// leaselimit.Limiter in front of an http.Handler (Middleware), answers a
// decision made inside a handler (AddFields, Refuse), and tells clients how
// to back off, with the response header fields of
// draft-ietf-httpapi-ratelimit-headers-10.
//
//	c, _ := leaselimit.NewClient(rdb)
//	burst := policy.PerMinute(60).WithName("burst")
//	daily := policy.Quota("daily", 10000, policy.Day, time.UTC) // full again at midnight UTC
//	key := httplimit.ClientIP() // r.RemoteAddr; pass your proxies' prefixes to honour X-Forwarded-For
//	h := httplimit.Middleware(c.Limiter(burst, daily), key)(app) // a token from each, or from none
//
// # Response header fields
//
// Every response that passed through a Middleware carries its policy, and
// every response for which it made a decision carries the service limit:
//
//	RateLimit-Policy: "burst";q=60;w=60, "daily";q=10000;w=86400
//	RateLimit: "burst";r=59;t=1, "daily";r=9999;t=43200
//
// Both are Structured Field Lists (RFC 9651/8941). Each Middleware appends its
// own member to the list already in the response header, joined into one field
// line (", "-separated), so the outermost Middleware's member comes first. The
// member is the policy name (policy.Limit.Name, a quoted sf-string) with:
//
//   - q and w: q tokens per w seconds is the limit's sustained rate, Rate
//     per Period, exactly: w is the shortest whole number of seconds that
//     is a whole number of Periods (PerMinute(100) gives q=100;w=60, 5 per
//     100 ms q=50;w=1, 7 per 1.5 s q=14;w=3). A client that has spent its
//     burst and then paces itself to q per w seconds is not refused by this
//     limit. (Only a rate whose tokens in that window need more than 15
//     digits is rounded, down.) A calendar quota (policy.Quota) says its
//     tokens per window, w being the window's usual length (a month counts
//     30 days); t tells when its window ends.
//   - leaselimit-burst: the most the bucket holds (Burst), the tokens a
//     client may spend at once, when that is not q:
//     policy.PerSecond(100).WithBurst(200) gives
//     "default";q=100;w=1;leaselimit-burst=200. When it is absent the
//     burst is q. The draft defines no burst parameter and asks that
//     implementation-specific ones carry a vendor prefix (Section 3.1);
//     clients that do not know it can ignore it, and q/w stays true.
//   - r: Decision.Remaining, the tokens left for this key (best knowledge:
//     with leases it counts the local lease plus what Redis last reported;
//     during a Redis outage, what the failure policy says). It never exceeds
//     the burst.
//   - t: the seconds, rounded up, until more quota is available: on an allowed
//     request, until the next token arrives (0 when the bucket is full); on a
//     denied request, until enough tokens for the request arrive — the same
//     value as Retry-After. After r is spent, one token arrives every w/q
//     seconds.
//
// A denied request gets 429 Too Many Requests, Retry-After (whole seconds,
// rounded up, at least 1, never earlier than t) and an RFC 9457
// application/problem+json body of type
// "https://iana.org/assignments/http-problem-types#quota-exceeded" listing the
// violated policy in "violated-policies". WithDeniedHandler replaces the body;
// the header fields are already set when it runs. WithLegacyHeaders adds
// X-RateLimit-Limit, X-RateLimit-Remaining and X-RateLimit-Reset.
//
// # Redis outages
//
// While Redis is unavailable the Limiter's failure policy decides
// (leaselimit.SourceFallback). Its admissions pass as usual. Its denials —
// every request under policy.FailClosed, a request above this instance's
// share of the limit under policy.FailLocal — are not the client's overuse,
// and are not answered as if they were: they get 503 Service Unavailable,
// Retry-After (the Decision's RetryAfter: for FailClosed, until the
// circuit breaker lets a probe through; for FailLocal, until this
// instance's share has the tokens), and a problem+json body of type
// "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
// (draft-10, Section 5.2, whose recommended status is 503), without
// "violated-policies": no quota was exceeded. The response carries the
// RateLimit-Policy member, which describes the limit and does not change
// with an outage, but no RateLimit member and no legacy field of this
// Middleware: the failure policy's Remaining is not the key's bucket
// (FailClosed says 0 for every key), and Retry-After says when to come
// back. WithOutageHandler replaces the response; WithOutageAsDenial answers
// these denials like any other (429, with RateLimit), as before. A limit in
// shadow mode never refuses, during an outage either.
//
// # Several limiters on one route
//
// Middlewares compose by nesting; the outer one decides first. A request the
// outer one denies never reaches the inner one, so it takes nothing from the
// inner limit. A request the outer one admits has taken the outer's tokens
// even if the inner one then denies it: tokens are not given back. Put the
// limit whose tokens are cheapest to lose outermost — a short burst limit
// outside a daily quota — so that requests refused by the burst limit do not
// spend the daily quota. The 429 lists only the policy that denied it; the
// response carries the RateLimit members of the limiters that decided.
//
// # Decisions made in a handler
//
// A handler that decides itself — it calls Reserve and Settle for a cost
// known afterwards, or AllowN with a cost it computes — answers the
// decision as Middleware would with AddFields (RateLimit-Policy and
// RateLimit, for every decision) and Refuse (Retry-After and the 429, or
// an outage's 503, for a denial). Middleware answers through the same
// code, so both send the same bytes for the same decision.
//
// # Errors
//
// A KeyFunc error gets WithKeyErrorHandler's response, by default 400 Bad
// Request with a problem+json body (never a silent pass). A Limiter error
// (a closed Limiter, the request's context ending, a negative cost, a
// leaselimit bug — never a Redis outage, which the failure policy decides)
// gets WithErrorHandler's response, by default 503 Service Unavailable
// (500 for a negative cost, an invalid limit or a refused view option,
// which are server bugs) with a generic problem+json body: the error text
// never reaches the client. The default error handler logs the error,
// without the key, to WithLogger's logger.
package httplimit
