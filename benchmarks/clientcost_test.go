package bench

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/benchmarks/internal/design"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// BenchmarkLoneClientCost measures what one decision of a lone caller on
// a cold key costs each design's client, Redis's round trip taken out: a
// script call is answered with the reply Redis gave that script's first
// call (see replay), so go-redis gets no connection, writes and reads
// nothing, and what is left is the design's own code and go-redis's
// building of the command. A lone caller's latency is this, go-redis's
// round trip (the same one EVALSHA for every design) and Redis's time; on
// a shared 2-core VM the round trip's noise hides a microsecond of this
// in an end-to-end run (cmd/compare -goroutines 1). Each decision is on a
// key not seen before (its name made in the loop, an allocation every
// design pays), as on the cold long tail.
//
//	go test -run '^$' -bench LoneClientCost -benchmem -count 5 .
func BenchmarkLoneClientCost(b *testing.B) {
	srv := redistest.Start(b)
	limit := policy.Limit{Name: "cost", Rate: 600, Period: time.Minute, Burst: 600}
	for _, name := range []string{design.RedisRate, design.LeanContract, design.LeaselimitAuthority,
		design.LeaselimitPath, design.LeaselimitExact, design.LeaselimitLease} {
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			// As the one-goroutine target is measured (cmd/compare
			// -context-timeout): leaselimit then calls Redis on the
			// caller's goroutine.
			rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true})
			defer rdb.Close()
			rp := &replay{replies: map[string]any{}}
			rdb.AddHook(rp)
			dec := newDecider(b, name, rdb, limit)
			defer closeDecider(b, dec)
			prefix := "cost:" + strconv.FormatInt(round.Add(1), 10) + ":"
			// The first calls go to Redis (the first may find the script
			// not cached: EVALSHA, then EVAL), until a reply is kept.
			for i := 0; rp.kept() == 0; i++ {
				if i == 3 {
					b.Fatal("no script reply kept: nothing would be replayed")
				}
				if r, err := dec.Allow(ctx, prefix+"first"+strconv.Itoa(i)); err != nil || !r.Allowed {
					b.Fatalf("first calls: %+v, %v", r, err)
				}
			}
			sent := rp.sent()
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				r, err := dec.Allow(ctx, prefix+strconv.Itoa(i))
				if err != nil || !r.Allowed {
					b.Fatalf("call %d: %+v, %v", i, r, err)
				}
			}
			b.StopTimer()
			if more := rp.sent() - sent; more > 0 {
				b.Fatalf("%d script calls reached Redis: the replay measured a round trip", more)
			}
		})
	}
}

// replay is a go-redis hook that answers every EVALSHA of a script whose
// first call Redis answered with that first reply, without sending it.
type replay struct {
	mu      sync.Mutex
	replies map[string]any // by the script's SHA
	nsent   int            // EVALSHAs sent to Redis
}

func (r *replay) DialHook(next redis.DialHook) redis.DialHook { return next }

func (r *replay) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (r *replay) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c, ok := cmd.(*redis.Cmd)
		args := cmd.Args()
		if !ok || cmd.Name() != "evalsha" || len(args) < 2 {
			return next(ctx, cmd)
		}
		sha, _ := args[1].(string)
		r.mu.Lock()
		v, seen := r.replies[sha]
		r.mu.Unlock()
		if seen {
			c.SetVal(v)
			return nil
		}
		err := next(ctx, cmd)
		r.mu.Lock()
		r.nsent++
		if err == nil {
			r.replies[sha] = c.Val()
		}
		r.mu.Unlock()
		return err
	}
}

// kept returns how many scripts' replies r keeps.
func (r *replay) kept() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.replies)
}

// sent returns how many EVALSHAs went to Redis.
func (r *replay) sent() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.nsent
}
