package redispath

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/singleflight"
)

// heldPool tells a call that waits for one of the client's connections,
// because other commands of the application hold them all, from a Redis
// that does not answer. An application that shares its go-redis client
// with leaselimit and runs blocking commands on it (a queue consumer's
// BLPOP holds a connection a second or more) can hold the whole pool: a
// call of leaselimit's then gets no connection within the budget, which
// looked like Redis failing. A review measured a pool of two held by four
// BLPOP loops: the breaker opened while Redis answered, and FailOpen
// admitted 4-7 million decisions on a bucket of 100.
//
// When the pool holds all the connections it may, a connection of
// heldPool's own, outside the pool, asks Redis to run a script (see
// aliveScript): if Redis answers it within the threshold, the call's
// missing reply is this process's congestion, not Redis failing (see
// Path.behind), and so is go-redis's own error for a call that found no
// connection in time (see refused). Each lane has its own (see
// newNodes): a single node's (or Sentinel's) client, or on a Cluster the
// client of the lane's node, whose pool is that node's; a Ring has one
// per shard (see shardPools). nodes.heldOf finds a call's.
type heldPool struct {
	client *redis.Client // the user's, a Cluster node's or a Ring shard's; nil: none to look at
	pool   int
	side   *redis.Client // one connection of heldPool's own
	okAt   atomic.Int64  // unix ns of the last call answered in time
	ping   singleflight.Group
}

// newHeldPool returns the heldPool of c (nil: none), whose pool holds pool
// connections: a side client that reaches the same server as client (its
// address or dialer, credentials and TLS), one connection, RESP2 and no
// push notifications, client-side caching or identity, that bounds its
// reads by ctx's deadline and does not retry. Only those fields are
// copied: a whole copy of client's options shares state the first client
// set up (go-redis then logs that it cannot register its handlers, and
// with maintenance notifications required, panics).
func newHeldPool(c *redis.Client, pool int) *heldPool {
	if c == nil {
		return &heldPool{}
	}
	o := c.Options()
	if m := o.MaxActiveConns; m > 0 && m < pool {
		pool = m // the pool holds no more than that
	}
	side := redis.NewClient(&redis.Options{
		Network: o.Network, Addr: o.Addr, Dialer: o.Dialer, TLSConfig: o.TLSConfig,
		Username: o.Username, Password: o.Password, CredentialsProvider: o.CredentialsProvider,
		CredentialsProviderContext: o.CredentialsProviderContext, StreamingCredentialsProvider: o.StreamingCredentialsProvider,
		DialTimeout: o.DialTimeout, Protocol: 2, DisableIdentity: true,
		PoolSize: 1, MaxIdleConns: 1, MaxActiveConns: 1, MaxRetries: -1, ContextTimeoutEnabled: true,
	})
	return &heldPool{client: c, pool: pool, side: side}
}

// held reports whether the client's pool holds all the connections it may
// and Redis answers heldPool's own connection (see answers). Some of them
// may be idle: go-redis retries a call that found none in PoolTimeout
// after a backoff, during which one can be: TestPoolHeldByTheApplication
// saw a call blamed on Redis at the budget that way, its pool of one idle
// for a moment between the application's BLPOP calls.
func (h *heldPool) held(threshold time.Duration) bool {
	if h == nil || h.client == nil {
		return false
	}
	if st := h.client.PoolStats(); st == nil || int(st.TotalConns) < h.pool {
		return false
	}
	return h.answers(threshold)
}

// refused is err, unless err says the client gave up on the call itself
// (see clientCut) while Redis answers heldPool's own connection within
// within (see sideWait): then it is ErrSaturated, this process's doing (its pool, or
// a timeout of its client's shorter than Redis's round trip), which the
// breaker does not count and the root denies (see Path.behind).
// Regressions (reviews, then TestPoolHeldByTheApplication and
// TestReadTimeoutBelowRoundTrip): with a PoolTimeout of 5ms, a pool of one
// that the application's BLPOP loops held gave leaselimit's calls the
// pool's error before the budget, each counted as Redis failing; the
// breaker opened while Redis answered, and FailOpen admitted 0.8-5.0
// million decisions on a bucket of 100 in 3 s. A ReadTimeout of 2ms with
// Redis 6ms away did the same: 3.6-5.7 million. The pool was full when its
// error came, so its stats are not read.
func (h *heldPool) refused(err error, within time.Duration) error {
	if !clientCut(err) || !h.answers(within) {
		return err
	}
	return congestion(err)
}

