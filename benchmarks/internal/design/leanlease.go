package design

import (
	"context"
	"fmt"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// The lean lease: lean_necessary's exact calls with leases for the keys
// that repeat, and nothing more. It is what leaselimit's default leases
// must do on the cold long tail, built as simply as it can be, so that
// leases' share of exact mode's rate there (issue 25 asks leaselimit_lease
// for at least 0.95× leaselimit_exact) has a prototype measured in the
// same run:
//
//   - a direct-mapped doorkeeper, as leaselimit's: a key's first sight,
//     or its first after a lease's life, is one exact call, as in
//     lean_necessary;
//   - a key back within a lease's life gets an entry; its refill asks for
//     two tokens, its need and a spare (leaselimit's first refill), all or
//     none, and a refill denied asks for the need alone;
//   - the key's next decision within the lease's TTL takes the spare (a
//     lease hit, no Redis call); a key whose refill is in flight decides
//     exactly rather than waiting for it;
//   - a janitor, every leanSweep (leaselimit's: a quarter of the TTL, at
//     most 250 ms), forgets the entries whose lease expired and gives
//     their unused tokens back to Redis, up to leanMaxBatch per script
//     call, each call resend-safe by a batch key.
//
// No lease sizing (a refill always asks for two: on the cold tail
// leaselimit's rarely ask for more), no shared refill for a hot key's
// misses, no breaker, no telemetry, no reset marks: a prototype for the
// cold long tail, not a design for hot keys.

const (
	leanLeaseTTL  = 2 * time.Second // leaselimit's default
	leanSweep     = 250 * time.Millisecond
	leanDoorSlots = 1 << 18 // a power of two, above the cold tail's 200k keys
	leanShards    = 64
)

// leanRefundScript gives unused tokens back. KEYS[1] is the batch key,
// then one bucket per refund (repeats allowed). ARGV: the batch key's life
// in ms, r, p, burst (as leanContractScript's), then the tokens of each
// refund. A bucket gains them up to its burst; a missing bucket is full
// already. Returns 1, or 0 for a batch applied before (a resend).
var leanRefundScript = redis.NewScript(`
if not redis.call('SET', KEYS[1], 1, 'NX', 'PX', ARGV[1]) then return 0 end
local r, p, burst = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
for i = 2, #KEYS do
  local k = KEYS[i]
` + leanBucketAt + `  if v then
    w = math.min(burst, w + tonumber(ARGV[i + 3]))
    if w == burst then f = 0 end
    local ttl = math.ceil(((burst - w) * p - f) / r / 1000) + 1000
    redis.call('SET', k, string.format('%d %d %d', w, f, t), 'PX', ttl)
  end
end
return 1
`)

// leanEntry is a key's lease. Times are ns since the design started.
type leanEntry struct {
	mu        sync.Mutex
	tokens    int64 // the spare tokens leased and not yet used
	expires   int64 // when they must go back to Redis
	used      int64 // the key's last decision through the entry
	refilling bool  // a refill is in flight
	gone      bool  // forgotten by the janitor
}

// leanExpiry is an entry's lease expiring at at; a refill since makes a
// new one, and this one stale.
type leanExpiry struct {
	key string
	e   *leanEntry
	at  int64
}

// leanRefund is tokens of key's to give back.
type leanRefund struct {
	key    string
	tokens int64
}

type leanShard struct {
	mu sync.RWMutex
	m  map[string]*leanEntry
}

type leanLease struct {
	calls   *leanHandoff  // lean_necessary's hand-off, exact calls and refills
	batches *leanContract // its Redis side: key names, batch keys, limit
	start   time.Time
	seed    maphash.Seed
	door    []atomic.Uint64 // tag (the hash's top 32 bits) << 32 | ms of the last sight
	shards  [leanShards]leanShard

	mu       sync.Mutex
	expiring []leanExpiry // in the order leased, so about the order they expire
	stale    []leanRefund // tokens of expired leases a refill replaced
	lost     atomic.Int64 // refunds an error lost

	stop chan struct{}
	done chan struct{}
}

func newLeanLease(client *redis.Client, limit policy.Limit) (Decider, error) {
	c, err := newContractBatches(client, limit, "ll-lleas")
	if err != nil {
		return nil, err
	}
	l := &leanLease{calls: newHandoff(LeanLease, c.send, c.namer.Key), batches: c, start: time.Now(),
		seed: maphash.MakeSeed(), door: make([]atomic.Uint64, leanDoorSlots),
		stop: make(chan struct{}), done: make(chan struct{})}
	for i := range l.shards {
		l.shards[i].m = make(map[string]*leanEntry)
	}
	go l.janitor()
	return l, nil
}

func (l *leanLease) now() int64 { return int64(time.Since(l.start)) }

// seen reports whether the key of hash h was seen within a lease's life,
// and marks it seen at now.
func (l *leanLease) seen(h uint64, now int64) bool {
	slot := &l.door[h&(leanDoorSlots-1)]
	old, stamp := slot.Swap(h>>32<<32|uint64(uint32(now/1e6))), uint32(now/1e6)
	return old>>32 == h>>32 && int64(stamp-uint32(old)) < leanLeaseTTL.Milliseconds()
}

func (l *leanLease) Allow(ctx context.Context, key string) (Result, error) {
	now := l.now()
	h := maphash.String(l.seed, key)
	sh := &l.shards[h%leanShards]
	sh.mu.RLock()
	e := sh.m[key]
	sh.mu.RUnlock()
	if e == nil {
		if !l.seen(h, now) {
			return l.calls.take(ctx, key, 1)
		}
		sh.mu.Lock()
		if e = sh.m[key]; e == nil {
			e = &leanEntry{used: now}
			sh.m[key] = e
		}
		sh.mu.Unlock()
	}
	e.mu.Lock()
	lapsed := now >= e.expires && now-e.used >= int64(leanLeaseTTL)
	if e.gone || e.refilling || lapsed {
		// Forgotten, shared, or back after a lease's life: as new.
		e.mu.Unlock()
		return l.calls.take(ctx, key, 1)
	}
	e.used = now
	if now < e.expires && e.tokens > 0 {
		e.tokens--
		e.mu.Unlock()
		return Result{Allowed: true}, nil
	}
	stale := e.tokens // expired, not yet swept
	e.tokens, e.refilling = 0, true
	e.mu.Unlock()
	if stale > 0 {
		l.mu.Lock()
		l.stale = append(l.stale, leanRefund{key: key, tokens: stale})
		l.mu.Unlock()
	}
	r, err := l.calls.take(ctx, key, 2)
	at := now + int64(leanLeaseTTL)
	e.mu.Lock()
	e.refilling, e.expires = false, at
	if err == nil && r.Allowed {
		e.tokens = 1
	}
	e.mu.Unlock()
	l.mu.Lock()
	l.expiring = append(l.expiring, leanExpiry{key: key, e: e, at: at})
	l.mu.Unlock()
	if err != nil || r.Allowed || r.Fallback {
		return r, err
	}
	return l.calls.take(ctx, key, 1) // two denied: the need alone
}

// janitor sweeps every leanSweep until Close.
func (l *leanLease) janitor() {
	defer close(l.done)
	tick := time.NewTicker(leanSweep)
	defer tick.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-tick.C:
			l.sweep(l.now())
		}
	}
}

