package redispath

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/redistest"
)

// lines is a go-redis logger that keeps what it is given.
type lines struct {
	mu  sync.Mutex
	got []string
}

func (l *lines) Printf(_ context.Context, format string, v ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, fmt.Sprintf(format, v...))
}

// stderrLogger is go-redis's own default, to put back.
type stderrLogger struct{ *log.Logger }

func (l stderrLogger) Printf(_ context.Context, format string, v ...any) {
	l.Logger.Printf(format, v...)
}

// TestWitnessIsQuiet: witness's own connection is made from
// the fields that reach the server, not a copy of the user's options,
// which share what the user's client set up: go-redis then logged that it
// could not register its maintenance-notification handlers, for every
// Client of a default go-redis client (and would panic where the user
// required them). It still reaches the server: it answers a PING.
func TestWitnessIsQuiet(t *testing.T) {
	got := &lines{}
	redis.SetLogger(got)
	t.Cleanup(func() { redis.SetLogger(stderrLogger{log.New(os.Stderr, "redis: ", log.LstdFlags|log.Lshortfile)}) })
	_, c := newMini(t, nil) // go-redis's defaults: RESP3
	h := newWitness(c, 100*time.Millisecond)
	defer h.close()
	if err := h.side.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("the side connection's PING: %v", err)
	}
	got.mu.Lock()
	defer got.mu.Unlock()
	for _, l := range got.got {
		if strings.Contains(l, "maintnotifications") || strings.Contains(l, "handler") {
			t.Errorf("go-redis logged, making the side connection: %s", l)
		}
	}
}

// TestWitnessAnswersOnceRedisIsBack: a witness whose dial failed while
// Redis was down says Redis answers as soon as it does again. go-redis's
// pool of one, handed the dial's error, answered every later call with it
// without dialing until its own retry a second later: for that second the
// calls the witness judged went to the failure policy while Redis
// answered. Nothing of the witness's outlives its close either (TestMain's
// goleak: go-redis's retry did, by up to a second).
func TestWitnessAnswersOnceRedisIsBack(t *testing.T) {
	m, c := newMini(t, nil)
	h := newWitness(c, 100*time.Millisecond)
	defer h.close()
	if !h.answers(nil) {
		t.Fatal("Redis up: the witness says it does not answer")
	}
	m.Close()
	h.okAt.Store(0)    // forget the answer seen, as if it were older than the wait
	for i := range 3 { // the first may fail on the pooled connection; the others dial
		if h.answers(nil) {
			t.Fatalf("Redis down: the witness says it answers (try %d)", i)
		}
	}
	if err := m.Restart(); err != nil {
		t.Fatal(err)
	}
	if !h.answers(nil) {
		t.Error("Redis back: the witness still says it does not answer (a dial error kept)")
	}
}

// TestWitnessAfterLostBytes: an ask whose request was lost with its
// connection's bytes (a blackhole: a flushed NAT entry, a middlebox that
// failed over) hangs until its life ends; once it has gone unanswered for
// the witness's wait, a new ask goes on a second connection, and Redis
// back answers it. With one connection, the new ask waited behind the lost
// one, and Redis back was taken for down for up to twice the budget.
func TestWitnessAfterLostBytes(t *testing.T) {
	m := miniredis.RunT(t)
	px := redistest.NewProxy(t, m.Addr())
	c := redis.NewClient(&redis.Options{Addr: px.Addr})
	t.Cleanup(func() { _ = c.Close() })
	h := newWitness(c, 200*time.Millisecond) // a wait of 100ms, a life of 400ms
	defer h.close()
	if !h.answers(nil) {
		t.Fatal("Redis up: the witness says it does not answer")
	}
	px.Blackhole(true)
	h.okAt.Store(0) // forget the answer seen, as if it were older than the wait
	if h.answers(nil) {
		t.Fatal("the proxy throwing bytes away: the witness says Redis answers")
	}
	px.Blackhole(false) // the first ask's request is lost; it hangs on
	if !h.answers(nil) {
		t.Error("Redis back: the witness says it does not answer (a new ask waited behind the lost one)")
	}
}

// TestRefusedConnection: the client's own error for a call it gave up on
// (no connection of the pool: its PoolTimeout, or MaxActiveConns reached;
// a reply its ReadTimeout cut) is this process's doing while Redis
// answers witness's own connection (ErrSaturated, which the breaker does
// not count), and Redis failing when it does not; other errors (a budget's
// deadline, a dial's timeout, a broken connection) are left as they are.
// A batch's calls are judged alike.
func TestRefusedConnection(t *testing.T) {
	m, c := newMini(t, &redis.Options{PoolSize: 1})
	h := newWitness(c, 100*time.Millisecond)
	defer h.close()
	timeout := fmt.Errorf("acquire: %w", redis.ErrPoolTimeout)
	readCut := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
	for _, err := range []error{timeout, redis.ErrPoolExhausted, readCut} {
		got := h.refused(err)
		if !errors.Is(got, ErrSaturated) || circuit.Counts(got) {
			t.Errorf("refused(%v) while Redis answers = %v (counts: %v); want ErrSaturated, not counted", err, got, circuit.Counts(got))
		}
	}
	budgetCut := fmt.Errorf("%w: %w", context.DeadlineExceeded, readCut) // as authority wraps a read the budget cut
	dialCut := &net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded}
	for _, err := range []error{nil, io.EOF, context.DeadlineExceeded, budgetCut, dialCut} {
		if got := h.refused(err); got != err {
			t.Errorf("refused(%v) = %v; want it unchanged", err, got)
		}
	}
	as := []*authority.Acquisition{{}, {}, {}}
	as[0].Err, as[2].Err = timeout, timeout
	refusedAll(as, func(string) *witness { return h })
	if !errors.Is(as[0].Err, ErrSaturated) || as[1].Err != nil || !errors.Is(as[2].Err, ErrSaturated) {
		t.Errorf("refusedAll: %v, %v, %v; want ErrSaturated, nil, ErrSaturated", as[0].Err, as[1].Err, as[2].Err)
	}
	var none *witness // a key without one (a Cluster's, before its slot map loaded): nothing to ask
	if got := none.refused(timeout); got != timeout {
		t.Errorf("refused without a witness = %v; want it unchanged", got)
	}
	m.Close() // Redis down: the pool's error is Redis failing
	h.okAt.Store(0)
	if got := h.refused(timeout); got != timeout || !circuit.Counts(got) {
		t.Errorf("refused(%v) with Redis down = %v; want it unchanged, counted", timeout, got)
	}
}

