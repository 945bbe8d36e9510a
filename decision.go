package leaselimit

import (
	"errors"
	"strconv"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
)

// Errors returned by a Limiter. A denial is not an error, and neither is a
// Redis outage: while Redis is unavailable, decisions follow the failure
// policy with Source == SourceFallback and a nil error.
var (
	// ErrInvalidKey: the key is empty or longer than MaxKeyLen bytes.
	ErrInvalidKey = errors.New("leaselimit: invalid key")
	// ErrInvalidCost: n < 1, or n > the limit's Burst (it could never be admitted).
	ErrInvalidCost = errors.New("leaselimit: invalid cost")
	// ErrClosed: the Client has been closed.
	ErrClosed = errors.New("leaselimit: client closed")
	// ErrWouldExceedDeadline: Wait could not be admitted before ctx's deadline.
	ErrWouldExceedDeadline = errors.New("leaselimit: wait would exceed context deadline")
	// ErrNilContext: a nil context.Context was passed (pass
	// context.Background() when there is no other). The call does nothing.
	ErrNilContext = errors.New("leaselimit: nil context")
)

// errNoRedisClient is New's and NewClient's error for a nil or zero go-redis
// client (see nilclient.Is).
var errNoRedisClient = errors.New("leaselimit: nil or zero redis client (make one with redis.NewClient, NewClusterClient, NewFailoverClient or NewRing)")

// MaxKeyLen is the longest key accepted, in bytes. Keys are opaque bytes:
// braces, control bytes and invalid UTF-8 are fine; Redis only ever sees a
// digest of them.
const MaxKeyLen = 4096

// Source says where a Decision came from.
type Source uint8

const (
	// SourceLease: decided locally from tokens already leased from Redis.
	SourceLease Source = iota
	// SourceAuthority: decided by a Redis call made for this decision
	// (possibly shared with concurrent callers of the same key).
	SourceAuthority
	// SourceCache: denied locally because Redis denied the key recently
	// (the negative cache).
	SourceCache
	// SourceFallback: Redis was unavailable; the failure policy decided.
	SourceFallback
	// SourceNone marks the Decision returned with an error: no decision
	// was made, and nothing in it describes the key.
	SourceNone
)

// String returns "lease", "authority", "cache", "fallback" or "none".
func (s Source) String() string {
	switch s {
	case SourceLease:
		return "lease"
	case SourceAuthority:
		return "authority"
	case SourceCache:
		return "cache"
	case SourceFallback:
		return "fallback"
	case SourceNone:
		return "none"
	}
	return "Source(" + strconv.Itoa(int(s)) + ")"
}

// sourceNames names the sources of decisions, indexed by Source, for
// telemetry (SourceNone marks errors, which are not counted as decisions).
func sourceNames() []string {
	names := make([]string, SourceNone)
	for s := range SourceNone {
		names[s] = s.String()
	}
	return names
}

// Decision is the outcome of one AllowN call. A Decision returned with a
// non-nil error is empty but for Source, SourceNone: it describes nothing.
type Decision struct {
	Allowed    bool
	Limit      policy.Limit
	Remaining  int64         // tokens left for this key, best knowledge
	RetryAfter time.Duration // 0 when allowed; when denied, until n tokens can be available
	ResetAfter time.Duration // until the bucket is full again; with several limits, until every one is (the longest of Parts')
	Source     Source
	// Parts, for a Limiter with several limits (see Client.Limiter),
	// holds every limit's state after the decision, in their order; Limit
	// is then the limit that denied (the one the request waits longest
	// for) or, when admitted, the one with the fewest tokens left. Nil for
	// one limit.
	Parts []Part
	// Shadow marks a decision of a key in shadow mode (WithShadow,
	// WithEnforce): computed, counted and traced, not enforced. Allowed is
	// then true, and ShadowDenied says the limit would have denied.
	Shadow       bool
	ShadowDenied bool

	// since is the ledger stamp of the tokens of a decision that Redis
	// granted outside any lease (authority.Grant.At): a Reservation's
	// tokens go back to that generation of the bucket only.
	since int64
	// shadowRetry is the RetryAfter the limit would have told a request
	// shadow mode admitted (ShadowDenied): the caller is told 0, the
	// decision's span what the limit decided.
	shadowRetry time.Duration
}

// decided turns an answer of the lease protocol into the caller's Decision
// (with Parts when the answer has them: see addParts).
func (l *Limiter) decided(a lease.Answer) Decision {
	var d Decision
	switch a.Status {
	case lease.Leased:
		d = admitted(l.limit, a.Remaining, SourceLease)
	case lease.Granted:
		d = admitted(l.limit, a.Remaining, SourceAuthority)
	case lease.Refused:
		d = denial(l.limit, a.Remaining, a.RetryAfter, SourceAuthority)
	default:
		d = denial(l.limit, a.Remaining, a.RetryAfter, SourceCache)
	}
	l.addParts(&d, a.Parts)
	return d
}

// admitted is an allowed Decision with remaining tokens left.
func admitted(limit policy.Limit, remaining int64, src Source) Decision {
	return Decision{
		Allowed:    true,
		Limit:      limit,
		Remaining:  remaining,
		ResetAfter: resetAfter(limit, remaining),
		Source:     src,
	}
}

// resetAfter is limit.ResetAfter at this moment, reading the clock only for
// a calendar quota: a lease hit on a token bucket reads none.
func resetAfter(limit policy.Limit, remaining int64) time.Duration {
	var now time.Time
	if limit.IsQuota() {
		now = time.Now()
	}
	return limit.ResetAfter(remaining, now)
}

// denial is a denied Decision; its RetryAfter is at least 1µs, so that a
// caller who waits it out always waits.
func denial(limit policy.Limit, remaining int64, retry time.Duration, src Source) Decision {
	return Decision{
		Limit:      limit,
		Remaining:  remaining,
		RetryAfter: max(retry, time.Microsecond),
		ResetAfter: resetAfter(limit, remaining),
		Source:     src,
	}
}

// fromGrant is the Decision of an authority call for exactly the request.
func fromGrant(limit policy.Limit, g authority.Grant, src Source) Decision {
	d := Decision{
		Allowed:    g.Granted > 0,
		Limit:      limit,
		Remaining:  g.Remaining,
		RetryAfter: g.RetryAfter,
		ResetAfter: g.ResetAfter,
		Source:     src,
		since:      g.At,
	}
	if !d.Allowed {
		d.RetryAfter = max(d.RetryAfter, time.Microsecond)
	}
	return d
}
