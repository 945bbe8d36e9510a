// Package design wraps the rate-limiter designs that the benchmarks compare
// behind one small interface, so the Go benchmarks and cmd/compare drive
// them with the same code:
//
//   - redis_rate: github.com/go-redis/redis_rate/v10, a GCRA Lua script
//     (EVALSHA) on every decision.
//   - lua_per_request: a minimal classic token-bucket Lua script of our own
//     (HMGET, refill, HSET, PEXPIRE on Redis's TIME), one EVALSHA on every
//     decision. It is the textbook "Lua token bucket per request" design,
//     written here so that it shares no code with leaselimit.
//   - lean_floor: the simplest correct batched token bucket (see
//     leanfloor.go): what any batched Redis design must do, so the floor
//     the others are measured against.
//   - lean_handoff: the floor with its batches sent by long-lived senders,
//     as a time budget needs on a client with go-redis's default options
//     (see leanhandoff.go).
//   - lean_contract: the floor with only what leaselimit's contract makes
//     every design pay: its key names, resend safety per batch, a cost per
//     call in and two values per call back, a key repeated in a batch read
//     and written once (see leancontract.go).
//   - leaselimit_exact: leaselimit with WithoutLease(): every decision is one
//     call of leaselimit's own acquire script, through its breaker and time
//     budget.
//   - leaselimit_lease: leaselimit with its default leases.
package design

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"

	"github.com/go-redis/redis_rate/v10"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// Names of the designs, in the order they are reported.
const (
	RedisRate       = "redis_rate"
	LuaPerRequest   = "lua_per_request"
	LeanFloor       = "lean_floor"
	LeanHandoff     = "lean_handoff"
	LeanContract    = "lean_contract"
	LeaselimitExact = "leaselimit_exact"
	LeaselimitLease = "leaselimit_lease"
)

// Names lists every design, baseline first.
var Names = []string{RedisRate, LuaPerRequest, LeanFloor, LeanHandoff, LeanContract, LeaselimitExact, LeaselimitLease}

// Result is the outcome of one decision.
type Result struct {
	Allowed bool
	// Fallback is true when leaselimit's failure policy decided because
	// Redis did not answer within its budget (SourceFallback), or a lean
	// hand-off design (lean_handoff, lean_necessary) denied a call whose
	// reply it waited for past its budget. Such a decision did not consult
	// Redis, so a benchmark that counts it as a normal decision flatters
	// the design; callers report how many there were.
	Fallback bool
}

// Decider makes rate-limit decisions for keys under one limit.
type Decider interface {
	Allow(ctx context.Context, key string) (Result, error)
	// Close releases what the decider holds (leaselimit refunds leased tokens
	// and stops its goroutine). It does not close the Redis client.
	Close() error
}

// New returns the named design on client, enforcing limit. Buckets of
// different designs never share Redis keys (each design has its own key
// prefix), but two deciders of the same design on the same key do: that is
// how several instances share one limit.
func New(name string, client *redis.Client, limit policy.Limit) (Decider, error) {
	if err := limit.Validate(); err != nil {
		return nil, err
	}
	switch name {
	case RedisRate:
		return newRedisRate(client, limit)
	case LuaPerRequest:
		return newLua(client, limit), nil
	case LeanFloor:
		return newLeanFloor(client, limit)
	case LeanHandoff:
		return newLeanHandoff(client, limit)
	case LeanContract:
		return newLeanContract(client, limit)
	case LeanNecessary:
		return newLeanNecessary(client, limit)
	case LeanLease:
		return newLeanLease(client, limit)
	case LeaselimitAuthority:
		return newAuthorityLayer(client, limit)
	case LeaselimitPath:
		return newPathLayer(client, limit)
	case LeaselimitExact:
		return NewLeaselimit(client, limit, leaselimit.WithoutLease(), leaselimit.WithPrefix("ll-exact"))
	case LeaselimitLease:
		return NewLeaselimit(client, limit, leaselimit.WithPrefix("ll-lease"))
	}
	return nil, fmt.Errorf("design: unknown design %q (want one of %v or %v)", name, Names, Layers)
}

// leaseDecider adapts a leaselimit.Limiter of a Client of its own.
type leaseDecider struct {
	c *leaselimit.Client
	l *leaselimit.Limiter
}

