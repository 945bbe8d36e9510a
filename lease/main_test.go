package lease

import (
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// Fixed timestamps for step tables: nanoseconds since an arbitrary origin.
const (
	ms = int64(time.Millisecond)
	us = int64(time.Microsecond)
	s  = int64(time.Second)
)

// bigRemaining is what a healthy, nearly full authority bucket reports.
const bigRemaining = 1 << 40

// nearEmpty is what a bucket near its limit reports: too little for slow
// start, so leases follow measured demand alone.
const nearEmpty = 0

// grantAll is an authority with unlimited tokens: it grants every Want and
// reports remaining tokens left in the bucket.
func grantAll(req request, remaining int64) Outcome {
	return Outcome{Granted: req.Want, Remaining: remaining, Min: req.Min}
}

// plan calls z.Plan and checks the invariants every request must keep.
func plan(t testing.TB, z sizer, e *entry, now int64) request {
	t.Helper()
	req, _ := z.Plan(e, now)
	if req.Min < 1 || req.Min > req.Want {
		t.Fatalf("Plan at %d = %+v: want 1 <= Min <= Want", now, req)
	}
	if req.Want > z.limit.Burst {
		t.Fatalf("Plan at %d = %+v: Want exceeds Burst %d", now, req, z.limit.Burst)
	}
	return req
}

// serve decides one request for n tokens of e at now through the protocol
// (Leases), against an authority that grants everything: a lease hit (with
// its prefetch run at once), else one refill with the request joined, then
// collected. It reports whether the request was admitted and whether it
// was served from the existing lease.
func serve(t testing.TB, z sizer, e *entry, n, now int64) (ok, hit bool) {
	t.Helper()
	return serveR(t, z, e, n, now, bigRemaining)
}

// serveR is serve against an authority that reports remaining tokens left
// after each grant (slow start only grows leases when that is large).
func serveR(t testing.TB, z sizer, e *entry, n, now, remaining int64) (ok, hit bool) {
	t.Helper()
	ls := over(z, e)
	refill := func(tk Ticket) Outcome {
		r := ls.Plan(tk, now)
		checkRefill(t, z, r, now)
		o, back := ls.Complete(r, authority.Grant{Granted: r.Want, Remaining: remaining}, now)
		if len(back) != 0 {
			t.Fatalf("Complete returned %+v of a live entry", back)
		}
		return o
	}
	a := ls.Decide(e.key, n, now)
	switch a.Status {
	case Leased:
		if a.Prefetch {
			refill(a.Ticket)
			ls.Prefetched(a.Ticket)
		}
		return true, true
	case Cached:
		return false, false
	case Miss:
	default:
		t.Fatalf("Decide = %+v; want Leased, Cached or Miss", a)
	}
	ls.Join(a.Ticket)
	a = ls.Collect(a.Ticket, refill(a.Ticket), now)
	return a.Status == Granted, false
}

// protocols holds the protocol over each entry that serve has driven.
var protocols sync.Map // *entry → *Leases

// over returns the protocol around z that finds e by its key. e is only
// looked up there, never evicted or swept: it may belong to a table of a
// test, whose bookkeeping (its ring) is left alone.
func over(z sizer, e *entry) *Leases {
	if ls, ok := protocols.Load(e); ok {
		return ls.(*Leases)
	}
	ls := &Leases{table: newTable(minCapacity), limit: z.limit, local: z.limit, sizer: z,
		maxShare: z.settings.MaxShare}
	// Under e's owner's salt, which with the key names an entry (see
	// shard.find); e's own hash and chain are its table's, so it must
	// never be removed through ls (unlink would follow them).
	ls.salt = saltOf(e.owner)
	h := ls.table.keyHash(ls, e.key)
	ls.table.shardOf(h).m[h] = e
	protocols.Store(e, ls)
	return ls
}

// checkRefill checks the invariants every refill must keep.
func checkRefill(t testing.TB, z sizer, r Refill, now int64) {
	t.Helper()
	if r.Min < 1 || r.Min > r.Want {
		t.Fatalf("Plan at %d = %+v: want 1 <= Min <= Want", now, r)
	}
	if r.Want > z.limit.Burst {
		t.Fatalf("Plan at %d = %+v: Want exceeds Burst %d", now, r, z.limit.Burst)
	}
}

// drive serves steady demand of one token every step from start for count
// requests and returns the time after the last one.
func drive(t testing.TB, z sizer, e *entry, start, step int64, count int) int64 {
	t.Helper()
	return driveR(t, z, e, start, step, count, bigRemaining)
}

// driveR is drive against an authority that reports remaining tokens left.
func driveR(t testing.TB, z sizer, e *entry, start, step int64, count int, remaining int64) int64 {
	t.Helper()
	now := start
	for i := 0; i < count; i++ {
		if ok, _ := serveR(t, z, e, 1, now, remaining); !ok {
			t.Fatalf("request %d at %d denied by an authority that grants everything", i, now)
		}
		now += step
	}
	return now
}

func newSizer(l policy.Limit, s policy.Lease) sizer {
	if err := l.Validate(); err != nil {
		panic(err)
	}
	if err := s.Validate(); err != nil {
		panic(err)
	}
	return makeSizer(l, s)
}

// cached reports whether e's negative cache is set at now, and for how
// long (whatever the size of a request).
func cached(e *entry, now int64) (bool, time.Duration) {
	if d := e.denyUntil.Load(); now < d {
		return true, time.Duration(d - now)
	}
	return false, 0
}

// capacity returns the most entries t holds.
func capacity(t *table) int {
	n := 0
	for i := range t.shards {
		n += t.shards[i].max
	}
	return n
}
