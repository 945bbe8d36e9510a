package redispath

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/monotime"
	"github.com/redis/go-redis/v9"
)

// witness is a connection of leaselimit's own, outside the client's pool,
// on which Redis is asked to run a script (see aliveScript) before a call
// without a reply, or without a connection, is blamed on Redis: if Redis
// answers it within the time given, the call's missing reply is not an
// outage, and the call is this process's congestion (see Path.behind),
// as is go-redis's own error for a call that found no connection in time
// or whose reply its timeouts cut (see refused). The failure policy is
// for a Redis that does not answer; deciding by it while Redis answers
// admits past the fleet's bound. What a witness saw (reviews, then tests):
//
//   - A pool the application's own commands hold: a go-redis client shared
//     with a queue consumer's BLPOP loops (each holds a connection a second
//     or more) gives leaselimit's calls no connection within the budget.
//     A pool of two held by four BLPOP loops opened the breaker while Redis
//     answered, and FailOpen admitted 4-7 million decisions on a bucket of
//     100 (TestPoolHeldByTheApplication).
//   - One connection's reply held back (a lost segment retransmitted, a
//     stalled middlebox) while Redis answers every other: each such call
//     was blamed at the budget, and FailOpen admitted it on a spent bucket
//     (TestLateReplyWhileRedisAnswers: 8 of 8).
//
// Each lane has its own (see newNodes): a single node's (or Sentinel's)
// client, or on a Cluster the client of the lane's node; a Ring has one
// per shard (see shardWitnesses). nodes.witnessOf finds a call's.
type witness struct {
	client *redis.Client  // the user's, a Cluster node's or a Ring shard's; nil: none to ask through
	side   *redis.Client  // witnessConns connections of witness's own
	wait   time.Duration  // witnessWait of the budget: how long an ask has to answer
	life   time.Duration  // how long one ask may run (see ask)
	okAt   atomic.Int64   // the monotime of the last ask answered
	wg     sync.WaitGroup // the asks in flight, for close
	// unflagged is set once Redis could not compile aliveScript (a server
	// that reads no shebang): asks run aliveScriptUnflagged from then on.
	unflagged atomic.Bool

	mu      sync.Mutex
	flights []*flight // the asks in flight, oldest first
	closed  bool
}

// flight is one ask of a witness, which its callers share: when it began,
// and done, closed when it ends (answered or not; see okAt).
type flight struct {
	began time.Time
	done  chan struct{}
}

// witnessConns is how many asks a witness has in flight at most, each on a
// connection of its own: one more than the ask that may hang on a
// connection whose bytes were lost (a blackhole), so that an ask begun
// after Redis came back is not queued behind it (see ask).
const witnessConns = 2

// newWitness returns the witness of c (nil: none): a side client that
// reaches the same server as c (its address or dialer, credentials and
// TLS), one connection, RESP2 and no push notifications, client-side
// caching or identity, that bounds its reads by ctx's deadline and does
// not retry, with witnessConns connections. Only those fields are copied: a whole copy of c's options
// shares state the first client set up (go-redis then logs that it cannot
// register its handlers, and with maintenance notifications required,
// panics).
//
// It asks Redis at once, so that its connection is made and its handshake
// done before a call needs its answer (see ask).
func newWitness(c *redis.Client, budget time.Duration) *witness {
	if c == nil {
		return &witness{}
	}
	o := c.Options()
	side := redis.NewClient(&redis.Options{
		Network: o.Network, Addr: o.Addr, Dialer: dialNoError(o.Dialer), TLSConfig: o.TLSConfig,
		Username: o.Username, Password: o.Password, CredentialsProvider: o.CredentialsProvider,
		CredentialsProviderContext: o.CredentialsProviderContext, StreamingCredentialsProvider: o.StreamingCredentialsProvider,
		DialTimeout: o.DialTimeout, Protocol: 2, DisableIdentity: true,
		PoolSize: witnessConns, MaxIdleConns: witnessConns, MaxActiveConns: witnessConns, MaxRetries: -1, ContextTimeoutEnabled: true,
	})
	h := &witness{client: c, side: side, wait: witnessWait(budget), life: witnessLife(budget)}
	h.ask()
	return h
}

