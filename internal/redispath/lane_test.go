package redispath

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// gatedHook holds the first single command until release is closed, and
// records the calls of every acquire script invocation (its keys but the
// batch key), sent alone or in a pipeline.
type gatedHook struct {
	release chan struct{}
	once    sync.Once
	mu      sync.Mutex
	calls   []int // calls per invocation, in the order sent
}

func (h *gatedHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *gatedHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.once.Do(func() { <-h.release })
		h.record(cmd)
		return next(ctx, cmd)
	}
}

func (h *gatedHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h.record(c)
		}
		return next(ctx, cmds)
	}
}

// record notes cmd's calls if it runs the acquire script (not the
// connection's handshake).
func (h *gatedHook) record(cmd redis.Cmder) {
	if cmd.Name() != "evalsha" {
		return
	}
	h.mu.Lock()
	h.calls = append(h.calls, cmd.Args()[2].(int)-1)
	h.mu.Unlock()
}

// sent returns the calls of each invocation recorded so far.
func (h *gatedHook) sent() []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]int(nil), h.calls...)
}

func newTestLane(t *testing.T, pipelines int) (*lane, *authority.Redis, *gatedHook) {
	t.Helper()
	_, c := newMini(t, nil)
	h := &gatedHook{release: make(chan struct{})}
	c.AddHook(h)
	auth, err := authority.New(c, "leaselimit")
	if err != nil {
		t.Fatal(err)
	}
	ln := newLane(auth, circuit.New("test", circuit.Settings{}), 4, time.Second, recorder.Endpoint{}, nil)
	ln.max = pipelines
	ln.senders.max = pipelines
	return ln, auth, h
}

// waitLane waits, for at most 2s, until cond holds of ln (read under its
// lock), and fails the test with what otherwise.
func waitLane(t *testing.T, ln *lane, what string, cond func(ln *lane) bool) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Second); ; {
		ln.mu.Lock()
		ok := cond(ln)
		ln.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(what)
		}
		time.Sleep(time.Millisecond)
	}
}

// busy reports whether ln's one pipeline is taken.
func busy(ln *lane) bool { return ln.inflight == 1 }

// outcomes records the outcomes a lane's senders deliver, by call.
type outcomes struct {
	mu   sync.Mutex
	got  map[*pending]authority.Acquisition
	done chan *pending // if set, told of each outcome
}

func newOutcomes(done chan *pending) *outcomes {
	return &outcomes{got: map[*pending]authority.Acquisition{}, done: done}
}

func (o *outcomes) gaveUp() bool { return false }
func (o *outcomes) checkPoint()  {}

func (o *outcomes) finished(p *pending) {
	o.mu.Lock()
	o.got[p] = *p.a
	o.mu.Unlock()
	if o.done != nil {
		o.done <- p
	}
}

// submit queues a call of n tokens on key for ln's senders.
func (o *outcomes) submit(ln *lane, key string, l policy.Limit, n int64) *pending {
	p := &pending{a: &authority.Acquisition{Key: key, Limit: l, Want: n, Min: n, Share: 1}, deadline: time.Now().Add(5 * time.Second), finish: o}
	ln.submit(p, time.Now())
	return p
}

// sendFirst claims ln's one pipeline and sends a call alone on it, in a
// goroutine, held by h until its release; the channel gets its outcome.
func sendFirst(t *testing.T, ln *lane, auth *authority.Redis, l policy.Limit) chan error {
	t.Helper()
	if !ln.claim() {
		t.Fatal("an idle lane refused its pipeline")
	}
	if ln.claim() {
		t.Fatal("a lane whose one pipeline is taken gave it again")
	}
	first := make(chan error, 1)
	go func() {
		one := &aloneSend{c: Call{Acq: authority.Acquisition{Key: auth.Key(l, "first"), Limit: l, Want: 1, Min: 1, Share: 1}}}
		ln.sendAlone(context.Background(), nil, one, time.Time{})
		first <- one.c.Acq.Err
	}()
	return first
}

