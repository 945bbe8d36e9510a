package redispath

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/policy"
)

// isDone reports whether ch is closed.
func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestBudgetCtx: a call's context ends once, with the error and cause of
// what ended it first: its deadline (the budget's end or the parent's
// earlier one), a parent that had ended, or its release.
func TestBudgetCtx(t *testing.T) {
	end := time.Now().Add(time.Hour)

	c := newBudgetCtx(context.WithValue(context.Background(), t, "v"), end)
	if d, ok := c.Deadline(); !ok || !d.Equal(end) {
		t.Errorf("Deadline = %v, %v; want the budget's end %v", d, ok, end)
	}
	if c.Err() != nil || isDone(c.Done()) || c.Value(t) != "v" {
		t.Fatalf("a new context: Err %v, done %v, value %v", c.Err(), isDone(c.Done()), c.Value(t))
	}
	c.expire()
	c.release() // after its deadline: changes nothing
	if !isDone(c.Done()) || !errors.Is(c.Err(), context.DeadlineExceeded) || !c.budgetEnded() {
		t.Errorf("expired: done %v, Err %v, budget ended %v; want done, DeadlineExceeded, true", isDone(c.Done()), c.Err(), c.budgetEnded())
	}

	// The parent's deadline comes first: the context ends there, and not
	// by the budget.
	soon := time.Now().Add(time.Minute)
	parent, cancel := context.WithDeadline(context.Background(), soon)
	defer cancel()
	c = newBudgetCtx(parent, end)
	if d, _ := c.Deadline(); !d.Equal(soon) {
		t.Errorf("Deadline = %v; want the parent's %v", d, soon)
	}
	c.expire()
	if !errors.Is(c.Err(), context.DeadlineExceeded) || c.budgetEnded() {
		t.Errorf("expired at the parent's deadline: Err %v, budget ended %v; want DeadlineExceeded, false", c.Err(), c.budgetEnded())
	}

	// A parent that has ended ends the context at once, with its error.
	cancelled, cancel2 := context.WithCancel(context.Background())
	cancel2()
	c = newBudgetCtx(cancelled, end)
	if !isDone(c.Done()) || !errors.Is(c.Err(), context.Canceled) || c.budgetEnded() {
		t.Errorf("from a cancelled parent: done %v, Err %v, budget ended %v", isDone(c.Done()), c.Err(), c.budgetEnded())
	}

	// Released before its deadline: as a cancel func leaves a context.
	c = newBudgetCtx(context.Background(), end)
	c.release()
	c.expire()
	if !isDone(c.Done()) || !errors.Is(c.Err(), context.Canceled) || c.budgetEnded() {
		t.Errorf("released: done %v, Err %v, budget ended %v", isDone(c.Done()), c.Err(), c.budgetEnded())
	}
}

// TestBudgetCtxAllocatesOnce: a call's context is one allocation when no
// one asks for its Done (go-redis asks only to wait for a connection or a
// dial), as it is made for every call made in place; one asked for is
// made then, and closed at the end.
func TestBudgetCtxAllocatesOnce(t *testing.T) {
	end := time.Now().Add(time.Hour)
	parent := context.Background()
	if n := testing.AllocsPerRun(100, func() { newBudgetCtx(parent, end).release() }); n != 1 {
		t.Errorf("%.1f allocations per context, want 1", n)
	}
	c := newBudgetCtx(parent, end)
	done := c.Done()
	if c.Done() != done || isDone(done) {
		t.Fatal("Done: a second channel, or closed before the end")
	}
	c.release()
	if !isDone(done) {
		t.Error("the Done asked for before the end is not closed by it")
	}
}

// doneHook holds every acquire script call until its context ends, as
// go-redis's wait for a pooled connection or a dial does, and returns the
// context's error.
type doneHook struct{}

