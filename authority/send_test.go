package authority

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
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
