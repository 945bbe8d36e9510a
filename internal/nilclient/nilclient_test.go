package nilclient

import (
	"testing"

	"github.com/redis/go-redis/v9"
)

func TestIs(t *testing.T) {
	var (
		single  *redis.Client
		cluster *redis.ClusterClient
		ring    *redis.Ring
	)
	for _, tc := range []struct {
		name   string
		client redis.UniversalClient
		want   bool
	}{
		{"nil interface", nil, true},
		{"nil *Client", single, true},
		{"nil *ClusterClient", cluster, true},
		{"nil *Ring", ring, true},
		{"a client", redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), false},
		{"a Cluster client", redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}}), false},
		{"a Ring", redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}}), false},
		{"a failover client", redis.NewFailoverClient(&redis.FailoverOptions{MasterName: "m", SentinelAddrs: []string{"127.0.0.1:1"}}), false},
		{"a zero Client", new(redis.Client), true},
		{"a zero ClusterClient", new(redis.ClusterClient), true},
		{"a zero Ring", new(redis.Ring), true},
	} {
		if got := Is(tc.client); got != tc.want {
			t.Errorf("Is(%s) = %v; want %v", tc.name, got, tc.want)
		}
	}
}
