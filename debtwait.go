package leaselimit

import (
	"math"
	"math/bits"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
)

// How a denial reads while this instance owes its buckets what a failure
// policy admitted (see debtBook): as they will stand once charged.

// charged returns g, Redis's denial of need tokens of key's buckets (ms:
// Key's, then With's), as the buckets will stand once this instance's
// debts of them are charged. The first answers after an outage come before
// the charge (the breaker's probes are decisions' own calls): without
// this, a denial said how long until the bucket before the charge held
// need, and a lease's negative cache kept saying it (a cached 3 s where
// Redis said 32 s once charged). A grant is left as it is: what it took
// is Redis's, and the debt follows it.
//
// A wait is never made longer than the charge makes it, since a lease
// denies locally until then: for the bucket that denied, the debt's refill
// time is added to Redis's wait, as far as the script's floor (one Burst
// in debt) lets the charge count; for another of several, its wait is
// estimated from its whole tokens, at most one token's time short; the
// longest is the call's. A debt the janitor has taken to charge is no
// longer counted: a denial Redis makes while that charge is on its way
// says the wait before it (the next one, after, says the charged wait).
// The probe that closes the breaker races the janitor so: woken by the
// closing, it may take the debt before the probe's denial asks.
func (b *debtBook) charged(ms []*member, key string, need int64, g authority.Grant) authority.Grant {
	if g.Granted > 0 || b.size.Load() == 0 {
		return g
	}
	multi := g.Multi != nil && len(g.Multi.Parts) == len(ms)
	if !multi {
		ms = ms[:1]
	}
	owed, found := b.dues(ms, key)
	if !found {
		return g
	}
	var parts []authority.Part
	if multi {
		parts = append([]authority.Part(nil), g.Multi.Parts...)
	} else {
		parts = []authority.Part{{Remaining: g.Remaining, ResetAfter: g.ResetAfter}}
	}
	said, wait := g.RetryAfter, g.RetryAfter // Redis's wait: the denying bucket's
	for i, m := range ms {
		d, p, burst := owed[i], &parts[i], m.limit.Burst
		if d <= 0 {
			continue
		}
		if !multi || i == g.Multi.Denied {
			// Redis's wait says how many whole tokens the bucket holds,
			// in debt too (Remaining is then 0), and so how much of d
			// the script's floor lets count.
			held := need - tokensWithin(m.limit, said)
			d = min(d, max(held+burst, 0))
			wait = max(wait, addWait(said, m.limit.Interval(d)))
		} else {
			// Another bucket: until it holds need after the charge, from
			// its whole tokens (a fraction of one may be there too).
			d = min(d, p.Remaining+burst)
			if short := need - (p.Remaining - d) - 1; short > 0 {
				wait = max(wait, m.limit.Interval(short))
			}
		}
		p.Remaining = max(p.Remaining-d, 0)
		p.ResetAfter = min(addWait(p.ResetAfter, m.limit.Interval(d)), m.limit.Interval(2*burst))
	}
	g.RetryAfter = wait
	g.Remaining, g.ResetAfter = parts[0].Remaining, parts[0].ResetAfter
	for _, p := range parts[1:] {
		g.Remaining, g.ResetAfter = min(g.Remaining, p.Remaining), max(g.ResetAfter, p.ResetAfter)
	}
	if multi {
		g.Multi = &authority.Multi{Denied: g.Multi.Denied, Parts: parts}
	}
	return g
}

// tokensWithin returns how many tokens limit's bucket gains within wait,
// rounded up (wait to a whole microsecond, up), exactly: the tokens a
// bucket lacks when Redis says wait. It saturates at math.MaxInt64.
func tokensWithin(limit policy.Limit, wait time.Duration) int64 {
	if wait <= 0 || limit.Rate <= 0 || limit.PeriodMicros() <= 0 {
		return 0
	}
	us := uint64(wait / time.Microsecond)
	if wait%time.Microsecond != 0 {
		us++
	}
	per := uint64(limit.PeriodMicros())
	hi, lo := bits.Mul64(us, uint64(limit.Rate))
	if hi >= per {
		return math.MaxInt64
	}
	q, rem := bits.Div64(hi, lo, per)
	if rem > 0 {
		q++
	}
	return int64(min(q, math.MaxInt64))
}

// addWait is a + b, saturating.
func addWait(a, b time.Duration) time.Duration {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}