// refusedAll applies refused to the outcome of every call of a batch, the
// heldPool of each call's key given by heldOf, asking each node once.
func refusedAll(as []*authority.Acquisition, heldOf func(rkey string) *heldPool, within time.Duration) {
	type verdict struct {
		h        *heldPool
		answered bool
	}
	var asked []verdict
	for _, a := range as {
		if !clientCut(a.Err) {
			continue
		}
		h := heldOf(a.Key)
		i := slices.IndexFunc(asked, func(v verdict) bool { return v.h == h })
		if i < 0 {
			i = len(asked)
			asked = append(asked, verdict{h, h.answers(within)})
		}
		if asked[i].answered {
			a.Err = congestion(a.Err)
		}
	}
}

// sideWait is how long a call the client cut (see clientCut) waits for
// Redis to answer heldPool's own connection: half the budget, not the
// eighth a call at its budget's end is given (see Path.behind), since
// such a call usually has most of its budget left, and Redis a round trip
// away through a busy process (a ReadTimeout of 2ms, Redis 6ms away, 8
// callers in tight loops) missed an eighth.
func sideWait(budget time.Duration) time.Duration { return budget / 2 }

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

// answers reports whether Redis runs aliveScript on heldPool's own
// connection within threshold (one answered within the last threshold will
// do). Callers at the same moment share one call. It is false on a client
// heldPool does not look at.
func (h *heldPool) answers(threshold time.Duration) bool {
	if h == nil || h.client == nil {
		return false
	}
	if time.Now().UnixNano()-h.okAt.Load() < int64(threshold) {
		return true
	}
	_, err, _ := h.ping.Do("", func() (any, error) {
		ctx, cancel := context.WithTimeout(context.Background(), threshold)
		defer cancel()
		err := h.side.Eval(ctx, aliveScript, nil).Err()
		if err == nil {
			h.okAt.Store(time.Now().UnixNano())
		}
		return nil, err
	})
	return err == nil
}

// aliveScript is what heldPool asks Redis to run: a script, as
// leaselimit's calls are, not a PING. Redis answers a PING where it holds
// scripts back: CLIENT PAUSE WRITE (which FAILOVER and managed failovers
// use) pauses every script without the no-writes flag, and a review saw a
// PING answered through such a pause while leaselimit's own calls held a
// pool of one or two: each call was taken for this process's congestion,
// the breaker never opened, and FailOpen denied for the whole pause.
const aliveScript = "return 1"

// close closes heldPool's own connection.
func (h *heldPool) close() {
	if h != nil && h.side != nil {
		_ = h.side.Close()
	}
}

// shardPools holds the heldPool of each shard of a Ring, made on first
// use: a Ring's keys share one breaker (see nodes), but each shard has its
// own client and pool, which the application's commands can hold as they
// can a single node's.
type shardPools struct {
	ring *redis.Ring
	pool int

	mu      sync.Mutex
	byShard map[*redis.Client]*heldPool
	closed  bool
}

// newShardPools returns the shardPools of client, or nil if it is not a
// Ring.
func newShardPools(client redis.UniversalClient, pool int) *shardPools {
	r, ok := client.(*redis.Ring)
	if !ok {
		return nil
	}
	return &shardPools{ring: r, pool: pool, byShard: map[*redis.Client]*heldPool{}}
}

// of returns the heldPool of the shard that serves rkey (go-redis's
// choice, which reads its shard list and never waits), or nil: rkey
// unknown, no shard up, or maxNodeBreakers shards seen (shards a Ring
// replaced keep theirs until close).
func (s *shardPools) of(rkey string) *heldPool {
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
		h = newHeldPool(shard, s.pool)
		s.byShard[shard] = h
	}
	return h
}

// close closes the shards' own connections.
func (s *shardPools) close() {
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
