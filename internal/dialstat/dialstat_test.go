package dialstat

import (
	"testing"

	"github.com/redis/go-redis/v9"
)

func TestFailing(t *testing.T) {
	before := Of(&redis.PoolStats{Misses: 3, TotalConns: 2, StaleConns: 1})
	for _, tc := range []struct {
		name string
		now  redis.PoolStats
		want bool
	}{
		{"no dial needed", redis.PoolStats{Misses: 3, TotalConns: 2, StaleConns: 1}, false},
		{"needed, none opened", redis.PoolStats{Misses: 5, TotalConns: 2, StaleConns: 1}, true},
		{"needed, one opened", redis.PoolStats{Misses: 5, TotalConns: 3, StaleConns: 1}, false},
		{"opened, then removed at its deadline", redis.PoolStats{Misses: 4, TotalConns: 2, StaleConns: 2}, false},
		{"one removed, none needed", redis.PoolStats{Misses: 3, TotalConns: 1, StaleConns: 2}, false},
	} {
		if got := before.Failing(Of(&tc.now)); got != tc.want {
			t.Errorf("%s: Failing = %v; want %v", tc.name, got, tc.want)
		}
	}
}
