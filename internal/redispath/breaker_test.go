package redispath

import (
	"context"
	"errors"
	"net"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// slowPath is a path to a miniredis behind a proxy that holds each chunk
// of data 300 ms, with a breaker that one failure opens for openFor, and
// a lane whose pipelines are both held by calls admitted while it was
// closed, with queued more calls waiting behind them.
type slowPath struct {
	p    *Path
	brk  *circuit.Breaker
	call func(i int) (authority.Grant, error)
	wg   sync.WaitGroup // the calls admitted while the breaker was closed
}

func newSlowPath(t *testing.T, openFor time.Duration, queued int) *slowPath {
	t.Helper()
	m := miniredis.RunT(t)
	px := redistest.NewProxy(t, m.Addr())
	c := redis.NewClient(&redis.Options{Addr: px.Addr})
	t.Cleanup(func() { _ = c.Close() })
	auth, tel := authAndTel(t, c, "slow")
	p := New(Config{Client: c, Auth: auth, Budget: 20 * time.Second, Name: "slow", Tel: tel,
		Breaker: circuit.Settings{Settings: breaker.Settings{Failures: 1, OpenFor: openFor}}})
	sp := &slowPath{p: p, brk: p.Shared()}
	t.Cleanup(func() { sp.wg.Wait(); p.Close(); p.Wait() })
	k := p.Caller(tel, nopReceiver{})
	l := policy.PerSecond(100)
	sp.call = func(i int) (authority.Grant, error) {
		a := authority.Acquisition{Key: auth.Key(l, "k"+strconv.Itoa(i)), Limit: l, Want: 1, Min: 1, Share: 1}
		return k.Acquire(context.Background(), &Call{Brk: sp.brk, Acq: a})
	}
	if g, err := sp.call(0); err != nil || g.Granted != 1 { // a connection, the script loaded
		t.Fatalf("first call: %+v, %v; want 1 token", g, err)
	}
	px.SetLatency(300 * time.Millisecond)

	ln := p.nodes.laneFor(sp.brk)
	waitLane := func(what string, done func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			ln.mu.Lock()
			ok, inflight, queue := done(), ln.inflight, len(ln.queue)
			ln.mu.Unlock()
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the lane never had %s: %d pipelines in flight, %d calls queued", what, inflight, queue)
			}
		}
	}
	admitted := func(from, n int) {
		for i := range n {
			sp.wg.Go(func() {
				if g, err := sp.call(from + i); err != nil || g.Granted != 1 {
					t.Errorf("a call admitted before the breaker opened: %+v, %v; want 1 token", g, err)
				}
			})
		}
	}
	for i := range ln.max { // one by one, so that each takes a pipeline of its own
		admitted(100+i, 1)
		waitLane("a pipeline more in flight", func() bool { return ln.inflight == i+1 })
	}
	admitted(200, queued)
	waitLane("the calls queued", func() bool { return len(ln.queue) == queued })

	done, err := sp.brk.Allow()
	if err != nil {
		t.Fatal(err)
	}
	done(circuit.ErrBudget) // one failure opens it (Failures: 1)
	if s := sp.brk.State(); s != breaker.Open {
		t.Fatalf("breaker %v after a failure; want open", s)
	}
	return sp
}

// TestAdmittedCallsSentWhileOpen: calls admitted while the breaker was
// closed are sent and answered even if it opens before their batch leaves
// (the batch then goes uncounted): their answers, denials that set a key's
// negative cache among them, are worth more than failing calls already
// made. Those in flight and those queued behind them all get their tokens.
func TestAdmittedCallsSentWhileOpen(t *testing.T) {
	sp := newSlowPath(t, time.Hour, 2)
	sp.wg.Wait() // each call checks its grant
	if s := sp.brk.State(); s != breaker.Open {
		t.Errorf("breaker %v after calls it never admitted were answered; want still open", s)
	}
}

// TestProbeGoesAlone: once an open breaker's OpenFor has passed, calls go
// through it one by one: the first is its probe, and the calls made while
// the probe is in flight are refused at once (breaker.ErrOpen, for the
// failure policy) rather than joining the probe's batch and waiting on a
// Redis that may still be down. The lane's pipelines are held here, so the
// later calls queue together, as they do behind calls a hung Redis holds.
func TestProbeGoesAlone(t *testing.T) {
	const openFor = 20 * time.Millisecond
	sp := newSlowPath(t, openFor, 2)
	time.Sleep(2 * openFor)

	const callers = 8
	var wg sync.WaitGroup
	var mu sync.Mutex
	granted, refused := 0, 0
	start := make(chan struct{})
	for i := range callers {
		wg.Go(func() {
			<-start
			g, err := sp.call(1 + i)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && g.Granted == 1:
				granted++
			case errors.Is(err, breaker.ErrOpen):
				refused++
			default:
				t.Errorf("call %d: %+v, %v; want a grant or breaker.ErrOpen", 1+i, g, err)
			}
		})
	}
	close(start)
	wg.Wait()
	sp.wg.Wait()
	if granted != 1 || refused != callers-1 {
		t.Errorf("%d callers after OpenFor: %d granted, %d refused; want the probe alone granted, the rest refused", callers, granted, refused)
	}
	if s := sp.brk.State(); s != breaker.Closed {
		t.Errorf("breaker %v after its probe was answered; want closed", s)
	}
}