// witnessLife is how long one ask of a witness may run: twice the budget.
// An ask on a new connection costs a dial and go-redis's handshake (HELLO)
// before the script, three round trips; cut at witnessWait, each ask
// dropped its connection (go-redis drops one whose read timed out), so
// every later ask paid them again, and a Redis 26-50ms away (budget 100ms)
// never answered in time: the breaker opened while it answered, and
// FailOpen admitted 2.8-5.5 million decisions on a bucket of 100 (a
// review; TestWitnessWaitsForASlowRedis). Its own ask outlives the
// caller's wait and keeps the connection; not longer, so that an ask on a
// connection that hangs for good (a blackhole) does not hide for long a
// Redis that answers new ones.
func witnessLife(budget time.Duration) time.Duration { return 2 * budget }

// dialNoError wraps dial (go-redis sets a client's options' Dialer to its
// own when the user gave none) so that a failed dial hands go-redis a
// connection that fails its first use with the dial's error, not the
// error itself. A pool that counts as many dial errors as its size (one,
// witness's) answers every later call with the last dial error, without
// dialing, until a goroutine of go-redis's own (ConnPool.tryDial) dials
// again, a second later: a witness whose dial failed once in an outage
// would say Redis does not answer for up to a second after it answered
// again, and the calls it judges would go to the failure policy while
// Redis answered (TestWitnessAnswersOnceRedisIsBack); that goroutine also
// outlived Close by up to a second.
func dialNoError(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	if dial == nil {
		return nil
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dial(ctx, network, addr)
		if err != nil {
			return failedDial{err}, nil
		}
		return conn, nil
	}
}

// failedDial is the connection dialNoError hands go-redis for a dial that
// failed: every read and write fails with the dial's error, so the call
// fails, and go-redis drops the connection as bad.
type failedDial struct{ err error }

func (f failedDial) Read([]byte) (int, error)         { return 0, f.err }
func (f failedDial) Write([]byte) (int, error)        { return 0, f.err }
func (f failedDial) Close() error                     { return nil }
func (f failedDial) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (f failedDial) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (f failedDial) SetDeadline(time.Time) error      { return nil }
func (f failedDial) SetReadDeadline(time.Time) error  { return nil }
func (f failedDial) SetWriteDeadline(time.Time) error { return nil }

// refused is err, unless err says the client gave up on the call itself
// (see clientCut) while Redis answers witness (see answers): then it is ErrSaturated, this process's doing
// (its pool, or a timeout of its client's shorter than Redis's round
// trip), which the breaker does not count and the root denies (see
// Path.behind).
// Regressions (reviews, then TestPoolHeldByTheApplication and
// TestReadTimeoutBelowRoundTrip): with a PoolTimeout of 5ms, a pool of one
// that the application's BLPOP loops held gave leaselimit's calls the
// pool's error before the budget, each counted as Redis failing; the
// breaker opened while Redis answered, and FailOpen admitted 0.8-5.0
// million decisions on a bucket of 100 in 3 s. A ReadTimeout of 2ms with
// Redis 6ms away did the same: 3.6-5.7 million.
func (h *witness) refused(err error) error {
	if !clientCut(err) || !h.answers(nil) {
		return err
	}
	return congestion(err)
}

// refusedAll applies refused to the outcome of every call of a batch, the
// witness of each call's key given by witnessOf, asking each node once.
func refusedAll(as []*authority.Acquisition, witnessOf func(rkey string) *witness) {
	type verdict struct {
		h        *witness
		answered bool
	}
	var asked []verdict
	for _, a := range as {
		if !clientCut(a.Err) {
			continue
		}
		h := witnessOf(a.Key)
		i := slices.IndexFunc(asked, func(v verdict) bool { return v.h == h })
		if i < 0 {
			i = len(asked)
			asked = append(asked, verdict{h, h.answers(nil)})
		}
		if asked[i].answered {
			a.Err = congestion(a.Err)
		}
	}
}

// witnessWait is how long Redis is given to answer a witness (see
// witness.answers) before a call without a reply, or one the client cut
// (see clientCut), is blamed on it: half the budget. An eighth (the
// scheduler probe's threshold, see Path.behind) was missed on a busy
// 2-core host while Redis answered in 13-22ms: 8 callers in tight loops
// and 4 BLPOP loops holding the pool, with other tests running beside
// them; each miss was blamed on Redis, the breaker opened, and FailOpen
// admitted 0.7-2 million decisions on a bucket of 100
// (TestPoolHeldByTheApplication, 1 run in 3 or 4 on such a host;
// TestWitnessWaitsForASlowRedis). A ReadTimeout of 2ms with Redis 6ms
// away missed an eighth too. A call still without a reply half the budget
// before its end asks then (see askEarly), so that the verdict is known
// when its budget ends.
func witnessWait(budget time.Duration) time.Duration { return budget / 2 }

