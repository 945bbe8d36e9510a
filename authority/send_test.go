package authority

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// isEvalSha matches a request chunk that runs a script by its SHA.
func isEvalSha(chunk []byte) bool {
	return bytes.Contains(bytes.ToLower(chunk), []byte("evalsha"))
}

// TestClientTimeoutResent: a reply the client gave up on (its ReadTimeout,
// far below the caller's deadline, and MaxRetries -1) is had by sending
// the call again under its id, and Redis takes once: for a batch, a
// multi-limit call and an adjustment, on clients with and without
// ContextTimeoutEnabled. Without the resend each came back as an i/o
// timeout, which the Limiter counts against Redis: a review saw the
// breaker open while Redis answered, and FailOpen admit 21-71 times the
// bound.
func TestClientTimeoutResent(t *testing.T) {
	srv := redistest.Start(t)
	l := policy.Limit{Name: "resent", Rate: 1, Period: time.Hour, Burst: 10}
	for _, cte := range []bool{false, true} {
		t.Run(fmt.Sprint("ContextTimeoutEnabled=", cte), func(t *testing.T) {
			px := redistest.NewProxy(t, srv.Addr)
			c := redis.NewClient(&redis.Options{Addr: px.Addr, ReadTimeout: 50 * time.Millisecond, MaxRetries: -1, ContextTimeoutEnabled: cte})
			t.Cleanup(func() { _ = c.Close() })
			r, err := New(c, testPrefix+fmt.Sprint(cte))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			key, other := r.Key(l, "k"), r.Key(l, "other")
			if _, err := r.Acquire(ctx, key, l, 1, 1, 1); err != nil { // the script cached
				t.Fatal(err)
			}
			remaining := func(k string) int64 {
				t.Helper()
				b, err := r.Peek(ctx, k, l)
				if err != nil {
					t.Fatal(err)
				}
				return b.Tokens
			}
			held := func(what string, call func() error) {
				t.Helper()
				px.HoldReplies(isEvalSha)
				defer px.ReleaseReplies()
				if err := call(); err != nil {
					t.Fatalf("%s with its first reply held past the client's ReadTimeout: %v; want the resent call's reply", what, err)
				}
			}

			held("a batch", func() error {
				as := []*Acquisition{{Key: key, Limit: l, Want: 2, Min: 2, Share: 1}, {Key: key, Limit: l, Want: 3, Min: 3, Share: 1}}
				r.AcquireAll(ctx, as)
				return errors.Join(as[0].Err, as[1].Err)
			})
			if got := remaining(key); got != 4 {
				t.Fatalf("after a batch of 2 and 3: %d left of 9; want 4, taken once", got)
			}
			held("a multi-limit call", func() error {
				_, err := r.Acquire(ctx, key, l, 1, 1, 1) // warm the connection pool's replacement
				if err != nil {
					return err
				}
				a := &Acquisition{Key: key, Limit: l, Want: 1, Min: 1, Share: 1, With: []Member{{Key: other, Limit: l}}}
				r.AcquireAll(ctx, []*Acquisition{a})
				return a.Err
			})
			if got, gotOther := remaining(key), remaining(other); got != 2 || gotOther != 9 {
				t.Fatalf("after 1 and a multi-limit 1: %d and %d left; want 2 and 9, taken once", got, gotOther)
			}
			held("an adjustment", func() error {
				return errors.Join(failedErrs(r.RefundAll(ctx, []Refund{{Key: key, Limit: l, Tokens: 3}}))...)
			})
			if got := remaining(key); got != 5 {
				t.Fatalf("after a refund of 3: %d left; want 5, refunded once", got)
			}
		})
	}
}

// failedErrs returns the errors of failed adjustments.
func failedErrs(failed []Failed) []error {
	var errs []error
	for _, f := range failed {
		errs = append(errs, f.Err)
	}
	return errs
}