// gaveUpStub is a lane member whose waiter did or did not blame Redis.
type gaveUpStub bool

func (gaveUpStub) finished(*pending) {}
func (g gaveUpStub) gaveUp() bool    { return bool(g) }
func (gaveUpStub) checkPoint()       {}

// TestBatchOutcome: what the breaker counts for a batch. A refused
// connection counts; a reply that is not an outage does not, nor the
// batch's own deadline (past every member's hard cap, so this process's
// delay, as for a single call), nor anything once a waiter blamed Redis
// (it counted its own failure), nor a member counted on its own.
func TestBatchOutcome(t *testing.T) {
	refused := &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}
	member := func(err error, gaveUp bool, own bool) *pending {
		p := &pending{a: &authority.Acquisition{Err: err}, finish: gaveUpStub(gaveUp)}
		if own {
			p.own = func(error) {}
		}
		return p
	}
	for _, tc := range []struct {
		name   string
		batch  []*pending
		counts bool
	}{
		{"answered", []*pending{member(nil, false, false), member(nil, false, false)}, false},
		{"refused connection", []*pending{member(nil, false, false), member(refused, false, false)}, true},
		{"a reply that is not an outage", []*pending{member(authority.ErrScript, false, false)}, false},
		{"the batch's own deadline", []*pending{member(context.DeadlineExceeded, false, false)}, false},
		{"a waiter blamed Redis", []*pending{member(refused, true, false), member(refused, false, false)}, false},
		{"counted on its own", []*pending{member(refused, false, true), member(nil, false, false)}, false},
	} {
		if got := circuit.Counts(batchOutcome(tc.batch)); got != tc.counts {
			t.Errorf("%s: the breaker counts a failure: %v; want %v (outcome %v)", tc.name, got, tc.counts, batchOutcome(tc.batch))
		}
	}
}

// TestProbeOnATornConnection: once Redis answers again, a half-open
// breaker's probe that sits on a pooled connection whose bytes were lost
// (a blackhole, as a flushed NAT entry or a middlebox failing over does)
// does not hold the breaker half-open until go-redis's ReadTimeout: Redis
// answers the witness on a new connection, and the breaker hears so. Also
// when that answer comes after the probe's budget: the witness's own
// connections, dropped in the outage, are made anew, and with Redis 60ms
// away the script answers past the witness's wait (50ms). Regressions
// (reviews): the probe held the breaker half-open for go-redis's
// ReadTimeout, and meanwhile every other call went to the failure policy
// (FailOpen decided 1.3-2.2 million calls) while Redis answered new
// connections; then a probe whose witness answered in 72ms, past its
// 50ms wait, was blamed, and the breaker opened again (FailOpen admitted
// some 390,000 more on a spent bucket).
func TestProbeOnATornConnection(t *testing.T) {
	const (
		budget  = 100 * time.Millisecond
		openFor = 50 * time.Millisecond
	)
	for _, tc := range []struct {
		latency time.Duration // each way, once Redis is back
		probe   string        // the probe: an acquire call, a peek, reset or adjustment (Do), or a refund pipeline
	}{{0, "acquire"}, {30 * time.Millisecond, "acquire"}, {0, "Do"}, {0, "refund"}} {
		latency := tc.latency
		px, p, call := newProxiedPath(t, &redis.Options{PoolSize: 1}, budget, openFor) // go-redis's defaults: a 5 s ReadTimeout
		brk := p.Shared()
		if err := call("warm"); err != nil {
			t.Fatal(err)
		}
		px.Blackhole(true)
		if err := call("lost"); !errors.Is(err, circuit.ErrBudget) {
			t.Fatalf("latency %v: a call while the proxy throws bytes away = %v; want ErrBudget", latency, err)
		}
		if s := brk.State(); s != breaker.Open {
			t.Fatalf("latency %v: breaker %v after a call blamed on Redis; want open", latency, s)
		}
		if latency > 0 {
			time.Sleep(witnessLife(budget) + budget) // the witness's asks end unanswered, their connections dropped
			px.SetLatency(latency)
		}
		px.Blackhole(false) // new connections work; the pooled one's reply is lost
		time.Sleep(2 * openFor)
		start := time.Now()
		var err error
		switch tc.probe {
		case "acquire":
			err = call("probe")
		case "Do":
			_, err = p.Do(context.Background(), brk, "k", func(ctx context.Context) error {
				return p.client.Eval(ctx, "return 1", nil).Err()
			})
		case "refund": // the refund queue's flusher waits for it; nothing else does
			l := policy.PerSecond(100)
			var wg sync.WaitGroup
			wg.Go(func() { p.Refund(brk, []authority.Refund{{Key: p.auth.Key(l, "k"), Limit: l, Tokens: 1}}, 1) })
			t.Cleanup(wg.Wait) // before the path's and the client's
		}
		t.Logf("latency %v, %s: the probe: %v after %v, breaker %v", latency, tc.probe, err, time.Since(start).Round(time.Millisecond), brk.State())
		for time.Since(start) < time.Second && brk.State() != breaker.Closed {
			time.Sleep(10 * time.Millisecond)
		}
		if s := brk.State(); s != breaker.Closed {
			t.Errorf("latency %v, %s: breaker %v a second after its probe began, Redis answering new connections; want closed", latency, tc.probe, s)
		}
	}
}