// clientCut reports whether err is the client's own for a call it gave up
// on before the call's deadline: no connection of the pool (go-redis's
// PoolTimeout ran out, or MaxActiveConns was reached), or a reply its
// ReadTimeout or WriteTimeout cut (after the resends, see
// authority.Redis.AcquireAll), which a budget's deadline does not (that
// error wraps ctx's, see authority's atDeadline). A dial's timeout is not
// one: no connection could be made.
func clientCut(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrPoolExhausted) {
		return true
	}
	var ne net.Error
	var op *net.OpError
	return errors.As(err, &ne) && ne.Timeout() && !errors.Is(err, context.DeadlineExceeded) &&
		!(errors.As(err, &op) && op.Op == "dial")
}

// congestion is ErrSaturated for a call that got no connection, err, while
// Redis answered; it does not wrap err, which the breaker would count.
func congestion(err error) error {
	return fmt.Errorf("%w: %v, while Redis answered", ErrSaturated, err)
}

// answers reports whether Redis runs aliveScript on a connection of
// witness's own within its wait: it answered an ask within the last wait,
// or answers an ask by wait after that ask began: early, the ask that the
// caller joined early (see askEarly), else the one ask returns. An early
// ask, begun no later than wait before the caller's budget ends, has had
// its wait when the budget ends: the verdict is known then, and a hung
// Redis holds no call past its budget for it. An ask that ends unanswered
// before its wait (a refused or broken connection) is followed by one
// more. It is false where there is no client to ask through.
func (h *witness) answers(early *flight) bool {
	if h == nil || h.client == nil {
		return false
	}
	if h.fresh() {
		return true
	}
	f := early
	for range 2 {
		if f == nil {
			if f = h.ask(); f == nil {
				return false // closed
			}
		}
		timer := newTimer(time.Until(f.began.Add(h.wait)))
		select {
		case <-f.done:
		case <-timer.C:
		}
		releaseTimer(timer)
		if h.fresh() {
			return true
		}
		select {
		case <-f.done: // ended unanswered: ask again
			f = nil
		default:
			return false // not answered within wait of its start
		}
	}
	return false
}

// fresh reports whether Redis answered an ask within the last wait.
func (h *witness) fresh() bool {
	ok := h.okAt.Load()
	return ok != 0 && monotime.Now()-ok < int64(h.wait)
}

// answered is fresh, nil-safe: false where there is no client to ask
// through.
func (h *witness) answered() bool { return h != nil && h.client != nil && h.fresh() }

// answersInLife reports whether Redis answers ask (else a new one) before
// the ask ends, up to its life: the verdict on a breaker's probe, which
// its caller does not wait for (see Path.judgeProbe).
func (h *witness) answersInLife(ask *flight) bool {
	if h == nil || h.client == nil {
		return false
	}
	if h.fresh() {
		return true
	}
	if ask == nil {
		if ask = h.ask(); ask == nil {
			return false // closed
		}
	}
	<-ask.done
	return h.fresh()
}

// askEarly asks Redis for a call whose budget ends in the witness's wait
// (see answers), and returns the ask to pass to answers then (nil if
// none): nil-safe, and it does not wait.
func (h *witness) askEarly() *flight {
	if h == nil || h.client == nil {
		return nil
	}
	return h.ask()
}

// ask returns an ask of Redis to run aliveScript, for up to life, that
// callers share (nil once witness is closed): the newest in flight if it
// began within the wait, else a new one on a connection of its own while
// fewer than witnessConns are in flight, else the newest. An ask that has
// gone unanswered for the wait says nothing of a Redis that came back
// since: its request may have been lost with its connection's bytes (a
// blackhole), and a request sent after it on its connection waits behind
// it. Callers wait for an ask as long as they choose: it runs on, so that
// an answer later than one caller's wait still keeps the connection, and
// its handshake, for the next caller, and updates okAt. (Not
// singleflight's: a caller must know when the ask it joins began.)
func (h *witness) ask() *flight {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed || h.side == nil {
		return nil
	}
	if n := len(h.flights); n > 0 {
		newest := h.flights[n-1]
		if time.Since(newest.began) < h.wait || n >= witnessConns {
			return newest
		}
	}
	f := &flight{began: time.Now(), done: make(chan struct{})}
	h.flights = append(h.flights, f)
	h.wg.Add(1) // under mu, before close's Wait
	go h.run(f)
	return f
}

