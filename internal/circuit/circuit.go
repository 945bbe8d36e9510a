// Package circuit is the circuit breaker around leaselimit's Redis calls
// (github.com/sony/gobreaker/v2), for the root package and
// internal/redispath: which errors count against Redis, the time budget's
// errors, and the bookkeeping that tells a Redis that does not answer from
// a process that is behind. Users configure it through breaker.Settings.
//
// Counted as failures: network errors, timeouts (including the Client's own
// time budget, once the Client has found that its own process was keeping
// up; a budget miss while the process was behind is not Redis's),
// connection refused or reset, a closed pool, and Redis replies that mean
// the server cannot serve now (LOADING, BUSY, READONLY, MASTERDOWN,
// CLUSTERDOWN, MISCONF, NOREPLICAS, OOM). Not counted: success, a caller's
// context.Canceled, NOSCRIPT (the authority reloads the script and
// retries), a Redis Cluster slot moving between nodes (see Moving), and
// errors that are leaselimit's own bugs (the authority's ErrScript and
// ErrReply), which the Client returns to the caller instead of hiding them
// behind the failure policy.
package circuit

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/monotime"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
)

// ErrBudget marks an authority call that ran out of its time budget.
var ErrBudget = errors.New("breaker: time budget exceeded")

// ErrUnreachable marks an authority call given up at its time budget (it
// wraps ErrBudget too) that never got a connection to Redis: go-redis's own
// dial retries outlast any budget, so the dial error itself arrives too
// late to tell. See Unreachable.
var ErrUnreachable = errors.New("breaker: no connection to Redis")

// Settings are a Breaker's: the user's breaker.Settings and the clock.
type Settings struct {
	breaker.Settings
	// Now, if set, is the clock of OpenUntil and Rejects (the Client
	// passes the clock of its local state, so that retry-afters are on one
	// clock). Default time.Now. The half-open transition itself follows
	// gobreaker's own (real) clock.
	Now func() time.Time
}

// WithDefaults returns s with zero fields set to their defaults (those
// documented on breaker.Settings).
func (s Settings) WithDefaults() Settings {
	if s.Failures == 0 {
		s.Failures = 5
	}
	if s.OpenFor == 0 {
		s.OpenFor = 250 * time.Millisecond
	}
	if s.Probes == 0 {
		s.Probes = 1
	}
	if s.Interval == 0 {
		s.Interval = 10 * time.Second
	}
	return s
}

// stateOf is the breaker.State of a gobreaker state.
func stateOf(s gobreaker.State) breaker.State {
	switch s {
	case gobreaker.StateHalfOpen:
		return breaker.HalfOpen
	case gobreaker.StateOpen:
		return breaker.Open
	}
	return breaker.Closed
}

// Breaker is a circuit breaker for authority calls. Its fast check, Rejects,
// is a pair of atomic loads.
type Breaker struct {
	cb        *gobreaker.TwoStepCircuitBreaker[struct{}]
	state     atomic.Int32
	openUntil atomic.Int64 // a monotime; while now is before it, Rejects is true (0: not open)
	openFor   time.Duration
	now       func() time.Time
	replies   atomic.Int64 // see CountReply
	lastNet   atomic.Int64 // the monotime of the last network error (NoteNetworkError)

	// closed is the closed breaker's spell, nil while it is open or
	// half-open (see Allow).
	closed atomic.Pointer[closedSpell]
	// failing counts the failures reported to gobreaker since the last
	// success reported to it: while it is 0, a success has nothing to
	// reset.
	failing atomic.Int64
	// report orders the reports made for calls of a closed spell: while
	// the breaker is closed, only they reach gobreaker.
	report sync.Mutex
}

// closedSpell is one stretch of time the breaker stays closed: the done
// that Allow hands out meanwhile, and what it tells gobreaker (see Allow).
type closedSpell struct {
	b    *Breaker
	done func(error)
}