// TestWitnessAskedBeforeTheBudgetEnds: on a hung Redis (a proxy that
// forwards nothing), a call without a reply asks the witness half a
// budget (witnessWait) before its budget ends, so the verdict is known
// then: the call is blamed on Redis at its budget, not half a budget
// later. Both variants: in place (ContextTimeoutEnabled, the lane's
// watchdog asks) and carried by a sender (its waiter asks). Regression:
// the witness was asked at the budget's end and waited for up to half a
// budget, so the first calls of an outage took 1.5 budgets (a review:
// 150-162ms at a budget of 100ms).
func TestWitnessAskedBeforeTheBudgetEnds(t *testing.T) {
	const budget = 400 * time.Millisecond // an ask half a budget early is 200ms before its end: room for a slow machine
	for _, tc := range []struct {
		name string
		cte  bool
		do   bool // a peek, a reset or an adjustment (Do) rather than an acquire call
	}{
		{"acquire in place", true, false},
		{"acquire carried by a sender", false, false},
		{"Do in place", true, true},
	} {
		px, p, call := newProxiedPath(t, &redis.Options{ContextTimeoutEnabled: tc.cte}, budget, time.Hour)
		brk := p.Shared()
		if err := call("warm"); err != nil { // a connection, the script loaded; the witness has answered
			t.Fatal(err)
		}
		w := p.nodes.witnessOf(brk, "")
		px.Blackhole(true)
		start := time.Now()
		var err error
		if tc.do {
			_, err = p.Do(context.Background(), brk, "k", func(ctx context.Context) error {
				<-ctx.Done() // no reply on a hung Redis
				return ctx.Err()
			})
		} else {
			err = call("hung")
		}
		w.mu.Lock()
		var f *flight
		if n := len(w.flights); n > 0 {
			f = w.flights[n-1]
		}
		w.mu.Unlock()
		blamed := errors.Is(err, circuit.ErrBudget) // Do's error wraps the unavailable one instead
		if tc.do {
			blamed = errors.Is(err, p.unavailable)
		}
		if !blamed || errors.Is(err, ErrSaturated) {
			t.Errorf("%s: a call on a hung Redis = %v; want it blamed on Redis (ErrBudget)", tc.name, err)
		}
		switch {
		case f == nil:
			t.Errorf("%s: no ask of the witness in flight on a hung Redis", tc.name)
		case !f.began.Before(start.Add(budget)):
			t.Errorf("%s: the witness was asked %v after the call began; want before its budget (%v) ended",
				tc.name, f.began.Sub(start).Round(time.Millisecond), budget)
		}
		t.Logf("%s: blamed after %v (budget %v)", tc.name, time.Since(start).Round(time.Millisecond), budget)
	}
}

// TestWitnessAsksForAWrite: the witness's script is one Redis runs only
// where it takes writes: a master answers, a replica (READONLY) does not,
// so that a call go-redis retried on READONLY until its budget ended goes
// to the failure policy. miniredis, which reads no shebang, is asked the
// unflagged script and answers.
func TestWitnessAsksForAWrite(t *testing.T) {
	master := redistest.Start(t)
	replica := redistest.Start(t)
	host, port, _ := strings.Cut(master.Addr, ":")
	replica.Do(t, "REPLICAOF", host, port)
	for _, tc := range []struct {
		name string
		c    *redis.Client
		want bool
	}{{"master", master.Client(t), true}, {"replica", replica.Client(t), false}} {
		h := newWitness(tc.c, 100*time.Millisecond)
		if got := h.answers(nil); got != tc.want {
			t.Errorf("%s: witness answers = %v, want %v", tc.name, got, tc.want)
		}
		if h.unflagged.Load() {
			t.Errorf("%s: the witness fell back to the unflagged script on Redis 7", tc.name)
		}
		h.close()
	}
	_, c := newMini(t, nil)
	h := newWitness(c, 100*time.Millisecond)
	defer h.close()
	if !h.answers(nil) || !h.unflagged.Load() {
		t.Errorf("miniredis: answers = %v, unflagged = %v; want both (a server that reads no shebang)", h.answers(nil), h.unflagged.Load())
	}
}
