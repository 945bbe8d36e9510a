package redispath

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/leaselimit/leaselimit/telemetry"
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
	ln := newLane(auth, 4, time.Second, telemetry.Endpoint{})
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

// TestLaneBatchesWhileInFlight: with the lane's one pipeline busy, calls
// that arrive wait and go together in the next pipeline, each with its
// own outcome; an idle lane sends a call alone, at once.
func TestLaneBatchesWhileInFlight(t *testing.T) {
	ln, auth, h := newTestLane(t, 1)
	l := policy.PerSecond(10)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	acq := func(key string, n int64) (authority.Grant, error) {
		return ln.acquire(ctx, authority.Acquisition{Key: auth.Key(l, key), Limit: l, Want: n, Min: n, Share: 1}, nil)
	}
	first := make(chan error, 1)
	go func() { _, err := acq("first", 1); first <- err }()
	waitLane(t, ln, "the first call never took the lane's pipeline", busy)
	const waiting = 10
	var wg sync.WaitGroup
	grants := make([]authority.Grant, waiting)
	errs := make([]error, waiting)
	for i := range waiting {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := int64(1)
			if i == 0 {
				n = 11 // above the burst: fails alone
			}
			grants[i], errs[i] = acq("k"+strconv.Itoa(i), n)
		}()
	}
	waitLane(t, ln, "the calls never all queued behind the busy pipeline", func(ln *lane) bool { return len(ln.queue) == waiting })
	close(h.release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if errs[0] == nil {
		t.Error("a call above the burst succeeded in a batch")
	}
	for i := 1; i < waiting; i++ {
		if errs[i] != nil || grants[i].Granted != 1 {
			t.Errorf("call %d: %+v, %v; want 1 token", i, grants[i], errs[i])
		}
	}
	// The first call alone, then one invocation of the valid calls that
	// waited.
	if sent := h.sent(); len(sent) != 2 || sent[0] != 1 || sent[1] != waiting-1 {
		t.Errorf("calls of the invocations sent: %v; want [1 %d]", sent, waiting-1)
	}
	if ln.inflight != 0 || len(ln.queue) != 0 {
		t.Errorf("lane after the batch: %d in flight, %d queued; want none", ln.inflight, len(ln.queue))
	}
}

// TestLaneCallLeavesQueue: a queued call whose context ends leaves the
// queue at once with its context's error, and the batch goes on without it.
func TestLaneCallLeavesQueue(t *testing.T) {
	ln, auth, h := newTestLane(t, 1)
	l := policy.PerSecond(10)
	bg := context.Background()
	first := make(chan error, 1)
	go func() {
		_, err := ln.acquire(bg, authority.Acquisition{Key: auth.Key(l, "a"), Limit: l, Want: 1, Min: 1, Share: 1}, nil)
		first <- err
	}()
	waitLane(t, ln, "the first call never took the lane's pipeline", busy)
	ctx, cancel := context.WithTimeout(bg, 20*time.Millisecond)
	defer cancel()
	if _, err := ln.acquire(ctx, authority.Acquisition{Key: auth.Key(l, "b"), Limit: l, Want: 1, Min: 1, Share: 1}, nil); err != context.DeadlineExceeded {
		t.Errorf("queued call past its deadline: %v; want context.DeadlineExceeded", err)
	}
	ln.mu.Lock()
	queued := len(ln.queue)
	ln.mu.Unlock()
	if queued != 0 {
		t.Errorf("%d calls left in the queue", queued)
	}
	close(h.release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
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
		ln := newLane(auth, poolSize(c), time.Second, telemetry.Endpoint{})
		run(b, func(a authority.Acquisition) error {
			_, err := ln.acquire(ctx, a, nil)
			return err
		})
	})
}

// TestLaneCallsOnOneKeyShareABatch: calls on one key, queued behind a
// busy pipeline, go in one batch and are decided in order (the script
// reads and writes the key once; a resent batch returns its stored
// replies): a burst of 3 and five calls of 1 grant three.
func TestLaneCallsOnOneKeyShareABatch(t *testing.T) {
	ln, auth, h := newTestLane(t, 1)
	l := policy.Limit{Name: "same", Rate: 1, Period: time.Hour, Burst: 3}
	ctx := context.Background()
	acq := func(key string) (authority.Grant, error) {
		return ln.acquire(ctx, authority.Acquisition{Key: auth.Key(l, key), Limit: l, Want: 1, Min: 1, Share: 1}, nil)
	}
	first := make(chan error, 1)
	go func() { _, err := acq("first"); first <- err }()
	waitLane(t, ln, "the first call never took the lane's pipeline", busy)
	var wg sync.WaitGroup
	var granted atomic.Int64
	errs := make(chan error, 5)
	for range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g, err := acq("same")
			granted.Add(g.Granted)
			errs <- err
		}()
	}
	waitLane(t, ln, "the five calls never queued", func(ln *lane) bool { return len(ln.queue) == 5 })
	close(h.release)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if granted.Load() != 3 {
		t.Errorf("five calls on a key with a burst of 3 were granted %d tokens; want 3", granted.Load())
	}
	if sent := h.sent(); len(sent) != 2 || sent[1] != 5 {
		t.Errorf("calls of the invocations sent: %v; want the first alone, then the five in one", sent)
	}
}

// finishes records the outcomes a lane's senders deliver.
type finishes struct {
	mu   sync.Mutex
	got  map[*pending]authority.Grant
	errs int
}

func (f *finishes) finished(p *pending) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p.a.Err != nil {
		f.errs++
	}
	f.got[p] = p.a.Grant
}

// TestLaneSenders: calls submitted to a lane are carried by its senders
// (no more than its pipelines), each outcome delivered once, calls on one
// key decided in order; stop waits for the queue to drain and ends every
// sender (goleak in TestMain).
func TestLaneSenders(t *testing.T) {
	ln, auth, h := newTestLane(t, 2)
	close(h.release)
	l := policy.Limit{Name: "senders", Rate: 1, Period: time.Hour, Burst: 50}
	f := &finishes{got: map[*pending]authority.Grant{}}
	const calls = 200
	ps := make([]*pending, calls)
	for i := range ps {
		a := authority.Acquisition{Key: auth.Key(l, "k"+strconv.Itoa(i%4)), Limit: l, Want: 1, Min: 1, Share: 1}
		ps[i] = &pending{a: &a, deadline: time.Now().Add(5 * time.Second), finish: f}
		ln.submit(ps[i])
	}
	ln.mu.Lock()
	started := ln.senders.started
	ln.mu.Unlock()
	if started > ln.max {
		t.Errorf("%d senders started; want at most %d", started, ln.max)
	}
	ln.stop()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.got) != calls || f.errs != 0 {
		t.Fatalf("%d outcomes, %d errors; want %d outcomes, no error", len(f.got), f.errs, calls)
	}
	var granted int64
	for _, g := range f.got {
		granted += g.Granted
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
		if f.got[p].Granted != want {
			t.Fatalf("call %d (the %dth on its key): granted %d; want %d", i, i/4+1, f.got[p].Granted, want)
		}
	}
}
