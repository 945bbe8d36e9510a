package lease

import (
	"testing"
	"time"

	"go.uber.org/goleak"

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
func grantAll(req Request, remaining int64) Outcome {
	return Outcome{Granted: req.Want, Remaining: remaining, Min: req.Min}
}

// plan calls z.Plan and checks the invariants every Request must keep.
func plan(t testing.TB, z Sizer, e *Entry, now int64) Request {
	t.Helper()
	req := z.Plan(e, now)
	if req.Min < 1 || req.Min > req.Want {
		t.Fatalf("Plan at %d = %+v: want 1 <= Min <= Want", now, req)
	}
	if req.Want > z.limit.Burst {
		t.Fatalf("Plan at %d = %+v: Want exceeds Burst %d", now, req, z.limit.Burst)
	}
	return req
}

// serve decides one request for n tokens of e at now the way the root
// package does, against an authority that grants everything: lease hit
// (with prefetch), else one refill with the request pending, then take.
// It reports whether the request was admitted and whether it was served
// from the existing lease.
func serve(t testing.TB, z Sizer, e *Entry, n, now int64) (ok, hit bool) {
	t.Helper()
	return serveR(t, z, e, n, now, bigRemaining)
}

// serveR is serve against an authority that reports remaining tokens left
// after each grant (slow start only grows leases when that is large).
func serveR(t testing.TB, z Sizer, e *Entry, n, now, remaining int64) (ok, hit bool) {
	t.Helper()
	if ok, left := e.Take(n, now); ok {
		if e.NeedsPrefetch(left) {
			req := plan(t, z, e, now)
			if back := z.Install(e, req, grantAll(req, remaining), now); back != 0 {
				t.Fatalf("Install refunded %d on a live entry", back)
			}
			e.PrefetchDone()
		}
		return true, true
	}
	if d, _ := e.Denied(now); d {
		return false, false
	}
	e.AddPending(n)
	req := plan(t, z, e, now)
	if back := z.Install(e, req, grantAll(req, remaining), now); back != 0 {
		t.Fatalf("Install refunded %d on a live entry", back)
	}
	if e.TakeReserved(n) {
		return true, false
	}
	ok, _ = e.Take(n, now)
	return ok, false
}

// drive serves steady demand of one token every step from start for count
// requests and returns the time after the last one.
func drive(t testing.TB, z Sizer, e *Entry, start, step int64, count int) int64 {
	t.Helper()
	return driveR(t, z, e, start, step, count, bigRemaining)
}

// driveR is drive against an authority that reports remaining tokens left.
func driveR(t testing.TB, z Sizer, e *Entry, start, step int64, count int, remaining int64) int64 {
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

func newSizer(l policy.Limit, s policy.Lease) Sizer {
	if err := l.Validate(); err != nil {
		panic(err)
	}
	if err := s.Validate(); err != nil {
		panic(err)
	}
	return NewSizer(l, s)
}