// sweep forgets the entries whose lease expired by now (all of them when
// now is past every lease, as Close makes it) and gives back their tokens.
func (l *leanLease) sweep(now int64) {
	l.mu.Lock()
	n := 0
	for n < len(l.expiring) && l.expiring[n].at <= now {
		n++
	}
	due := l.expiring[:n:n]
	l.expiring = l.expiring[n:]
	refunds := l.stale
	l.stale = nil
	l.mu.Unlock()
	for _, x := range due {
		x.e.mu.Lock()
		if x.e.expires != x.at || x.e.refilling {
			x.e.mu.Unlock() // leased again since: a later expiry
			continue
		}
		tokens, used := x.e.tokens, x.e.used
		x.e.tokens, x.e.gone = 0, true
		x.e.mu.Unlock()
		h := maphash.String(l.seed, x.key)
		sh := &l.shards[h%leanShards]
		sh.mu.Lock()
		if sh.m[x.key] == x.e {
			delete(sh.m, x.key)
		}
		sh.mu.Unlock()
		// Its sights through the entry were not the doorkeeper's: its last
		// one marks it, so that a key back within a lease's life of it
		// gets a lease.
		l.door[h&(leanDoorSlots-1)].Store(h>>32<<32 | uint64(uint32(used/1e6)))
		if tokens > 0 {
			refunds = append(refunds, leanRefund{key: x.key, tokens: tokens})
		}
	}
	for len(refunds) > 0 {
		k := min(len(refunds), leanMaxBatch)
		if err := l.batches.refund(refunds[:k]); err != nil {
			l.lost.Add(int64(k))
		}
		refunds = refunds[k:]
	}
}

// refund gives each refund's tokens back to its key's bucket in one
// script call. A refund lost to an error is tokens unused until the bucket
// refills: under-admission only, which Close reports.
func (c *leanContract) refund(refunds []leanRefund) error {
	keys := make([]string, 1+len(refunds))
	args := make([]any, len(c.head), len(c.head)+len(refunds))
	copy(args, c.head)
	for i, r := range refunds {
		keys[1+i] = c.namer.Key(r.key)
		args = append(args, r.tokens)
	}
	keys[0] = c.batchKey(keys[1])
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return leanRefundScript.Run(ctx, c.client, keys, args...).Err()
}

// Close stops the janitor and gives back every token still leased.
func (l *leanLease) Close() error {
	close(l.stop)
	<-l.done
	l.sweep(1<<62 - 1)
	err := l.calls.Close()
	if n := l.lost.Load(); n > 0 && err == nil {
		err = fmt.Errorf("design: %s: %d refunds lost to errors", LeanLease, n)
	}
	return err
}