// TestProbeBeforeRedisCameBack: a half-open breaker's probe made while
// Redis was still unreachable, whose witness was not answered either, is
// a failure once the witness's ask has run its life: the breaker opens
// again and the next call probes anew, rather than waiting for the
// probe's own outcome, which on a pooled connection whose bytes were lost
// comes at go-redis's ReadTimeout (5 s by default). Regression (a review):
// a Peek, Reset, settlement or refund probe told the breaker nothing when
// the witness did not answer, and with Redis back just after, every call
// went to the failure policy for 4.65 s (about 2,100 refused in a loop
// with a call every 2ms); an acquire probe was blamed as it should be.
func TestProbeBeforeRedisCameBack(t *testing.T) {
	const (
		budget  = 100 * time.Millisecond
		openFor = 50 * time.Millisecond
	)
	for _, probe := range []string{"acquire", "Do", "refund"} {
		px, p, call := newProxiedPath(t, &redis.Options{PoolSize: 4}, budget, openFor)
		brk := p.Shared()
		if err := call("warm"); err != nil {
			t.Fatal(err)
		}
		px.Blackhole(true)
		if err := call("lost"); !errors.Is(err, circuit.ErrBudget) {
			t.Fatalf("%s: a call while the proxy throws bytes away = %v; want ErrBudget", probe, err)
		}
		time.Sleep(2 * openFor)
		var wg sync.WaitGroup
		switch probe { // the probe, while Redis is still unreachable
		case "acquire":
			wg.Go(func() { _ = call("probe") })
		case "Do":
			wg.Go(func() {
				_, _ = p.Do(context.Background(), brk, "k", func(ctx context.Context) error {
					return p.client.Eval(ctx, "return 1", nil).Err()
				})
			})
		case "refund":
			l := policy.PerSecond(100)
			wg.Go(func() { p.Refund(brk, []authority.Refund{{Key: p.auth.Key(l, "k"), Limit: l, Tokens: 1}}, 1) })
		}
		t.Cleanup(wg.Wait) // before the path's and the client's
		// The witness's ask from the probe's budget ends unanswered.
		time.Sleep(budget + witnessLife(budget) + 50*time.Millisecond)
		px.Blackhole(false) // new connections work; the pooled ones' replies are lost
		back := time.Now()
		refused := 0
		var err error
		for time.Since(back) < 2*time.Second {
			if err = call("after"); err == nil {
				break
			}
			if errors.Is(err, breaker.ErrOpen) {
				refused++
			}
			time.Sleep(2 * time.Millisecond)
		}
		t.Logf("%s probe: the first call after Redis came back answered after %v (%v); %d refused by the breaker meanwhile",
			probe, time.Since(back).Round(time.Millisecond), err, refused)
		if err != nil || time.Since(back) > time.Second {
			t.Errorf("%s probe: no call answered within a second of Redis coming back (last %v, %d refused by the breaker); want the breaker to probe anew", probe, err, refused)
		}
	}
}

// TestStaleBatchIsNoProbe: a batch of calls queued while the breaker was
// closed, sent once it is due for a probe, does not take the probe's
// place: it goes uncounted, and the next call that asks is the probe (and
// vouched for, see Caller.detached and Path.judgeProbe). A batch that took
// that place on a pooled connection whose bytes were lost held the
// breaker half-open, every call meanwhile to the failure policy, until
// go-redis's ReadTimeout (a review's lead, reproduced here).
func TestStaleBatchIsNoProbe(t *testing.T) {
	const openFor = 20 * time.Millisecond
	ln, auth, h := newTestLane(t, 1)
	ln.brk = circuit.New("test", circuit.Settings{Settings: breaker.Settings{Failures: 1, OpenFor: openFor}})
	done, err := ln.brk.Allow()
	if err != nil {
		t.Fatal(err)
	}
	done(&net.OpError{Op: "dial", Err: syscall.ECONNREFUSED})
	if s := ln.brk.State(); s != breaker.Open {
		t.Fatalf("breaker %v after a refused connection; want open", s)
	}
	time.Sleep(2 * openFor) // due for a probe
	l := policy.PerSecond(10)
	o := newOutcomes(make(chan *pending, 1))
	o.submit(ln, auth.Key(l, "queued"), l, 1) // admitted while the breaker was closed: own is nil
	waitLane(t, ln, "the queued call was never sent", busy)
	probe, err := ln.brk.Allow()
	close(h.release)
	<-o.done
	ln.stop()
	if err != nil {
		t.Fatalf("the breaker refused a probe while a stale batch was out (%v): the batch took the probe's place", err)
	}
	probe(nil)
	if s := ln.brk.State(); s != breaker.Closed {
		t.Errorf("breaker %v after its probe succeeded; want closed", s)
	}
}
