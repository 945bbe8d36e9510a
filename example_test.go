package leaselimit_test

import (
	"context"
	"fmt"
	"log"
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

	c, err := leaselimit.NewClient(rdb)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close() // gives back the leased tokens

	// Name every limit: the name is part of its Redis keys, so limits of
	// different services or purposes never share buckets.
	lim := c.Limiter(policy.PerMinute(3).WithName("api"))
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

// Plans and tiers: one Client, a limit per request. Client.Limiter is cheap
// enough to call per request (no lock, no allocation once a limit has been
// used). Peek reads what is left without taking it; Reset makes a bucket
// full again, for every instance.
func ExampleClient_Limiter() {
	mr, _ := miniredis.Run() // an embedded Redis for the example; use your own
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	plans := map[string]policy.Limit{
		"free": policy.PerMinute(2).WithName("free"),
		"pro":  policy.PerMinute(100).WithName("pro"),
	}
	c, err := leaselimit.NewClient(rdb)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	ctx := context.Background()
	allow := func(user, plan string) {
		d, err := c.Limiter(plans[plan]).Allow(ctx, user)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s on %s: allowed %v, %d left\n", user, plan, d.Allowed, d.Remaining)
	}
	allow("ann", "free")
	allow("ann", "free")
	allow("ann", "free")
	allow("ann", "pro") // upgraded: the pro limit's own bucket decides, full

	p, err := c.Limiter(plans["free"]).Peek(ctx, "ann")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("free bucket of ann: %d left, next token in %v\n", p.Remaining, p.RetryAfter.Round(time.Second))

	if err := c.Limiter(plans["free"]).Reset(ctx, "ann"); err != nil {
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

// Views on one Client with their own failure policy: while Redis is
// unavailable, the login limit denies (a guessed password must not get
// through) and the search limit admits (an outage must not take search
// down). Both decisions come from the failure policy, not errors.
func ExampleLimiter_With() {
	mr, _ := miniredis.Run() // an embedded Redis for the example; use your own
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	c, err := leaselimit.NewClient(rdb) // FailOpen: the default of every view
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	// Make the views once and keep them: With allocates.
	login := c.Limiter(policy.PerMinute(5).WithName("login")).With(leaselimit.WithFailureMode(policy.FailClosed))
	search := c.Limiter(policy.PerSecond(50).WithName("search"))

	mr.Close() // Redis goes away
	ctx := context.Background()
	for _, v := range []struct {
		name string
		lim  *leaselimit.Limiter
	}{{"login", login}, {"search", search}} {
		d, err := v.lim.Allow(ctx, "user:42")
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s: allowed %v (%v)\n", v.name, d.Allowed, d.Source)
	}
	// Output:
	// login: allowed false (fallback)
	// search: allowed true (fallback)
}
