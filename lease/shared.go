package lease

import (
	"sync"

	"github.com/leaselimit/leaselimit/policy"
)

// Table is the key table that the Leases of one engine share: one bound
// (MaxKeys) on the keys of every limit, one eviction hand, one sweep.
type Table struct {
	t    *table
	idle int64 // an unused key is forgotten after this long
	// swept is the storage of Sweep's returns, reused by the next Sweep
	// (the janitor's, every quarter of a lease's life: grown afresh each
	// time, it was a few percent of the bytes a lease decision allocates
	// on the comparison's cold long tail). sweeping orders the sweeps.
	sweeping sync.Mutex
	swept    []Return
}

// NewTable returns a table of at most about maxKeys keys, whatever their
// limits, with lease settings s (defaults applied; s.IdleTTL is how long an
// unused key is kept).
func NewTable(maxKeys int, s policy.Lease) *Table {
	return &Table{t: newTable(maxKeys), idle: int64(s.WithDefaults().IdleTTL)}
}

// Sweep expires leases and forgets keys idle since before now-IdleTTL,
// and hands give the tokens to give back, each to the bucket of its limit
// (give may be nil). The slice is the table's, reused by the next Sweep:
// give must not keep it. Sweeps are serialized: give runs before the next
// one starts.
func (t *Table) Sweep(now int64, give func([]Return)) {
	t.sweeping.Lock()
	defer t.sweeping.Unlock()
	out := t.swept[:0]
	t.t.Sweep(now, t.idle, func(e *entry, h held) { out = append(out, e.back(h)) })
	if give != nil && len(out) > 0 {
		give(out)
	}
	clear(out) // no strings or limits kept alive until the next sweep
	if cap(out) > maxSweptKept && len(out) < cap(out)/4 {
		out = nil // a burst of expiries long past: its storage goes
	}
	t.swept = out
}

// maxSweptKept is the capacity of Sweep's storage kept however little of it
// the last sweep used.
const maxSweptKept = 4096

// Drain forgets every key and returns the tokens of every lease (for
// Close).
func (t *Table) Drain() []Return {
	var out []Return
	t.t.Drain(func(e *entry, h held) { out = append(out, e.back(h)) })
	return out
}

// OutageOver tells that Redis answers again: the FailLocal buckets the
// table forgot during the outage no longer make new ones start empty (a
// spent bucket evicted later, by ordinary churn, emptied every new key's
// share in the next outage, up to a period later).
func (t *Table) OutageOver() { t.t.outages.Add(1) }

// Full returns how many new keys the table, its shard full, took in by
// evicting a key, and how many it declined: decided exactly while the key
// to evict held a live lease (ratelimit.keys.full). Both grow when the
// keys that repeat within a lease's life outnumber the table's bound.
func (t *Table) Full() (evicted, declined uint64) { return t.t.Full() }

// Len returns how many keys have local state, over every limit.
func (t *Table) Len() int { return t.t.Len() }

// back returns tokens taken out of e as a Return to the bucket of e's
// limit, with their stamps.
func (e *entry) back(h held) Return {
	r := Return{Key: e.key, Tokens: h.tokens, Since: h.since, Window: h.window, Fresh: h.fresh, FreshSince: h.freshSince}
	if e.owner != nil {
		r.Limit, r.Limits, r.Windows = e.owner.limit, e.owner.members, h.windows
	}
	return r
}
