// Command quickstart is the README's quick start: one Client on a Redis
// server, one limit of 3 requests a minute per user, and four requests of
// one user, the fourth denied. Run it against a Redis of yours:
//
//	go run ./examples/quickstart -redis localhost:6379
//
// Its test runs it on an embedded Redis.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

func main() {
	addr := flag.String("redis", "localhost:6379", "Redis address")
	flag.Parse()
	// Any redis.UniversalClient: single node, Sentinel or Cluster.
	// ContextTimeoutEnabled lets a call to an idle Redis run on the
	// caller's goroutine, within the time budget.
	rdb := redis.NewClient(&redis.Options{Addr: *addr, ContextTimeoutEnabled: true})
	defer rdb.Close()
	if err := run(context.Background(), rdb, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, rdb redis.UniversalClient, out io.Writer) error {
	client, err := leaselimit.NewClient(rdb) // one per process; makes no Redis call
	if err != nil {
		return err
	}
	defer client.Close() // gives unused leased tokens back
	if err := client.Check(ctx); err != nil {
		return err // Redis unreachable, too old, or refusing the scripts (ACL)
	}

	api := client.Limiter(policy.PerMinute(3).WithName("api")) // name every limit
	for i := 1; i <= 4; i++ {
		d, err := api.Allow(ctx, "user:42")
		if err != nil {
			return err // an invalid key or limit, a closed Client, ctx done: never a denial or an outage
		}
		if !d.Allowed {
			fmt.Fprintf(out, "request %d: denied, retry in %v\n", i, d.RetryAfter.Round(time.Second))
			continue
		}
		fmt.Fprintf(out, "request %d: allowed, %d left\n", i, d.Remaining)
	}
	return nil
}
