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
	} {
		if got := Is(tc.client); got != tc.want {
			t.Errorf("Is(%s) = %v; want %v", tc.name, got, tc.want)
		}
	}
}