// run makes ask f, and ends it.
func (h *witness) run(f *flight) {
	defer h.wg.Done()
	ctx, cancel := context.WithTimeout(context.Background(), h.life)
	if h.alive(ctx) {
		h.okAt.Store(monotime.Now())
	}
	cancel()
	h.mu.Lock()
	h.flights = slices.DeleteFunc(h.flights, func(g *flight) bool { return g == f })
	h.mu.Unlock()
	close(f.done)
}

// alive reports whether Redis ran aliveScript, or, on a server that
// cannot compile it, aliveScriptUnflagged.
func (h *witness) alive(ctx context.Context) bool {
	if !h.unflagged.Load() {
		err := h.side.Eval(ctx, aliveScript, nil).Err()
		if err == nil || !strings.Contains(err.Error(), "Error compiling script") {
			return err == nil
		}
		h.unflagged.Store(true)
	}
	return h.side.Eval(ctx, aliveScriptUnflagged, nil).Err() == nil
}

// aliveScript is what witness asks Redis to run: a script that may write,
// as leaselimit's calls are, not a PING. Redis answers a PING where it
// holds scripts back: CLIENT PAUSE WRITE (which FAILOVER and managed
// failovers use) pauses every script without the no-writes flag, and a
// review saw a PING answered through such a pause while leaselimit's own
// calls held a pool of one or two: each call was taken for this process's
// congestion, the breaker never opened, and FailOpen denied for the whole
// pause. The shebang (Redis 7) declares it a writing script, which Redis
// refuses up front where it refuses writes: a replica (READONLY), as a
// master is for a moment when a failover demotes it, and where writes
// need replicas it lacks or memory it has not (NOREPLICAS, OOM). Without
// one, a replica ran it while go-redis retried each lone call's READONLY
// reply until the budget ended: each call was taken for this process's
// congestion and denied whatever the policy (TestReplicaIsAnOutage).
const aliveScript = "#!lua\nreturn 1"

// aliveScriptUnflagged is aliveScript for a server that does not read a
// script's shebang (miniredis, for tests and the demo), where it does not
// compile: there a replica's refusal goes untold, as before.
const aliveScriptUnflagged = "return 1"

// close closes witness's own connection, and waits for its ask in flight
// (which closing its connection ends).
func (h *witness) close() {
	if h == nil || h.side == nil {
		return
	}
	h.mu.Lock()
	h.closed = true
	h.mu.Unlock()
	_ = h.side.Close()
	h.wg.Wait()
}

// shardWitnesses holds the witness of each shard of a Ring, made on first
// use: a Ring's keys share one breaker (see nodes), but each shard has its
// own client and pool, which the application's commands can hold as they
// can a single node's.
type shardWitnesses struct {
	ring   *redis.Ring
	budget time.Duration // of the Path, for newWitness

	mu      sync.Mutex
	byShard map[*redis.Client]*witness
	closed  bool
}

// newShardWitnesses returns the shardWitnesses of client, or nil if it is not a
// Ring.
func newShardWitnesses(client redis.UniversalClient, budget time.Duration) *shardWitnesses {
	r, ok := client.(*redis.Ring)
	if !ok {
		return nil
	}
	return &shardWitnesses{ring: r, budget: budget, byShard: map[*redis.Client]*witness{}}
}

// of returns the witness of the shard that serves rkey (go-redis's
// choice, which reads its shard list and never waits), or nil: rkey
// unknown, no shard up, or maxNodeBreakers shards seen (shards a Ring
// replaced keep theirs until close).
func (s *shardWitnesses) of(rkey string) *witness {
	if s == nil || rkey == "" {
		return nil
	}
	shard, err := s.ring.GetShardClientForKey(rkey)
	if err != nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	h := s.byShard[shard]
	if h == nil && !s.closed && len(s.byShard) < maxNodeBreakers {
		h = newWitness(shard, s.budget)
		s.byShard[shard] = h
	}
	return h
}

// close closes the shards' own connections.
func (s *shardWitnesses) close() {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for _, h := range s.byShard {
		h.close()
	}
}