// NewLeaselimit returns leaselimit deciding limit on a Client of its own on
// client, any go-redis client (the Cluster benchmark's too).
func NewLeaselimit(client redis.UniversalClient, limit policy.Limit, opts ...leaselimit.Option) (Decider, error) {
	c, err := leaselimit.NewClient(client, opts...)
	if err != nil {
		return nil, err
	}
	return leaseDecider{c: c, l: c.Limiter(limit)}, nil
}

func (d leaseDecider) Allow(ctx context.Context, key string) (Result, error) {
	dec, err := d.l.Allow(ctx, key)
	if err != nil {
		return Result{}, err
	}
	return Result{Allowed: dec.Allowed, Fallback: dec.Source == leaselimit.SourceFallback}, nil
}

func (d leaseDecider) Close() error { return d.c.Close() }

// redisRateDecider adapts redis_rate.
type redisRateDecider struct {
	l     *redis_rate.Limiter
	limit redis_rate.Limit
}

func newRedisRate(client *redis.Client, limit policy.Limit) (Decider, error) {
	rl := redis_rate.Limit{Rate: int(limit.Rate), Burst: int(limit.Burst), Period: limit.Period}
	if int64(rl.Rate) != limit.Rate || int64(rl.Burst) != limit.Burst {
		return nil, errors.New("design: limit does not fit redis_rate's int fields")
	}
	return &redisRateDecider{l: redis_rate.NewLimiter(client), limit: rl}, nil
}

func (d *redisRateDecider) Allow(ctx context.Context, key string) (Result, error) {
	res, err := d.l.Allow(ctx, key, d.limit)
	if err != nil {
		return Result{}, err
	}
	return Result{Allowed: res.Allowed > 0}, nil
}

func (d *redisRateDecider) Close() error { return nil }

// tokenBucket is the lua_per_request design: the classic token bucket in one
// script. The bucket is a hash {tokens, ts}; ts is in microseconds of Redis's
// clock, and a missing key is a full bucket. A denial writes nothing.
//
// ARGV: tokens per microsecond (float), burst, cost. Returns 1 or 0.
var tokenBucket = redis.NewScript(`
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local s = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(s[1]) or burst
local ts = tonumber(s[2]) or now
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate)
  ts = now
end
if tokens < cost then
  return 0
end
tokens = tokens - cost
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', ts)
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate / 1000) + 1000)
return 1
`)

type luaDecider struct {
	client *redis.Client
	args   []any // rate per µs, burst, cost; read-only, shared by all calls
}

func newLua(client *redis.Client, limit policy.Limit) Decider {
	perMicro := float64(limit.Rate) / float64(limit.PeriodMicros())
	return &luaDecider{
		client: client,
		args: []any{
			strconv.FormatFloat(perMicro, 'g', -1, 64),
			strconv.FormatInt(limit.Burst, 10),
			"1",
		},
	}
}

func (d *luaDecider) Allow(ctx context.Context, key string) (Result, error) {
	n, err := tokenBucket.Run(ctx, d.client, []string{"lua-tb:" + key}, d.args...).Int()
	if err != nil {
		return Result{}, err
	}
	return Result{Allowed: n == 1}, nil
}

func (d *luaDecider) Close() error { return nil }

// Counter is a go-redis hook that counts the commands a client sends to Redis
// (each command of a pipeline counts once; connection handshakes are not
// counted). Unlike Redis's total_commands_processed it does not count the
// commands that scripts run inside Redis, so it is the number of requests a
// design makes.
type Counter struct{ n atomic.Int64 }

// Load returns the number of commands counted so far.
func (c *Counter) Load() int64 { return c.n.Load() }

// DialHook implements redis.Hook.
func (c *Counter) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (c *Counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook.
func (c *Counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}

// ContextTimeoutEnabled is go-redis's option of that name for every client
// NewClient makes (the harness's -context-timeout): with it, leaselimit
// makes its calls on the caller's goroutine, bounded by their deadline;
// without it (go-redis's default), its lanes' senders carry them.
var ContextTimeoutEnabled bool

// NewClient returns a go-redis client for addr with default options (but
// ContextTimeoutEnabled), its commands counted by c (which may be nil).
func NewClient(addr string, c *Counter) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: ContextTimeoutEnabled})
	if c != nil {
		rdb.AddHook(c)
	}
	return rdb
}
