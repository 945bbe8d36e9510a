// Package leaselimit is a distributed rate limiter for a fleet of Go service
// instances, with Redis as the authority and local leases for speed.
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
// circuit breaker (package breaker). While Redis is unavailable the failure
// policy decides (WithFailureMode): admit, deny, or a local bucket with
// 1/FleetSize of the limit. Such decisions carry SourceFallback and are not
// errors. NewClient makes no Redis call, so it succeeds while Redis is down.
//
// # How a decision flows
//
// AllowN validates its input, then asks the lease protocol
// (lease.Leases.Decide), which decides from local state alone: a lease hit
// (SourceLease), a denial by the negative cache (SourceCache), or a miss.
// On a miss the caller joins the refill of its key (one per key at a time,
// golang.org/x/sync/singleflight); the one caller that runs it asks the
// protocol what to request (Plan), makes one budgeted authority call
// through the key's breaker, and hands the grant back (Complete); each
// waiting caller then collects its decision (Collect: SourceAuthority). A
// call that fails, or a breaker that holds calls back, goes to the failure
// policy (SourceFallback). Data flows one way: the Limiter performs I/O,
// the protocol keeps state and decides, the authority runs the scripts.
//
// The root package holds one concern per file: client.go (the Client),
// limiter.go (the Limiter and its decisions), view.go (With and the view
// options), set.go (the limits a Limiter enforces together: one limit is a
// set of one), engine.go (what a Client shares, and its sets of limits),
// bucket.go (Peek and Reset), reserve.go (Reserve and Settle), debts.go,
// shadow.go, deprecated.go (the 0.2 API over the Client), refill.go
// (misses, coalesced refills, prefetch),
// exact.go (one call for exactly n), authorize.go (what a call asks of
// Redis, and what is done with a grant whose caller may have left),
// fallback.go (the failure policy), refunds.go and janitor.go (tokens on
// their way back, applied once to the generation and window they left; the
// background goroutine), check.go (readiness), logger.go, options.go and
// decision.go. Every Redis call goes through internal/redispath: the time
// budget, the breakers (one per node), the lanes that batch acquire calls,
// and the gate Close waits for.
//
// # Keys
//
// Keys are opaque bytes, 1 to MaxKeyLen long. Redis sees only a digest:
// "<prefix>:<limit name>:<rate>/<period>/<burst>:{<128-bit hex digest>}", which spreads keys over
// Redis Cluster slots and never forms a hash tag from user bytes.
package leaselimit
