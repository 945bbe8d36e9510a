package redistest_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/internal/redistest"
)

// recoveryTimeout bounds how long a test waits for a client to work again
// after a failover. The helpers' own waits are bounded separately.
const recoveryTimeout = 30 * time.Second

// clusterKeys is the number of keys written by the cluster tests, enough for
// every master to get some.
const clusterKeys = 300

func key(i int) string   { return fmt.Sprintf("key-%d", i) }
func value(i int) string { return fmt.Sprintf("value-%d", i) }

// writeKeys sets clusterKeys keys through c.
func writeKeys(t *testing.T, ctx context.Context, c redis.UniversalClient) {
	t.Helper()
	for i := range clusterKeys {
		if err := c.Set(ctx, key(i), value(i), 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", key(i), err)
		}
	}
}

// checkKeys reads back the keys written by writeKeys through c.
func checkKeys(t *testing.T, ctx context.Context, c redis.UniversalClient) {
	t.Helper()
	for i := range clusterKeys {
		got, err := c.Get(ctx, key(i)).Result()
		if err != nil || got != value(i) {
			t.Fatalf("GET %s = %q, %v; want %q", key(i), got, err, value(i))
		}
	}
}

// waitWritable retries a SET through c until it succeeds, for at most
// recoveryTimeout, and returns when it did. Each attempt has its own short
// deadline, since a client may first hit a dead node.
func waitWritable(t *testing.T, c redis.UniversalClient, k string) time.Time {
	t.Helper()
	deadline := time.Now().Add(recoveryTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := c.Set(ctx, k, "after-failover", 0).Err()
		cancel()
		if err == nil {
			return time.Now()
		}
		if time.Now().After(deadline) {
			t.Fatalf("client still failing %v after the failover: %v", recoveryTimeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitReplicated waits until master's writes have reached at least one
// replica (WAIT), so that they survive a crash of master.
func waitReplicated(t *testing.T, master *redistest.Server) {
	t.Helper()
	if n, _ := master.Do(t, "WAIT", 1, 5000).(int64); n < 1 {
		t.Fatalf("WAIT on %s: %d replicas acknowledged, want at least 1", master.Addr, n)
	}
}

func TestClusterKeysSpread(t *testing.T) {
	c := redistest.StartCluster(t, 3, 1)
	if len(c.Nodes) != 6 || len(c.Addrs()) != 6 {
		t.Fatalf("%d nodes, %d addresses; want 6", len(c.Nodes), len(c.Addrs()))
	}
	for i, s := range c.Nodes {
		if c.Addrs()[i] != s.Addr || !strings.HasPrefix(s.Addr, "127.0.0.1:") {
			t.Errorf("Addrs()[%d] = %s, Nodes[%d].Addr = %s", i, c.Addrs()[i], i, s.Addr)
		}
		if _, err := os.Stat(filepath.Join(s.Dir, "nodes.conf")); err != nil {
			t.Errorf("node %s: %v", s.Addr, err)
		}
	}
	// Documented order: masters first (by slot), then their replicas.
	masters := c.Masters(t)
	if !slices.Equal(masters, c.Nodes[:3]) {
		t.Fatalf("Masters = %v, want Nodes[:3] = %v", addrs(masters), addrs(c.Nodes[:3]))
	}
	for i, m := range masters {
		if r := c.ReplicaOf(t, m); r != c.Nodes[3+i] {
			t.Errorf("ReplicaOf(%s) = %s, want Nodes[%d] = %s", m.Addr, r.Addr, 3+i, c.Nodes[3+i].Addr)
		}
	}
	if got := masters[0].Do(t, "CLUSTER", "KEYSLOT", "x"); got == nil {
		t.Fatal("CLUSTER KEYSLOT returned nil")
	}

	cl := c.Client(t)
	ctx := ctxTimeout(t, 60*time.Second)
	writeKeys(t, ctx, cl)
	checkKeys(t, ctx, cl)

	// The keys are spread over all masters, and MasterFor knows where.
	var total int64
	for _, m := range masters {
		n, _ := m.Do(t, "DBSIZE").(int64)
		t.Logf("master %s holds %d keys", m.Addr, n)
		if n == 0 {
			t.Errorf("master %s holds no keys", m.Addr)
		}
		total += n
	}
	if total != clusterKeys {
		t.Errorf("masters hold %d keys in all, want %d", total, clusterKeys)
	}
	for i := range 30 {
		m := c.MasterFor(t, key(i))
		if got := m.Do(t, "GET", key(i)); got != value(i) {
			t.Errorf("GET %s on MasterFor = %s: %#v, want %q", key(i), m.Addr, got, value(i))
		}
	}
	// Keys sharing a hash tag share a master.
	if a, b := c.MasterFor(t, "{user}:a"), c.MasterFor(t, "{user}:b"); a != b {
		t.Errorf("MasterFor({user}:a) = %s, MasterFor({user}:b) = %s", a.Addr, b.Addr)
	}
	c.WaitHealthy(t) // a no-op on a healthy cluster
}

func TestClusterManualFailover(t *testing.T) {
	c := redistest.StartCluster(t, 3, 1)
	cl := c.Client(t)
	ctx := ctxTimeout(t, 2*time.Minute)
	writeKeys(t, ctx, cl)

	k := key(0)
	oldMaster := c.MasterFor(t, k)
	replica := c.ReplicaOf(t, oldMaster)
	start := time.Now()
	c.Failover(t, replica)
	t.Logf("manual failover %s -> %s took %v", oldMaster.Addr, replica.Addr, time.Since(start).Round(time.Millisecond))

	if got := c.MasterFor(t, k); got != replica {
		t.Fatalf("MasterFor(%s) = %s after Failover, want %s", k, got.Addr, replica.Addr)
	}
	if got := c.ReplicaOf(t, replica); got != oldMaster {
		t.Errorf("ReplicaOf(new master) = %s, want the old master %s", got.Addr, oldMaster.Addr)
	}
	masters := c.Masters(t)
	if len(masters) != 3 || !slices.Contains(masters, replica) || slices.Contains(masters, oldMaster) {
		t.Errorf("Masters = %v after failing %s over to %s", addrs(masters), oldMaster.Addr, replica.Addr)
	}

	// A manual failover loses nothing, and the client follows the MOVED
	// redirections without errors.
	checkKeys(t, ctx, cl)
	if err := cl.Set(ctx, k, "new", 0).Err(); err != nil {
		t.Fatalf("SET after failover: %v", err)
	}
	if got := replica.Do(t, "GET", k); got != "new" {
		t.Errorf("GET %s on the new master = %#v, want \"new\"", k, got)
	}

	// And back again.
	c.Failover(t, oldMaster)
	if got := c.MasterFor(t, k); got != oldMaster {
		t.Fatalf("MasterFor(%s) = %s after failing back, want %s", k, got.Addr, oldMaster.Addr)
	}
	if got, err := cl.Get(ctx, k).Result(); err != nil || got != "new" {
		t.Fatalf("GET %s after failing back = %q, %v; want \"new\"", k, got, err)
	}
}

func TestClusterKillMaster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 1)
	cl := c.Client(t)
	ctx := ctxTimeout(t, 2*time.Minute)
	writeKeys(t, ctx, cl)

	k := key(0)
	master := c.MasterFor(t, k)
	replica := c.ReplicaOf(t, master)
	waitReplicated(t, master)
	// WAIT has been seen to return while the replica still held none of
	// the keys (its log: an election at "offset 0" after the kill, DBSIZE 1
	// once promoted): wait until it holds as many keys as its master.
	want := master.Do(t, "DBSIZE")
	deadline := time.Now().Add(5 * time.Second)
	for got := replica.Do(t, "DBSIZE"); got != want; got = replica.Do(t, "DBSIZE") {
		if time.Now().After(deadline) {
			t.Fatalf("replica %s holds %v keys, its master %s %v", replica.Addr, got, master.Addr, want)
		}
		time.Sleep(10 * time.Millisecond)
	}

	killed := time.Now()
	master.Kill(t)
	c.WaitPromoted(t, replica)
	promoted := time.Since(killed)
	if got := c.MasterFor(t, k); got != replica {
		t.Fatalf("MasterFor(%s) = %s after the failover, want %s", k, got.Addr, replica.Addr)
	}
	masters := c.Masters(t)
	if len(masters) != 3 || !slices.Contains(masters, replica) || slices.Contains(masters, master) {
		t.Errorf("Masters = %v after %s died", addrs(masters), master.Addr)
	}

	// go-redis does not reload its slot map on connection errors (see
	// Cluster.Client), so it may still be routing the key to the dead node.
	probe, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	err := cl.Set(probe, k, "before-reload", 0).Err()
	cancel()
	t.Logf("SET %s with the slot map from before the failover: %v", k, err)
	cl.ReloadState(ctx)
	recovered := waitWritable(t, cl, k)
	t.Logf("killed master %s: %s promoted and cluster healthy after %v, client writing again after %v (cluster-node-timeout %v)",
		master.Addr, replica.Addr, promoted.Round(time.Millisecond),
		recovered.Sub(killed).Round(time.Millisecond), redistest.ClusterNodeTimeout)
	// The writes acknowledged by the replica survived.
	for i := 1; i < clusterKeys; i++ {
		got, err := cl.Get(ctx, key(i)).Result()
		if err != nil || got != value(i) {
			owner := c.MasterFor(t, key(i))
			direct, derr := owner.Do(t, "GET", key(i)), error(nil)
			t.Fatalf("GET %s after the failover = %q, %v; want %q (its master %s (killed %s, promoted %s) holds %v, %v; DBSIZE %v)",
				key(i), got, err, value(i), owner.Addr, master.Addr, replica.Addr, direct, derr, owner.Do(t, "DBSIZE"))
		}
	}

	// The old master comes back as a replica of the new one.
	master.Restart(t)
	c.WaitHealthy(t)
	if got := c.ReplicaOf(t, replica); got != master {
		t.Errorf("ReplicaOf(new master) = %s after restarting the old master, want %s", got.Addr, master.Addr)
	}
	if got, err := cl.Get(ctx, k).Result(); err != nil || got != "after-failover" {
		t.Fatalf("GET %s = %q, %v; want \"after-failover\"", k, got, err)
	}
}

// TestStartClusterWithoutCLI checks that StartCluster skips the test when
// redis-server is on PATH but redis-cli is not.
func TestStartClusterWithoutCLI(t *testing.T) {
	server, err := exec.LookPath(redistest.Binary)
	if err != nil {
		if os.Getenv(redistest.RequireEnv) == "1" {
			t.Fatal("redis-server not on PATH")
		}
		t.Skip("redis-server not on PATH")
	}
	dir := t.TempDir()
	if err := os.Symlink(server, filepath.Join(dir, redistest.Binary)); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir)
	t.Setenv(redistest.RequireEnv, "")
	f := &fakeTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		redistest.StartCluster(f, 3, 0)
		t.Error("StartCluster returned without redis-cli")
	}()
	<-done
	if f.fatal != "" || !strings.Contains(f.skipped, "redis-cli not on PATH") {
		t.Errorf("skipped = %q, fatal = %q; want a skip", f.skipped, f.fatal)
	}
}

// addrs returns the addresses of servers, for messages.
func addrs(servers []*redistest.Server) []string {
	out := make([]string, len(servers))
	for i, s := range servers {
		out[i] = s.Addr
	}
	return out
}
