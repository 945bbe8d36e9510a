package authority_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// The authority is the token bucket in Redis: one atomic script call per
// acquisition, on Redis's clock. (A Limiter uses it for you.)
func Example() {
	mr, _ := miniredis.Run() // an embedded Redis for the example
	defer mr.Close()
	mr.SetTime(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)) // its clock stands still
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	auth, err := authority.New(rdb, "example")
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx := context.Background()
	l := policy.Limit{Name: "api", Rate: 10, Period: time.Minute, Burst: 10}
	key := auth.Key(l, "user:42") // the user key appears only as a digest
	g, err := auth.Acquire(ctx, key, l, 4, 1, 1)
	fmt.Println(g.Granted, g.Remaining, err)
	g, err = auth.Acquire(ctx, key, l, 8, 8, 1) // 8 or nothing: 6 are left
	fmt.Println(g.Granted, g.Remaining, g.RetryAfter, err)
	// Output:
	// 4 6 <nil>
	// 0 6 12s <nil>
}
