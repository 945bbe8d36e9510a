// Package lease is the local decision protocol of a leaselimit Limiter:
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
//
// The files: leases.go is the protocol; entry.go the state of one key;
// sizer.go how large a lease is and how a key at its limit is batched;
// table.go the bounded key table; local.go the FailLocal bucket.
package lease
