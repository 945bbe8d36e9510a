package breaker_test

import (
	"context"
	"errors"
	"log"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/breaker"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// Tune the breaker with WithBreaker, watch its state on the Client, and
// tell a call held back by the open breaker from other errors.
func Example() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	c, err := leaselimit.NewClient(rdb, leaselimit.WithBreaker(breaker.Settings{
		Failures: 3,           // consecutive failures that open it
		OpenFor:  time.Second, // then a probe a second
	}))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	if c.BreakerState() == breaker.Open {
		log.Print("Redis unavailable: the failure policy decides")
	}
	api := c.Limiter(policy.PerMinute(100).WithName("api"))
	if _, err := api.Peek(context.Background(), "user:42"); errors.Is(err, breaker.ErrOpen) {
		log.Print("Peek held back: the breaker is open")
	}
}
