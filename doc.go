// Package leaselimit is for Go services that run as several instances and
// must share their rate limits: a distributed rate limiter with Redis as the
// authority and local leases for speed. Start with NewClient and
// Client.Limiter; package policy describes limits; packages httplimit and
// grpclimit put a Limiter in front of HTTP and gRPC services.
//
// # The Client and its Limiters
//
// A Client (NewClient) is the engine a process shares: the Redis client,
// the circuit breakers, the local key table and the background goroutine;
// Close it at shutdown, Check it for readiness. Client.Limiter returns a
// Limiter for one limit, or for several taken from together, cheap enough
// to look up per request; each is a view of the Client with its own
// failure policy and enforcement (Limiter.With):
//
//	c, err := leaselimit.NewClient(rdb)
//	api := c.Limiter(policy.PerMinute(100).WithName("api"))
//	login := c.Limiter(loginLimit).With(leaselimit.WithFailureMode(policy.FailClosed))
//	d, err := api.Allow(ctx, key)
//
// # The model
//
// Every key has one token bucket in Redis (policy.Limit: Burst tokens,
// refilled at Rate per Period). One atomic Lua script updates it on Redis's
// own clock, so instances with skewed clocks agree, and a request for n
// tokens is all or nothing; a denial takes nothing.
//
// Asking Redis on every request is exact but slow and makes Redis part of
// every request's critical path. So, by default, the Client keeps a small
// lease of tokens per busy key. The tokens of a lease are debited from the
// Redis bucket when the lease is granted, then spent locally with one atomic
// operation. Hence, while Redis is healthy, the fleet never admits more than
// Burst + Rate·T over any run of length T; the price is bounded
// under-admission, the tokens sitting unused in leases (they are refunded
// when a lease expires and on Close). Leases are sized from each key's
// observed demand: a cold key gets leases of one token and behaves exactly
// like a central bucket; leases shrink towards one token as the bucket
// empties. After Redis denies a key, the key is denied locally until tokens
// are due (the negative cache), so a key far over its limit costs Redis
// almost nothing. Concurrent misses for one key share one Redis call.
//
// WithoutLease selects exact mode: every decision is one script call, and
// the decisions for a key are exactly those of golang.org/x/time/rate fed
// the same (Redis) times.
//
// # Failures
//
// Every Redis call runs within a time budget (WithTimeout) and through a
// circuit breaker (WithBreaker, breaker.Settings). While Redis is unavailable the failure
// policy decides (WithFailureMode): admit, deny, or a local bucket with
// 1/FleetSize of the limit. Such decisions carry SourceFallback and are not
// errors. NewClient makes no Redis call, so it succeeds while Redis is down.
//
// # Where a decision comes from
//
// Decision.Source says it: SourceLease, admitted locally from tokens leased
// already; SourceCache, denied locally after Redis denied the key;
// SourceAuthority, decided by a Redis call made for it (possibly shared with
// concurrent callers of the same key); SourceFallback, decided by the
// failure policy while Redis was unavailable. A call that returns an error
// carries SourceNone and describes nothing.
//
// # Keys
//
// Keys are opaque bytes, 1 to MaxKeyLen long. Redis sees only a digest:
// "<prefix>:<limit name>:<rate>/<period>/<burst>:{<128-bit hex digest>}",
// which spreads keys over Redis Cluster slots and never forms a hash tag
// from user bytes.
package leaselimit
