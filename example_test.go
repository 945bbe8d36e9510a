package leaselimit_test

import (
	"context"
	"fmt"
	"log"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

func Example() {
	mr, _ := miniredis.Run() // an embedded Redis for the example; use your own
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	// Name every limit: the name is part of its Redis keys, so limits of
	// different services or purposes never share buckets.
	lim, err := leaselimit.New(rdb, policy.PerMinute(3).WithName("api"))
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()

	for i := 0; i < 4; i++ {
		d, err := lim.Allow(context.Background(), "user:42")
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(d.Allowed, d.Remaining)
	}
	// Output:
	// true 2
	// true 1
	// true 0
	// false 0
}