// TestDeadlineCutIsContextError: on a client that sets ctx's deadline on
// its reads (ContextTimeoutEnabled), a call the deadline cut reports ctx's
// error, whatever the socket said (go-redis: "i/o timeout"), for a batch
// and for a single script call, and the socket's error stays in the chain.
// Callers tell the end of their time budget by it: as a bare i/o timeout,
// a call cut at the budget while the process was behind its scheduler
// counted against Redis without the checks that tell the two apart.
func TestDeadlineCutIsContextError(t *testing.T) {
	srv := redistest.Start(t)
	px := redistest.NewProxy(t, srv.Addr)
	c := redis.NewClient(&redis.Options{Addr: px.Addr, MaxRetries: -1, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	r, err := New(c, testPrefix)
	if err != nil {
		t.Fatal(err)
	}
	l := policy.PerSecond(10)
	key := r.Key(l, "k")
	if _, err := r.Acquire(context.Background(), key, l, 1, 1, 1); err != nil {
		t.Fatal(err)
	}
	px.Blackhole(true)
	for name, call := range map[string]func(context.Context) error{
		"batch": func(ctx context.Context) error { _, err := r.Acquire(ctx, key, l, 1, 1, 1); return err },
		"peek":  func(ctx context.Context) error { _, err := r.Peek(ctx, key, l); return err },
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		err := call(ctx)
		cancel()
		var ne net.Error
		if !errors.Is(err, context.DeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
			t.Errorf("%s cut by its ctx's deadline: %v; want context.DeadlineExceeded wrapping the client's timeout", name, err)
		}
	}
}

// tokensIn returns a function that peeks at a bucket of r: its whole
// tokens.
func tokensIn(t *testing.T, r *Redis) func(key string, l policy.Limit) int64 {
	return func(key string, l policy.Limit) int64 {
		t.Helper()
		b, err := r.Peek(context.Background(), key, l)
		if err != nil {
			t.Fatal(err)
		}
		return b.Tokens
	}
}

// cutAfterFirst is a go-redis hook that, once armed, lets only the first
// command of the next pipeline of several reach Redis and then fails the
// pipeline as go-redis v9 does when a connection breaks after Redis
// answered its first command and the retries cannot reconnect: the
// commands after it fail with the broken connection's EOF, and the last
// attempt's error (a refused dial) is given to every command that had
// none, the answered one too, whose reply stays readable. (Seen with a
// server that answers a pipeline's first command, then closes the
// connection and stops listening.)
type cutAfterFirst struct{ armed atomic.Bool }

func (h *cutAfterFirst) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *cutAfterFirst) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h *cutAfterFirst) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) < 2 || !h.armed.CompareAndSwap(true, false) {
			return next(ctx, cmds)
		}
		if err := next(ctx, cmds[:1]); err != nil {
			return err
		}
		for _, c := range cmds[1:] {
			c.SetErr(io.EOF)
		}
		refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
		for _, c := range cmds {
			if c.Err() == nil {
				c.SetErr(refused)
			}
		}
		return refused
	}
}