// TestLaneBatchesWhileInFlight: with the lane's one pipeline busy with a
// call its caller sends alone, calls that arrive wait, and a sender
// carries them together in the next pipeline, each with its own outcome;
// a lane with calls waiting is not idle for a caller.
func TestLaneBatchesWhileInFlight(t *testing.T) {
	ln, auth, h := newTestLane(t, 1)
	l := policy.PerSecond(10)
	first := sendFirst(t, ln, auth, l)
	const waiting = 10
	o := newOutcomes(make(chan *pending, waiting))
	ps := make([]*pending, waiting)
	for i := range ps {
		n := int64(1)
		if i == 0 {
			n = 11 // above the burst: fails alone
		}
		ps[i] = o.submit(ln, auth.Key(l, "k"+strconv.Itoa(i)), l, n)
	}
	waitLane(t, ln, "the calls never all queued behind the busy pipeline", func(ln *lane) bool { return len(ln.queue) == waiting && busy(ln) })
	close(h.release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range waiting {
		<-o.done
	}
	if o.got[ps[0]].Err == nil {
		t.Error("a call above the burst succeeded in a batch")
	}
	for i := 1; i < waiting; i++ {
		if a := o.got[ps[i]]; a.Err != nil || a.Grant.Granted != 1 {
			t.Errorf("call %d: %+v, %v; want 1 token", i, a.Grant, a.Err)
		}
	}
	// The first call alone, then one invocation of the valid calls that
	// waited.
	if sent := h.sent(); len(sent) != 2 || sent[0] != 1 || sent[1] != waiting-1 {
		t.Errorf("calls of the invocations sent: %v; want [1 %d]", sent, waiting-1)
	}
	waitLane(t, ln, "the lane never went idle", func(ln *lane) bool { return ln.inflight == 0 && len(ln.queue) == 0 })
	ln.stop()
}

// BenchmarkLane measures one acquire call on a real redis-server from
// RunParallel goroutines (64 per processor, so calls batch): straight to
// the authority (one round trip per call), and through a lane (allocations
// per call include the lane's own: the pending call and its channel).
func BenchmarkLane(b *testing.B) {
	srv := redistest.Start(b)
	c := srv.Client(b)
	auth, err := authority.New(c, "leaselimit")
	if err != nil {
		b.Fatal(err)
	}
	l := policy.Limit{Name: "bench", Rate: 1_000_000_000, Period: time.Second, Burst: 1_000_000_000}
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = auth.Key(l, strconv.Itoa(i))
	}
	ctx := context.Background()
	run := func(b *testing.B, acquire func(a authority.Acquisition) error) {
		var next atomic.Int64
		b.ReportAllocs()
		b.SetParallelism(32)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				k := keys[next.Add(1)%int64(len(keys))]
				if err := acquire(authority.Acquisition{Key: k, Limit: l, Want: 1, Min: 1, Share: 1}); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	b.Run("direct", func(b *testing.B) {
		run(b, func(a authority.Acquisition) error {
			_, err := auth.Acquire(ctx, a.Key, a.Limit, a.Want, a.Min, a.Share)
			return err
		})
	})
	b.Run("lane", func(b *testing.B) {
		ln := newLane(auth, circuit.New("bench", circuit.Settings{}), poolSize(c), time.Second, recorder.Endpoint{}, nil)
		defer ln.stop()
		run(b, func(a authority.Acquisition) error {
			if ln.claim() {
				one := &aloneSend{c: Call{Acq: a}}
				ln.sendAlone(ctx, nil, one, time.Time{})
				return one.c.Acq.Err
			}
			w := &waiter{done: make(chan struct{})}
			ln.submit(&pending{a: &a, deadline: time.Now().Add(time.Second), finish: w}, time.Now())
			<-w.done
			return a.Err
		})
	})
}

// waiter is told when its call's outcome is in.
type waiter struct{ done chan struct{} }

func (w *waiter) finished(*pending) { close(w.done) }

func (w *waiter) gaveUp() bool { return false }
func (w *waiter) checkPoint()  {}

// TestLaneCallsOnOneKeyShareABatch: calls on one key, queued behind a
// busy pipeline, go in one batch and are decided in order (the script
// reads and writes the key once; a resent batch returns its stored
// replies): a burst of 3 and five calls of 1 grant three.
func TestLaneCallsOnOneKeyShareABatch(t *testing.T) {
	ln, auth, h := newTestLane(t, 1)
	l := policy.Limit{Name: "same", Rate: 1, Period: time.Hour, Burst: 3}
	first := sendFirst(t, ln, auth, l)
	o := newOutcomes(make(chan *pending, 5))
	for range 5 {
		o.submit(ln, auth.Key(l, "same"), l, 1)
	}
	waitLane(t, ln, "the five calls never queued", func(ln *lane) bool { return len(ln.queue) == 5 })
	close(h.release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	var granted int64
	for range 5 {
		p := <-o.done
		if p.a.Err != nil {
			t.Error(p.a.Err)
		}
		granted += p.a.Grant.Granted
	}
	if granted != 3 {
		t.Errorf("five calls on a key with a burst of 3 were granted %d tokens; want 3", granted)
	}
	if sent := h.sent(); len(sent) != 2 || sent[1] != 5 {
		t.Errorf("calls of the invocations sent: %v; want the first alone, then the five in one", sent)
	}
	ln.stop()
}

// TestLaneSenders: calls submitted to a lane are carried by its senders
// (no more than its pipelines), each outcome delivered once, calls on one
// key decided in order; stop waits for the queue to drain and ends every
// sender (goleak in TestMain).
func TestLaneSenders(t *testing.T) {
	ln, auth, h := newTestLane(t, 2)
	close(h.release)
	l := policy.Limit{Name: "senders", Rate: 1, Period: time.Hour, Burst: 50}
	o := newOutcomes(nil)
	const calls = 200
	ps := make([]*pending, calls)
	for i := range ps {
		ps[i] = o.submit(ln, auth.Key(l, "k"+strconv.Itoa(i%4)), l, 1)
	}
	ln.mu.Lock()
	started := ln.senders.started
	ln.mu.Unlock()
	if started > ln.max {
		t.Errorf("%d senders started; want at most %d", started, ln.max)
	}
	ln.stop()
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.got) != calls {
		t.Fatalf("%d outcomes; want %d", len(o.got), calls)
	}
	var granted int64
	for _, a := range o.got {
		if a.Err != nil {
			t.Fatal(a.Err)
		}
		granted += a.Grant.Granted
	}
	if granted != 4*l.Burst {
		t.Errorf("4 keys with a burst of %d granted %d tokens in all; want %d", l.Burst, granted, 4*l.Burst)
	}
	// In order: the first 50 calls of each key are the granted ones.
	for i, p := range ps {
		want := int64(0)
		if i/4 < int(l.Burst) {
			want = 1
		}
		if o.got[p].Grant.Granted != want {
			t.Fatalf("call %d (the %dth on its key): granted %d; want %d", i, i/4+1, o.got[p].Grant.Granted, want)
		}
	}
}

// TestOverduePipelinesLeftBehind: on a client that does not bound its
// reads by the deadline (go-redis's defaults: a 5 s ReadTimeout), batches
// sent on connections whose bytes were lost (a blackhole) hold both of
// the lane's pipelines; once past their deadline they are left behind,
// and a call after Redis came back is sent on another connection and
// answered, also one queued just before they pass it. Regressions
// (reviews): every call waited behind them to the hard cap and was denied,
// for go-redis's ReadTimeout after Redis came back; then a call queued
// 50ms before they passed their deadline waited to its hard cap (501ms)
// with a pipeline free, nothing waking a sender, and was denied.
func TestOverduePipelinesLeftBehind(t *testing.T) {
	const budget = 100 * time.Millisecond
	for _, before := range []time.Duration{-budget, budget / 2} { // when the call is made, before the lost batches are overdue
		px, p, call := newProxiedPath(t, &redis.Options{PoolSize: 4}, budget, 10*time.Millisecond)
		if err := call("warm"); err != nil {
			t.Fatal(err)
		}
		ln := p.nodes.laneFor(p.Shared())
		px.Blackhole(true)
		var wg sync.WaitGroup
		for i := range ln.max { // one by one, each on a pipeline of its own, all before the first is blamed
			wg.Go(func() { _ = call(fmt.Sprint("lost-", i)) })
			for deadline := time.Now().Add(budget / 2); ; time.Sleep(100 * time.Microsecond) {
				ln.mu.Lock()
				inflight := ln.inflight
				ln.mu.Unlock()
				if inflight == i+1 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%d pipelines in flight; want %d of the lane's %d held", inflight, i+1, ln.max)
				}
			}
		}
		wg.Wait() // their waiters gave up
		px.Blackhole(false)
		ln.mu.Lock()
		var overdue time.Time // when the last of the lost batches is past its deadline
		for _, b := range ln.flying {
			if b.until.After(overdue) {
				overdue = b.until
			}
		}
		held := len(ln.flying)
		ln.mu.Unlock()
		if held != ln.max {
			t.Fatalf("%d batches in flight after the blackhole; want the lane's %d", held, ln.max)
		}
		time.Sleep(time.Until(overdue.Add(-before)))
		start := time.Now()
		err := call("after")
		ln.mu.Lock()
		inflight := ln.inflight
		ln.mu.Unlock()
		t.Logf("a call %v before the lost batches were overdue: %v after %v", before, err, time.Since(start).Round(time.Millisecond))
		if err != nil {
			t.Errorf("a call %v before the lost batches were overdue, Redis back = %v (after %v, %d pipelines in flight); want it answered",
				before, err, time.Since(start).Round(time.Millisecond), inflight)
		}
	}
}