// New returns a closed breaker named name.
func New(name string, s Settings) *Breaker {
	s = s.WithDefaults()
	b := &Breaker{openFor: s.OpenFor, now: s.Now}
	if b.now == nil {
		b.now = time.Now
	}
	user := s.OnStateChange
	b.cb = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        name,
		MaxRequests: s.Probes,
		Interval:    s.Interval,
		Timeout:     s.OpenFor,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			return c.ConsecutiveFailures >= s.Failures
		},
		OnStateChange: func(_ string, from, to gobreaker.State) {
			// Runs under gobreaker's lock: record only.
			b.state.Store(int32(stateOf(to)))
			b.closed.Store(nil)
			if to == gobreaker.StateClosed {
				b.failing.Store(0) // gobreaker's counts start again
				b.closed.Store(b.newSpell())
			}
			if to == gobreaker.StateOpen {
				// On the monotonic clock (see monotime): kept
				// in wall time, a step of the system clock back
				// by d held the breaker open for d more.
				b.openUntil.Store(monotime.Of(b.now().Add(b.openFor)))
			} else {
				b.openUntil.Store(0)
			}
			if user != nil {
				user(stateOf(from), stateOf(to))
			}
		},
		IsExcluded: func(err error) bool { return err != nil && !Counts(err) },
	})
	b.closed.Store(b.newSpell())
	return b
}

// newSpell returns a new closed spell of b.
func (b *Breaker) newSpell() *closedSpell {
	s := &closedSpell{b: b}
	s.done = s.finish
	return s
}

// State returns the last state the breaker moved to.
func (b *Breaker) State() breaker.State { return breaker.State(b.state.Load()) }

// CountReply records that Redis answered a call through this breaker (with
// a decision or an error reply: anything but silence or a broken
// connection).
func (b *Breaker) CountReply() { b.replies.Add(1) }

// NoteNetworkError records that a call failed at now with a network error
// that is not a timeout (a refused or reset connection).
func (b *Breaker) NoteNetworkError(now time.Time) { b.lastNet.Store(monotime.Of(now)) }

// NetworkErrorSince reports whether a call failed with such a network
// error at or after t.
func (b *Breaker) NetworkErrorSince(t time.Time) bool {
	last := b.lastNet.Load()
	return last != 0 && last >= monotime.Of(t)
}

// RepliesSeen returns how many calls Redis has answered (see CountReply).
// Two readings tell how many replies arrived in between.
func (b *Breaker) RepliesSeen() int64 { return b.replies.Load() }

// Rejects reports, without locking, whether the breaker is open at now()
// and not yet due for a probe. The clock is read only while the breaker is
// open: a closed breaker's check is a single atomic load, and an exact
// decision would otherwise read the clock once more for nothing.
func (b *Breaker) Rejects(now func() time.Time) bool {
	u := b.openUntil.Load()
	return u != 0 && monotime.Of(now()) < u
}

// OpenUntil returns when the open breaker lets probes through, or the zero
// time when it is not open.
func (b *Breaker) OpenUntil() time.Time {
	u := b.openUntil.Load()
	if u == 0 {
		return time.Time{}
	}
	return monotime.Time(u)
}

// Allow asks to make one Redis call. On success the caller must call done
// exactly once with the call's error; on breaker.ErrOpen (the breaker is
// open or its half-open probes are all in flight) it must not call Redis.
//
// While the breaker is closed, a call is told to gobreaker only if its
// outcome changes gobreaker's counts: a failure, or a success after
// failures (see closedSpell.finish). gobreaker's own two steps took two
// locks, two readings of the clock and an allocation per call, about a
// sixth of a lone caller's client code; a closed breaker's admission
// decides nothing (ReadyToTrip reads only the consecutive failures), and
// a success with no failure before it changes nothing that trips it.
// gobreaker's Interval then clears the counts at the first report after
// it has passed rather than at the first call: a clear still comes at
// most once per Interval, and a run of failures is cleared as before,
// but its moment can differ, and an outcome is counted in the Interval
// it is reported in, not the one its call was admitted in (a success
// admitted before a clear resets the failures after it).
func (b *Breaker) Allow() (done func(error), err error) {
	if s := b.closed.Load(); s != nil {
		return s.done, nil
	}
	done, err = b.cb.Allow()
	if err != nil {
		return nil, breaker.ErrOpen
	}
	if s := b.closed.Load(); s != nil {
		// The breaker closed while gobreaker admitted the call (a probe
		// closed it meanwhile): a call of a closed breaker is its spell's.
		// Regression (a review): gobreaker's own done counted such a
		// call's failure where failing did not see it, no success after
		// it was reported, and the breaker tripped on fewer consecutive
		// failures than Failures until the Interval cleared the count.
		done(context.Canceled) // excluded: counts nothing, frees a probe's place
		return s.done, nil
	}
	return done, nil
}