// TestPipelineCutAfterItsFirstReply: a call whose reply was read before its
// pipeline failed (see cutAfterFirst) is answered, not failed: a
// multi-limit acquire keeps its grant, taken once, and an adjustment is not
// reported for sending again; the call after it fails and took nothing.
// Before, both came back with the refused dial: the grant was lost (taken
// from the bucket, never used, and what the failure policy admitted in its
// place charged again), an under-admission the fleet ledger saw in rounds
// of refused connections.
func TestPipelineCutAfterItsFirstReply(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	cut := &cutAfterFirst{}
	c.AddHook(cut)
	r, err := New(c, testPrefix+"cut")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	l := policy.Limit{Name: "cut", Rate: 1, Period: time.Hour, Burst: 10}
	m := policy.Limit{Name: "cut-m", Rate: 1, Period: time.Hour, Burst: 20}
	remaining := tokensIn(t, r)
	k1, k2 := r.Key(l, "k1"), r.Key(l, "k2")
	m1, m2 := r.Key(m, "k1"), r.Key(m, "k2")
	for _, k := range []string{k1, k2} { // a token taken of each
		if _, err := r.Acquire(ctx, k, l, 1, 1, 1); err != nil {
			t.Fatal(err)
		}
	}
	// The multi-limit and refund scripts cached by calls of their own (a
	// pipeline answered NOSCRIPT goes again whole).
	w := &Acquisition{Key: r.Key(l, "w"), Limit: l, Want: 1, Min: 1, Share: 1, With: []Member{{Key: r.Key(m, "w"), Limit: m}}}
	r.AcquireAll(ctx, []*Acquisition{w})
	if w.Err != nil {
		t.Fatal(w.Err)
	}
	if failed := r.RefundAll(ctx, []Refund{{Key: r.Key(l, "w"), Limit: l, Tokens: 1}}); len(failed) != 0 {
		t.Fatal(failed[0].Err)
	}

	cut.armed.Store(true)
	as := []*Acquisition{
		{Key: k1, Limit: l, Want: 3, Min: 3, Share: 1, With: []Member{{Key: m1, Limit: m}}},
		{Key: k2, Limit: l, Want: 4, Min: 4, Share: 1, With: []Member{{Key: m2, Limit: m}}},
	}
	r.AcquireAll(ctx, as)
	if cut.armed.Load() {
		t.Fatal("the two multi-limit calls did not go in one pipeline")
	}
	if as[0].Err != nil || as[0].Grant.Granted != 3 {
		t.Errorf("the call Redis answered before its pipeline failed: granted %d, %v; want 3 and no error", as[0].Grant.Granted, as[0].Err)
	}
	if as[1].Err == nil {
		t.Errorf("the call that never reached Redis: granted %d and no error; want the pipeline's error", as[1].Grant.Granted)
	}
	if a, b, c, d := remaining(k1, l), remaining(m1, m), remaining(k2, l), remaining(m2, m); a != 6 || b != 17 || c != 9 || d != 20 {
		t.Errorf("buckets after the cut pipeline: %d, %d, %d, %d; want 6 and 17 (taken once), 9 and 20 (untouched)", a, b, c, d)
	}

	// A script call applies up to maxPerScript adjustments: k1's and
	// those of maxPerScript-1 more keys fill the first, k2's goes in a
	// second.
	rfs := []Refund{{Key: k1, Limit: l, Tokens: 2}}
	for i := range maxPerScript - 1 {
		k := r.Key(l, fmt.Sprint("more", i))
		if _, err := r.Acquire(ctx, k, l, 1, 1, 1); err != nil {
			t.Fatal(err)
		}
		rfs = append(rfs, Refund{Key: k, Limit: l, Tokens: 1})
	}
	rfs = append(rfs, Refund{Key: k2, Limit: l, Tokens: 1})
	cut.armed.Store(true)
	failed := r.RefundAll(ctx, rfs)
	if cut.armed.Load() {
		t.Fatal("the two script calls of adjustments did not go in one pipeline")
	}
	if len(failed) != 1 || failed[0].Key != k2 || failed[0].Call == "" {
		t.Fatalf("adjustments of a cut pipeline reported failed: %+v; want the second call's only, with its call's id", failed)
	}
	if again := r.RefundAll(ctx, []Refund{failed[0].Refund}); len(again) != 0 {
		t.Fatalf("the failed adjustment sent again: %+v", again)
	}
	if a, b := remaining(k1, l), remaining(k2, l); a != 8 || b != 10 {
		t.Errorf("buckets after the refunds: %d and %d; want 8 and 10, each applied once", a, b)
	}
	for _, rf := range rfs[1 : len(rfs)-1] {
		if got := remaining(rf.Key, l); got != 10 {
			t.Errorf("bucket %s after its refund in the first call: %d; want 10", rf.Key, got)
		}
	}
}

