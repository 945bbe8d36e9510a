package leaselimit_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os"
	"time"

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

// Plans and tiers: one engine, a limit per request. For is cheap enough to
// call per request (no lock, no allocation once a limit has been used).
// Peek reads what is left without taking it; Reset makes a bucket full
// again, for every instance.
func ExampleLimiter_For() {
	mr, _ := miniredis.Run() // an embedded Redis for the example; use your own
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	plans := map[string]policy.Limit{
		"free": policy.PerMinute(2).WithName("free"),
		"pro":  policy.PerMinute(100).WithName("pro"),
	}
	lim, err := leaselimit.New(rdb, plans["free"])
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close() // closes the Limiters For made, too

	ctx := context.Background()
	allow := func(user, plan string) {
		d, err := lim.For(plans[plan]).Allow(ctx, user)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s on %s: allowed %v, %d left\n", user, plan, d.Allowed, d.Remaining)
	}
	allow("ann", "free")
	allow("ann", "free")
	allow("ann", "free")
	allow("ann", "pro") // upgraded: the pro limit's own bucket decides, full

	p, err := lim.For(plans["free"]).Peek(ctx, "ann")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("free bucket of ann: %d left, next token in %v\n", p.Remaining, p.RetryAfter.Round(time.Second))

	if err := lim.For(plans["free"]).Reset(ctx, "ann"); err != nil {
		log.Fatal(err)
	}
	allow("ann", "free")
	// Output:
	// ann on free: allowed true, 1 left
	// ann on free: allowed true, 0 left
	// ann on free: allowed false, 0 left
	// ann on pro: allowed true, 99 left
	// free bucket of ann: 0 left, next token in 30s
	// ann on free: allowed true, 1 left
}

func ExampleNewRedisLogger() {
	// A handler without the time, so that the output is stable.
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return a
		},
	}))
	rl := leaselimit.NewRedisLogger(logger)
	// In a program, hand it to go-redis once, at start-up (go-redis has one
	// logger per process; leaselimit never sets it):
	//
	//	redis.SetLogger(rl)
	//
	// go-redis then calls its Printf; here, as go-redis does while Redis is
	// down, several times in a row:
	for range 3 {
		rl.Printf(context.Background(), "redis: connection pool: failed to dial after %d attempts: %v", 5,
			"dial tcp 10.0.0.7:6379: connect: connection refused")
	}
	// Output:
	// level=WARN msg="redis: connection pool: failed to dial after 5 attempts: dial tcp 10.0.0.7:6379: connect: connection refused" logger=go-redis
}
