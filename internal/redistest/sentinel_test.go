package redistest_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/internal/redistest"
)

func TestSentinelFailover(t *testing.T) {
	s := redistest.StartSentinel(t, 1, 3)
	if s.MasterName != redistest.SentinelMasterName || len(s.Replicas) != 1 || len(s.Sentinels) != 3 {
		t.Fatalf("MasterName %q, %d replicas, %d Sentinels; want %q, 1, 3",
			s.MasterName, len(s.Replicas), len(s.Sentinels), redistest.SentinelMasterName)
	}
	if got := s.SentinelAddrs(); !slices.Equal(got, addrs(s.Sentinels)) {
		t.Fatalf("SentinelAddrs = %v, want %v", got, addrs(s.Sentinels))
	}
	if got := s.CurrentMaster(t); got != s.Master.Addr {
		t.Fatalf("CurrentMaster = %s, want %s", got, s.Master.Addr)
	}
	if s.Lookup(s.Master.Addr) != s.Master || s.Lookup(s.Replicas[0].Addr) != s.Replicas[0] || s.Lookup("127.0.0.1:1") != nil {
		t.Error("Lookup does not map addresses to the master and replica")
	}
	// The Sentinels are real Sentinels.
	if got, _ := s.Sentinels[0].Do(t, "SENTINEL", "CKQUORUM", s.MasterName).(string); !strings.HasPrefix(got, "OK") {
		t.Errorf("SENTINEL CKQUORUM = %q", got)
	}

	cl := s.FailoverClient(t)
	ctx := ctxTimeout(t, 2*time.Minute)
	writeKeys(t, ctx, cl)
	checkKeys(t, ctx, cl)
	if n, _ := s.Master.Do(t, "DBSIZE").(int64); n != clusterKeys {
		t.Fatalf("master holds %d keys, want %d", n, clusterKeys)
	}
	waitReplicated(t, s.Master)

	old := s.Master.Addr
	killed := time.Now()
	s.Master.Kill(t)
	master := s.WaitFailover(t, old)
	switched := time.Since(killed)
	if master != s.Replicas[0].Addr {
		t.Fatalf("WaitFailover = %s, want the replica %s", master, s.Replicas[0].Addr)
	}
	if got := s.CurrentMaster(t); got != master {
		t.Errorf("CurrentMaster = %s after the failover, want %s", got, master)
	}
	if role, _ := s.Lookup(master).Do(t, "ROLE").([]any); len(role) == 0 || role[0] != "master" {
		t.Errorf("ROLE of the new master = %v", role)
	}

	// The client finds the new master through the Sentinels, with the data
	// the replica had acknowledged.
	recovered := waitWritable(t, cl, key(0))
	t.Logf("killed master %s: Sentinels switched to %s after %v, client writing again after %v (down-after %v)",
		old, master, switched.Round(time.Millisecond), recovered.Sub(killed).Round(time.Millisecond),
		redistest.SentinelDownAfter)
	for i := 1; i < clusterKeys; i++ {
		got, err := cl.Get(ctx, key(i)).Result()
		if err != nil || got != value(i) {
			t.Fatalf("GET %s after the failover = %q, %v; want %q", key(i), got, err, value(i))
		}
	}
	if got := s.Replicas[0].Do(t, "GET", key(0)); got != "after-failover" {
		t.Errorf("GET %s on the new master = %#v, want \"after-failover\"", key(0), got)
	}
}

// TestSentinelNoReplica checks a Sentinel setup without replicas, and that
// CurrentMaster skips a dead Sentinel.
func TestSentinelNoReplica(t *testing.T) {
	s := redistest.StartSentinel(t, 0, 1)
	if len(s.Replicas) != 0 || len(s.Sentinels) != 1 {
		t.Fatalf("%d replicas, %d Sentinels; want 0, 1", len(s.Replicas), len(s.Sentinels))
	}
	cl := s.FailoverClient(t)
	ctx := ctxTimeout(t, 30*time.Second)
	if err := cl.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got := s.Master.Do(t, "GET", "k"); got != "v" {
		t.Fatalf("GET k on the master = %#v, want \"v\"", got)
	}
	// A restarted Sentinel keeps monitoring the master from its saved config.
	s.Sentinels[0].Restart(t)
	if got := s.CurrentMaster(t); got != s.Master.Addr {
		t.Fatalf("CurrentMaster after restarting the Sentinel = %s, want %s", got, s.Master.Addr)
	}
}
