package redispath

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/redistest"
)

// TestDoCutWhileBehind: a peek, reset or adjustment (Do) that its budget
// cuts is blamed on Redis only if Redis was failing: while Redis answers
// a pool's worth of other calls meanwhile (the process's own queue, see
// congested), the call ends with ErrSaturated and the breaker does not
// count it, and so it does while Redis answers the witness's own
// connection (see witness), the call's reply held up on its way; with
// nothing answered and Redis gone it is Redis's failure. Both
// variants: in place (ContextTimeoutEnabled) and carried by a worker.
// Regression (a review): Do counted every cut call against Redis, and
// Settles on a flooded host opened the breaker while Redis answered, so
// FailOpen admitted up to 2,800 on a bucket of 300.
func TestDoCutWhileBehind(t *testing.T) {
	const budget = 200 * time.Millisecond // time for the witness to dial and ask, under -race
	unavailable := errors.New("unavailable")
	for _, cte := range []bool{true, false} {
		for _, run := range []struct{ answered, up bool }{{true, true}, {false, true}, {false, false}} {
			answered, spared := run.answered, run.answered || run.up // spared: not Redis's failure
			m, c := newMini(t, &redis.Options{ContextTimeoutEnabled: cte})
			auth, tel := authAndTel(t, c, "do-cut")
			if !run.up {
				m.Close()
			}
			p := New(Config{Client: c, Auth: auth, Budget: budget, Name: "do-cut", Unavailable: unavailable, Tel: tel,
				Breaker: circuit.Settings{Settings: breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}}})
			brk := p.Shared()
			_, err := p.Do(context.Background(), brk, "k", func(ctx context.Context) error {
				if answered {
					for range p.Pool() { // Redis turned round other calls
						brk.CountReply()
					}
				}
				<-ctx.Done() // this call's own reply never read
				return ctx.Err()
			})
			p.Close()
			p.Wait() // the worker has told the breaker
			name := fmt.Sprintf("ContextTimeoutEnabled %v, other calls answered %v, Redis up %v", cte, answered, run.up)
			if !errors.Is(err, unavailable) {
				t.Errorf("%s: Do = %v; want it to wrap the unavailable error", name, err)
			}
			if cte && errors.Is(err, ErrSaturated) != spared {
				t.Errorf("%s: Do = %v; ErrSaturated %v, want %v", name, err, !spared, spared)
			}
			if open := brk.State() == breaker.Open; open == spared {
				t.Errorf("%s: breaker open %v; want %v", name, open, !spared)
			}
		}
	}
}

// TestWitnessWaitsForASlowRedis: a call the budget cuts while Redis
// answers, but a round trip of 20 or 30ms away (more than an eighth of the
// budget, less than half), is not Redis's failure: the witness waits for
// Redis's answer (see witnessWait) on a connection it made and kept (see
// witnessLife). Regressions: the witness gave Redis an eighth of the
// budget, and a busy 2-core host whose Redis answered in 13-22ms saw the
// breaker open while it answered, then FailOpen admit 0.7-2 million
// decisions on a bucket of 100; then, given half, it cut each ask there
// and so dropped its connection: every ask paid a dial and go-redis's
// handshake, and a Redis 26-40ms away never answered in time (a review:
// 36 of 36 breakers opened).
func TestWitnessWaitsForASlowRedis(t *testing.T) {
	const budget = 100 * time.Millisecond // the default: its eighth, 12.5ms, is less than the round trip
	for _, each := range []time.Duration{10 * time.Millisecond, 15 * time.Millisecond} {
		for _, cte := range []bool{true, false} {
			m, direct := newMini(t, nil)
			px := redistest.NewProxy(t, m.Addr())
			px.SetLatency(each) // each way
			c := redis.NewClient(&redis.Options{Addr: px.Addr, ContextTimeoutEnabled: cte})
			auth, tel := authAndTel(t, c, "slow-witness")
			p := New(Config{Client: c, Auth: auth, Budget: budget, Name: "slow-witness", Unavailable: errors.New("unavailable"), Tel: tel,
				Breaker: circuit.Settings{Settings: breaker.Settings{Failures: 1, OpenFor: breaker.MaxOpenFor}}})
			brk := p.Shared()
			_, err := p.Do(context.Background(), brk, "k", func(ctx context.Context) error {
				<-ctx.Done() // this call's own reply never read
				return ctx.Err()
			})
			p.Close()
			p.Wait()
			_ = c.Close()
			_ = direct.Close()
			if cte && !errors.Is(err, ErrSaturated) {
				t.Errorf("ContextTimeoutEnabled, Redis %v away: Do = %v; want ErrSaturated", 2*each, err)
			}
			if brk.State() == breaker.Open {
				t.Errorf("ContextTimeoutEnabled %v: the breaker opened while Redis answered, %v away", cte, 2*each)
			}
		}
	}
}