// TestResend: the calls of one invocation sent again under its first
// sending's resend key (see Resend) get the first's outcome when that
// granted, taken once, whether or not the client saw the reply; when the
// first denied them, they are decided anew, and the resend's reply is kept
// even for a denial, so that the first, should it run later, takes
// nothing. For a single-limit call, a multi-limit one, and a batch of
// three calls on two keys. Calls that are not one whole invocation are not
// sent again.
func TestResend(t *testing.T) {
	srv := redistest.Start(t)
	px := redistest.NewProxy(t, srv.Addr)
	c := redis.NewClient(&redis.Options{Addr: px.Addr, ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	r, err := New(c, testPrefix+"resend")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	l := policy.Limit{Name: "resend", Rate: 1, Period: time.Hour, Burst: 10}
	m := policy.Limit{Name: "resend-m", Rate: 1, Period: time.Hour, Burst: 20}
	remaining := tokensIn(t, r)
	// sendHeld makes as, the proxy holding their replies past their
	// deadline: Redis runs them, the client never sees it.
	sendHeld := func(as ...*Acquisition) {
		px.HoldReplies(isEvalSha)
		defer px.ReleaseReplies()
		cut, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		r.AcquireAll(cut, as)
	}
	for _, multi := range []bool{false, true} {
		t.Run(fmt.Sprint("multi=", multi), func(t *testing.T) {
			k, km := r.Key(l, fmt.Sprint("k", multi)), r.Key(m, fmt.Sprint("k", multi))
			acq := func(want int64) *Acquisition {
				a := &Acquisition{Key: k, Limit: l, Want: want, Min: want, Share: 1}
				if multi {
					a.With = []Member{{Key: km, Limit: m}}
				}
				return a
			}
			// The first sending's reply held past its deadline: Redis ran it.
			a := acq(3)
			r.AcquireAll(ctx, []*Acquisition{acq(1)}) // the scripts cached, a connection made
			sendHeld(a)
			if a.Err == nil {
				t.Fatalf("a call whose reply was held past its deadline: granted %d, no error", a.Grant.Granted)
			}
			if !r.Resend(ctx, []*Acquisition{a}) {
				t.Fatal("Resend of a whole invocation = false")
			}
			if a.Err != nil || a.Grant.Granted != 3 {
				t.Fatalf("resent: granted %d, %v; want the first's 3", a.Grant.Granted, a.Err)
			}
			if got := remaining(k, l); got != 6 {
				t.Fatalf("after 1, then 3 sent twice: %d left of 10; want 6, taken once", got)
			}
			if multi {
				if got := remaining(km, m); got != 16 {
					t.Fatalf("the multi-limit's second bucket: %d left of 20; want 16, taken once", got)
				}
			}
			// A first sending that denied: sent again, decided anew.
			d := acq(7)
			r.AcquireAll(ctx, []*Acquisition{d})
			if d.Err != nil || d.Grant.Granted != 0 {
				t.Fatalf("7 of 6: granted %d, %v; want a denial", d.Grant.Granted, d.Err)
			}
			if failed := r.RefundAll(ctx, []Refund{{Key: k, Limit: l, Tokens: 1}}); len(failed) != 0 {
				t.Fatal(failed[0].Err)
			}
			if !r.Resend(ctx, []*Acquisition{d}) || d.Err != nil || d.Grant.Granted != 7 {
				t.Fatalf("7 of 7 resent: granted %d, %v; want 7, decided anew", d.Grant.Granted, d.Err)
			}
			if got := remaining(k, l); got != 0 {
				t.Fatalf("after the resent 7: %d left; want 0", got)
			}
			// A resend that denies keeps its reply: sent again (as the
			// first sending running late would be), it takes nothing
			// though the bucket could now serve it.
			e := acq(2)
			r.AcquireAll(ctx, []*Acquisition{e})
			if !r.Resend(ctx, []*Acquisition{e}) || e.Err != nil || e.Grant.Granted != 0 {
				t.Fatalf("2 of 0 resent: granted %d, %v; want a denial", e.Grant.Granted, e.Err)
			}
			if failed := r.RefundAll(ctx, []Refund{{Key: k, Limit: l, Tokens: 5}}); len(failed) != 0 {
				t.Fatal(failed[0].Err)
			}
			if !r.Resend(ctx, []*Acquisition{e}) || e.Err != nil || e.Grant.Granted != 0 {
				t.Fatalf("2 of 5 resent after a resend that denied: granted %d, %v; want the kept denial", e.Grant.Granted, e.Err)
			}
			if got := remaining(k, l); got != 5 {
				t.Fatalf("after the kept denial: %d left; want 5, nothing taken", got)
			}
		})
	}
	// A batch of three calls on two keys, its replies held: resent whole,
	// in the order AcquireAll had them, each call gets its first outcome.
	b1, b2 := r.Key(l, "b1"), r.Key(l, "b2")
	batch := func() []*Acquisition {
		return []*Acquisition{{Key: b1, Limit: l, Want: 4, Min: 4, Share: 1}, {Key: b2, Limit: l, Want: 3, Min: 3, Share: 1},
			{Key: b1, Limit: l, Want: 5, Min: 5, Share: 1}}
	}
	as := batch()
	sendHeld(as...)
	if as[0].Err == nil {
		t.Fatal("a batch whose reply was held past its deadline: no error")
	}
	if key, n := as[0].Invocation(); key == "" || n != 3 {
		t.Fatalf("the batch's invocation: %q of %d calls; want a resend key, 3", key, n)
	}
	if r.Resend(ctx, as[:2]) {
		t.Error("Resend of part of an invocation = true")
	}
	if !r.Resend(ctx, as) {
		t.Fatal("Resend of a whole batch = false")
	}
	for i, want := range []int64{4, 3, 5} {
		if as[i].Err != nil || as[i].Grant.Granted != want {
			t.Errorf("call %d of the resent batch: granted %d, %v; want %d", i, as[i].Grant.Granted, as[i].Err, want)
		}
	}
	if g1, g2 := remaining(b1, l), remaining(b2, l); g1 != 1 || g2 != 7 {
		t.Errorf("after the batch sent twice: %d and %d left; want 1 and 7, taken once", g1, g2)
	}
	if !r.Resend(ctx, as) || r.Resend(ctx, batch()) {
		t.Error("Resend: a whole invocation refused, or calls never sent accepted")
	}
}
