package leaselimit

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/policy"
)

// debtBook counts, per bucket, the tokens a failure policy admitted while
// Redis could not answer (FailOpen's admissions, FailLocal's local share),
// and charges them to the bucket once Redis answers again, as a Settle
// charge is made: into debt, at most one Burst of it (see
// authority.Redis.Apply). Without it, every stall longer than the time
// budget would let the fleet admit past the limit and never pay it back;
// with it, over a run with stalls the fleet exceeds the bound by at most
// what the last stall admitted (and what a debt beyond one Burst forgives).
//
// Admissions of one bucket add up in one entry, so the book holds one
// entry per bucket, bounded by WithMaxKeys; an admission that finds the
// book full is not charged, counted on ratelimit.settle.charges.dropped
// and logged. The janitor moves the entries of buckets whose breaker is
// closed to the refund queue, which sends them once, under their own ids,
// or keeps them until Redis answers (see refundQueue); Close moves the
// rest before its final send.
type debtBook struct {
	mu   sync.Mutex
	owed map[debtKey]*debt
	// size is len(owed), read without the lock: a denial asks the book
	// what this instance still owes (see charged), and an empty book, the
	// usual case, costs it one atomic load.
	size  atomic.Int64
	max   int
	tel   *recorder.Recorder
	log   *logger
	clock localClock
}

// debtKey names one bucket's debt: the namer of its limit's buckets, the
// user key and, for a calendar quota, the end of the window the admissions
// were made in (a charge is applied to that window only). The bucket's
// Redis key is made only when the debt is charged: an admission of the
// policy during an outage hashes nothing.
type debtKey struct {
	namer  authority.Namer
	key    string
	window int64
}

// debt is what one bucket owes.
type debt struct {
	limit  policy.Limit
	tokens int64
}

func newDebtBook(max int, tel *recorder.Recorder, log *logger, clock localClock) *debtBook {
	return &debtBook{owed: make(map[debtKey]*debt), max: max, tel: tel, log: log, clock: clock}
}

// owe records n tokens of key's bucket under limit (named by namer) that a
// failure policy admitted at at, on Redis's clock (see serverClock): a
// calendar quota's debt is charged to that window, and dropped if Redis
// has moved on to the next when the charge arrives.
func (b *debtBook) owe(namer authority.Namer, key string, limit policy.Limit, n int64, at time.Time) {
	if n <= 0 {
		return // a debt is never negative: it would go out as a refund
	}
	// A charge beyond two Bursts is capped by the script anyway (and debt
	// beyond one Burst forgiven). Capping n before the sum keeps the sum
	// from overflowing: a Settle(math.MaxInt64) of a policy's reservation
	// added to a debt wrapped to a large negative number, which went out
	// as a refund of a whole Burst.
	n = min(n, 2*limit.Burst)
	k := debtKey{namer: namer, key: key, window: windowOf(limit, at)}
	b.mu.Lock()
	d, ok := b.owed[k]
	switch {
	case ok:
		d.tokens = min(d.tokens+n, 2*limit.Burst) // both at most 2·MaxRate
	case len(b.owed) < b.max:
		b.owed[k] = &debt{limit: limit, tokens: n}
		b.size.Store(int64(len(b.owed)))
	default:
		b.mu.Unlock()
		b.tel.CountDroppedCharge(context.Background(), n)
		b.log.uncharged(b.max)
		return
	}
	b.mu.Unlock()
}

// debtsPerRound bounds the debts one janitor round hands to the refund
// queue: after an outage that touched many keys (a cold long tail), every
// bucket owes, and charging tens of thousands of them in one pipeline
// would hold Redis (and the decisions waiting behind it) for hundreds of
// milliseconds just as it came back. A round is at most 250ms, so 20,000
// debts are charged within 5s.
const debtsPerRound = 1000

// move hands the debts of the buckets whose breaker is closed to q as
// charges, at most debtsPerRound of them; with all set (Close), every
// debt, whatever the breakers say.
func (b *debtBook) move(q *refundQueue, path *redispath.Path, all bool) {
	// Every breaker closed (the one of a single node, say): no debt needs
	// its node looked up. Else only a Cluster's may have closed ones.
	every := all || path.State() == breaker.Closed
	if !every && path.Cluster() == nil {
		return
	}
	type charge struct {
		debtKey
		*debt
		rkey string
	}
	var due []charge
	b.mu.Lock()
	for k, d := range b.owed {
		if !all && len(due) == debtsPerRound {
			break
		}
		c := charge{debtKey: k, debt: d}
		if !every {
			if c.rkey = k.namer.Key(k.key); path.Route(c.rkey).State() != breaker.Closed {
				continue
			}
		}
		due = append(due, c)
		delete(b.owed, k)
	}
	b.size.Store(int64(len(b.owed)))
	b.mu.Unlock()
	for _, c := range due {
		if c.rkey == "" {
			c.rkey = c.namer.Key(c.key)
		}
		// Since 0: the server's clock at the admissions is unknown, and the
		// charge is made whatever Reset came before (see
		// authority.Refund.Since): admitted after the Reset, those tokens are
		// the fresh bucket's, and one before it is charged to it too
		// (under-admission, never over).
		q.add(q.adjustment(c.rkey, c.limit, -c.tokens, c.window, 0))
	}
}

// owe charges key's bucket under every limit of l n tokens that the
// failure policy admitted at wall, a reading of the Client's clock (see
// debtBook).
func (l *Limiter) owe(key string, n int64, wall time.Time) {
	at := l.server.at(wall) // a quota's window is Redis's, not this instance's
	for _, m := range l.members {
		l.debts.owe(m.namer, key, m.limit, n, at)
	}
}

// dues returns, for each of ms, the tokens this instance owes key's bucket
// that the janitor has not yet taken to charge: 0 for a calendar quota's
// bucket (a charge goes to its window, whose end a denial names whatever
// the charge). One lock for all of them: a denial asks while debts exist.
func (b *debtBook) dues(ms []*member, key string) (owed [MaxLimits]int64, found bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, m := range ms {
		if d, ok := b.owed[debtKey{namer: m.namer, key: key}]; ok {
			owed[i], found = d.tokens, true
		}
	}
	return owed, found
}