// finish is the done of a call admitted during spell s: it tells
// gobreaker the call's outcome if that changes its counts, as a call
// made then. A call whose spell has ended is dropped, as gobreaker drops
// a call of an earlier generation.
func (s *closedSpell) finish(err error) {
	b := s.b
	switch {
	case err == nil:
		if b.failing.Load() == 0 {
			return // no failure to reset: ordered before any failure still being reported
		}
	case !Counts(err):
		return // excluded: gobreaker would count nothing
	}
	b.report.Lock()
	defer b.report.Unlock()
	if b.closed.Load() != s {
		return
	}
	// failing moves before gobreaker does: a success that reads it 0
	// comes before this failure, and one that reads it above 0 waits
	// for the lock, after it.
	if err == nil {
		b.failing.Store(0)
	} else {
		b.failing.Add(1)
	}
	done, aerr := b.cb.Allow()
	if aerr != nil {
		return
	}
	done(err)
}

// Excluded reports whether err says nothing about Redis's health: a caller's
// cancellation, or NOSCRIPT (the authority reloads the script and retries).
func Excluded(err error) bool {
	return err != nil && (errors.Is(err, context.Canceled) || redis.HasErrorPrefix(err, "NOSCRIPT"))
}

// Unreachable reports whether err says that no connection to Redis could
// be made, as opposed to a connection that did not answer: a dial error
// (connection refused, no route to the host or network, a DNS failure, a
// dial timeout), or a call marked with ErrUnreachable. A wrong address and
// a Redis that is down both look like this; a hung Redis does not.
func Unreachable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrUnreachable) {
		return true
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return true
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return true
	}
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH)
}

// unavailable are the codes of Redis error replies that mean the server
// cannot serve now.
var unavailable = []string{"LOADING", "BUSY", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "MISCONF", "NOREPLICAS", "OOM"}

// moving are the codes of the Redis Cluster replies that say the call's
// slot is moving between nodes (see Moving).
var moving = []string{"MOVED ", "ASK ", "TRYAGAIN"}

// Moving reports whether err is a Redis Cluster reply that says the call's
// slot is moving between nodes (a reshard), left once go-redis's
// redirects ran out: MOVED, ASK, or TRYAGAIN (a multi-key call during a
// migration, as leaselimit's are: their resend-safety keys never exist
// beforehand). The call was not made; the node is healthy. The failure
// policy decides for it, and the breaker does not count it, so the
// node's other slots keep going to Redis.
func Moving(err error) bool {
	if err == nil {
		return false
	}
	for _, code := range moving {
		if redis.HasErrorPrefix(err, code) {
			return true
		}
	}
	return false
}

// NoAnswer reports whether err says that Redis gave the call no answer to
// decide by, so that the failure policy decides: an outage (see Counts),
// or a Cluster slot moving between nodes (see Moving), which the breaker
// does not count.
func NoAnswer(err error) bool { return Counts(err) || Moving(err) }

// Counts reports whether err counts as a Redis failure: by its type or
// sentinel (a timeout, a network error, a closed or exhausted pool, a
// broken connection), or by the code of a Redis error reply.
func Counts(err error) bool {
	if err == nil || Excluded(err) {
		return false
	}
	if errors.Is(err, ErrBudget) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	// net.Error covers *net.OpError (refused, reset, broken pipe, no route),
	// i/o timeouts, net.ErrClosed and bare syscall errnos.
	var ne net.Error
	if errors.As(err, &ne) {
		return true
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrPoolExhausted) {
		return true
	}
	for _, code := range unavailable {
		if redis.HasErrorPrefix(err, code) {
			return true
		}
	}
	// Other replies (WRONGTYPE, NOPERM, our own script's argument errors)
	// are not Redis being unavailable.
	return false
}
