// Package lease is internal machinery of leaselimit, for its own packages:
// it carries no compatibility promise, and its API changes whenever
// leaselimit needs it to. Users need nothing from it.
//
// It is the local decision protocol of a leaselimit Client:
// Leases decides each request from tokens already debited from the Redis
// bucket (a lease, spent with a lock-free compare-and-swap), from a
// negative cache after a denial, or answers with the refill the authority
// must be asked for; completing that refill yields the decisions of the
// callers that waited for it and the tokens to give back.
//
// Nothing here reads a clock, starts a goroutine or talks to Redis. Every
// time-dependent function takes now, a monotonic reading in nanoseconds
// from an origin of the caller's choosing; the caller (the root package)
// owns the clock, performs the authority calls and refunds, coalesces
// concurrent refills of a key, and applies the failure policy. That keeps
// the protocol testable with step tables over fixed timestamps.
package lease
