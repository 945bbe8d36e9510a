package policy_test

import (
	"fmt"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

func ExampleLimit() {
	api := policy.Limit{Name: "api", Rate: 100, Period: time.Second, Burst: 200}
	fmt.Println(api, api.Validate())
	fmt.Println(api.Interval(1)) // the refill time of one token

	bad := policy.PerSecond(0).WithName("broken")
	fmt.Println(bad.Validate())
	// Output:
	// api: 100/1s burst=200 <nil>
	// 10ms
	// policy: invalid limit: broken: rate 0 must be > 0
}

func ExampleQuota() {
	daily := policy.Quota("daily", 10_000, policy.Day, time.UTC)
	fmt.Println(daily, daily.Validate())
	end, next := daily.Calendar.Window(time.Date(2026, 12, 1, 15, 30, 0, 0, time.UTC))
	fmt.Println(end, next)
	// Output:
	// daily: 10000 per day in UTC <nil>
	// 2026-12-02 00:00:00 +0000 UTC 2026-12-03 00:00:00 +0000 UTC
}
