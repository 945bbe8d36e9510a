package redispath

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/internal/circuit"
)

// TestDoCutWhileBehind: a peek, reset or adjustment (Do) that its budget
// cuts is blamed on Redis only if this process was not behind: while
// Redis answers a pool's worth of other calls meanwhile (the process's own
// queue, see congested), the call ends with ErrSaturated and the breaker
// does not count it; with nothing answered it is Redis's failure. Both
// variants: in place (ContextTimeoutEnabled) and carried by a worker.
// Regression (a review): Do counted every cut call against Redis, and
// Settles on a flooded host opened the breaker while Redis answered, so
// FailOpen admitted up to 2,800 on a bucket of 300.
func TestDoCutWhileBehind(t *testing.T) {
	const budget = 20 * time.Millisecond
	unavailable := errors.New("unavailable")
	for _, cte := range []bool{true, false} {
		for _, answered := range []bool{true, false} {
			_, c := newMini(t, &redis.Options{ContextTimeoutEnabled: cte})
			auth, tel := authAndTel(t, c, "do-cut")
			p := New(Config{Client: c, Auth: auth, Budget: budget, Name: "do-cut", Unavailable: unavailable, Tel: tel,
				Breaker: circuit.Settings{Settings: breaker.Settings{Failures: 1, OpenFor: time.Hour}}})
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
			if !errors.Is(err, unavailable) {
				t.Errorf("ContextTimeoutEnabled %v, other calls answered %v: Do = %v; want it to wrap the unavailable error", cte, answered, err)
			}
			if cte && errors.Is(err, ErrSaturated) != answered {
				t.Errorf("ContextTimeoutEnabled %v, other calls answered %v: Do = %v; ErrSaturated %v, want %v", cte, answered, err, !answered, answered)
			}
			if open := brk.State() == breaker.Open; open == answered {
				t.Errorf("ContextTimeoutEnabled %v, other calls answered %v: breaker open %v; want %v", cte, answered, open, !answered)
			}
		}
	}
}
