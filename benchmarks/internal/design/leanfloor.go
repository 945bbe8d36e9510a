package design

import (
	"context"
	"fmt"
	"sync"

	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// The lean floor: the simplest correct batched token bucket, with no
// feature at all (no leases, no breaker, no budget, no telemetry, no
// request ids, no quotas, no multi-limits). Concurrent calls on one client
// travel together: the first caller that finds no batch in flight sends
// everything queued in one script call (up to leanMaxBatch keys), on its
// own goroutine; the others wait for its reply. The script reads Redis's
// clock once per batch and, per call, GETs "<tokens> <fraction> <µs>",
// refills in integers and SETs it back with a TTL, deciding calls on one
// key in order. It is what any batched Redis token bucket must do on this
// machine, so the rate it reaches is the floor every design is measured
// against: a design's share of it says how much of its cost is its own.

// leanMaxBatch bounds one script call: Redis runs a script to its end
// before serving anything else.
const leanMaxBatch = 64

// leanMaxInFlight is how many batches one client may have in flight at
// once: two keeps the connection pool busy while a batch is built.
const leanMaxInFlight = 2

// leanBucketAt is the lean scripts' reading of bucket k at now, inside
// their loop over the calls: w whole tokens and f/p of the next at t µs,
// refilled to now in integers and capped at burst (a missing key is a full
// bucket).
const leanBucketAt = `
  local v = redis.call('GET', k)
  local w, f, t = burst, 0, now
  if v then
    local a, b, c = string.match(v, '^(%d+) (%d+) (%d+)$')
    w, f, t = tonumber(a), tonumber(b), tonumber(c)
  end
  if now > t and w < burst then
    local x = (now - t) * r + f
    local q = math.floor(x / p)
    if q >= burst - w then w, f = burst, 0 else w, f = w + q, x - q * p end
  end
  if now > t then t = now end
`

// leanScript decides one batch. ARGV: r, p (the limit as r tokens every p
// µs, reduced), burst. KEYS: one per call, repeats allowed. A bucket is
// "<w> <f> <t>": w whole tokens and f/p of the next at t µs. Returns one
// 0/1 per key.
var leanScript = redis.NewScript(`
local r, p, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local out = {}
for i = 1, #KEYS do
  local k = KEYS[i]
` + leanBucketAt + `  if w >= 1 then
    w = w - 1
    local ttl = math.ceil(((burst - w) * p - f) / r / 1000) + 1000
    redis.call('SET', k, string.format('%d %d %d', w, f, t), 'PX', ttl)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
`)

// leanCall is one decision waiting in a batch.
type leanCall struct {
	key string
	// cost is the tokens the call takes, all or none; 0 is 1. Only the
	// contract's batches read it (lean_lease's refills take 2).
	cost    int64
	allowed bool
	err     error
	done    chan struct{}
}

// leanBatches sends the batches of the lean designs (lean_floor and
// lean_handoff): the client and the limit's script arguments.
type leanBatches struct {
	client *redis.Client
	args   []any // r, p, burst: read-only, shared by all batches
}

func newLeanBatches(client *redis.Client, limit policy.Limit) (leanBatches, error) {
	r, p := reduced(limit.Rate, limit.PeriodMicros())
	// The script's products stay exact in Lua's doubles only well below
	// 2^53: elapsed µs × r, and burst × p.
	if limit.Burst > 1<<40/p || r > 1<<20 {
		return leanBatches{}, fmt.Errorf("design: %s: limit %v outside the lean floor's exact range", LeanFloor, limit)
	}
	return leanBatches{client: client, args: []any{r, p, limit.Burst}}, nil
}

// leanDecider batches the calls of the lean floor (and of the lean
// contract, which names its keys and sends its batches its own way).
type leanDecider struct {
	send  func(ctx context.Context, batch []*leanCall)
	keyOf func(key string) string // the Redis key of a caller's key

	mu       sync.Mutex
	queue    []*leanCall
	inflight int
}

func newLeanFloor(client *redis.Client, limit policy.Limit) (Decider, error) {
	b, err := newLeanBatches(client, limit)
	if err != nil {
		return nil, err
	}
	return &leanDecider{send: b.send, keyOf: func(key string) string { return "lean:" + key }}, nil
}

// reduced returns rate/period in lowest terms.
func reduced(rate, period int64) (int64, int64) {
	a, b := rate, period
	for b != 0 {
		a, b = b, a%b
	}
	return rate / a, period / a
}

func (d *leanDecider) Allow(ctx context.Context, key string) (Result, error) {
	c := &leanCall{key: d.keyOf(key), done: make(chan struct{})}
	d.mu.Lock()
	d.queue = append(d.queue, c)
	if d.inflight >= leanMaxInFlight {
		d.mu.Unlock()
		select {
		case <-c.done:
			return Result{Allowed: c.allowed}, c.err
		case <-ctx.Done():
			return Result{}, ctx.Err()
		}
	}
	d.inflight++
	d.mu.Unlock()
	// This caller leads: it sends batches until the queue is empty, its
	// own call among the first.
	for {
		d.mu.Lock()
		n := min(len(d.queue), leanMaxBatch)
		if n == 0 {
			d.inflight--
			d.mu.Unlock()
			break
		}
		batch := d.queue[:n:n]
		d.queue = d.queue[n:]
		d.mu.Unlock()
		d.send(ctx, batch)
	}
	<-c.done
	return Result{Allowed: c.allowed}, c.err
}

// send runs one batch and hands each call its outcome.
func (b leanBatches) send(ctx context.Context, batch []*leanCall) {
	keys := make([]string, len(batch))
	for i, c := range batch {
		keys[i] = c.key
	}
	out, err := leanScript.Run(context.WithoutCancel(ctx), b.client, keys, b.args...).Int64Slice()
	if err == nil && len(out) != len(batch) {
		err = fmt.Errorf("design: %s: %d replies for %d calls", LeanFloor, len(out), len(batch))
	}
	for i, c := range batch {
		if err != nil {
			c.err = err
		} else {
			c.allowed = out[i] == 1
		}
		close(c.done)
	}
}

func (d *leanDecider) Close() error { return nil }