func (doneHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (doneHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (doneHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() != "evalsha" {
			return next(ctx, cmd)
		}
		select {
		case <-ctx.Done():
			cmd.SetErr(ctx.Err())
			return ctx.Err()
		case <-time.After(10 * time.Second):
			return next(ctx, cmd)
		}
	}
}

// TestSendAloneEndsItsBudget: a call sent alone whose context waits on Done
// (a wait for a connection) is ended by the lane's watchdog at its deadline,
// the budget's end or its parent's earlier deadline, with no timer of its
// own, whether its witness is asked before the deadline (the watchdog is
// armed again for it) or would be after (armed for the deadline).
func TestSendAloneEndsItsBudget(t *testing.T) {
	_, c := newMini(t, nil)
	c.AddHook(doneHook{})
	auth, err := authority.New(c, "leaselimit")
	if err != nil {
		t.Fatal(err)
	}
	ln := newLane(auth, circuit.New("test", circuit.Settings{}), 4, time.Second, recorder.Endpoint{}, nil)
	defer ln.stop()
	l := policy.PerSecond(10)

	for _, tc := range []struct {
		name        string
		parent      time.Duration // the parent's deadline from now, if any
		budget      time.Duration
		askAt       time.Duration // when the witness is asked, from now
		budgetEnded bool
	}{
		// The watchdog fires at the ask, then again at the deadline.
		{"the budget's end, after the ask", 0, 40 * time.Millisecond, 20 * time.Millisecond, true},
		// Armed for the earlier of the two: the parent's deadline.
		{"the parent's deadline, before the ask", 30 * time.Millisecond, time.Hour, time.Hour - time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parent := context.Background()
			if tc.parent > 0 {
				var cancel context.CancelFunc
				parent, cancel = context.WithTimeout(context.Background(), tc.parent)
				defer cancel()
			}
			if !ln.claim() {
				t.Fatal("an idle lane refused its pipeline")
			}
			start := time.Now()
			bctx := newBudgetCtx(parent, start.Add(tc.budget))
			one := &aloneSend{c: Call{Acq: authority.Acquisition{Key: auth.Key(l, "k"), Limit: l, Want: 1, Min: 1, Share: 1}}}
			a := &one.c.Acq
			ln.sendAlone(bctx, bctx, one, start.Add(tc.askAt))
			took := time.Since(start)
			if !errors.Is(a.Err, context.DeadlineExceeded) {
				t.Fatalf("the call's error %v; want its context's DeadlineExceeded", a.Err)
			}
			if took > 2*time.Second { // the hook's own wait is 10s
				t.Errorf("the call ended after %v; its deadline was at most 40ms away", took)
			}
			if got := bctx.budgetEnded(); got != tc.budgetEnded {
				t.Errorf("budgetEnded = %v; want %v", got, tc.budgetEnded)
			}
			bctx.release()
		})
	}
}

// TestCallerEndedByTheBudget: a call whose caller cancelled its ctx and
// whose read the socket's deadline, the budget's end, then cut is Redis's
// failure, whether or not the watchdog has come yet; a call that failed
// before the budget's end is the caller's.
func TestCallerEndedByTheBudget(t *testing.T) {
	cut := errors.New("i/o timeout")
	parent, cancel := context.WithCancel(context.Background())
	ended := newBudgetCtx(parent, time.Now().Add(-time.Millisecond)) // its deadline passed, not yet expired
	running := newBudgetCtx(parent, time.Now().Add(time.Hour))
	cancel()
	if callerEnded(parent, ended, cut) {
		t.Error("a call cut at the budget's end, its caller cancelled, taken for the caller's")
	}
	ended.expire()
	if callerEnded(parent, ended, cut) {
		t.Error("a call cut at the budget's end and expired, its caller cancelled, taken for the caller's")
	}
	if !callerEnded(parent, running, cut) {
		t.Error("a call failed before the budget's end, its caller cancelled, taken for Redis's")
	}
	if callerEnded(context.Background(), running, cut) {
		t.Error("a call failed with its caller still there taken for the caller's")
	}
}
