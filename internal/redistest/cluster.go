package redistest

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// CLIBinary is the name of the Redis command-line client looked up on PATH;
// StartCluster needs it to create the cluster.
const CLIBinary = "redis-cli"

// ClusterNodeTimeout is the cluster-node-timeout of the nodes started by
// StartCluster. A master that does not answer for this long is flagged as
// failing, so an automatic failover after a crash takes a few times this.
const ClusterNodeTimeout = time.Second

const (
	// clusterSlots is the number of hash slots of a Redis Cluster.
	clusterSlots = 16384
	// waitTimeout bounds WaitHealthy, WaitPromoted, Failover, MasterFor and
	// the Sentinel waits.
	waitTimeout = 30 * time.Second
	// createTimeout bounds `redis-cli --cluster create`.
	createTimeout = 60 * time.Second
	// queryTimeout bounds each of the short-lived connections used to poll
	// the nodes.
	queryTimeout = 2 * time.Second
	// pollInterval is the pause between two polls.
	pollInterval = 50 * time.Millisecond
	// manualFailoverRetry is how long Failover waits for a CLUSTER FAILOVER to
	// complete before sending it again. Redis aborts a manual failover that
	// has not completed in 5 seconds.
	manualFailoverRetry = 6 * time.Second
)

// Cluster is a Redis Cluster started by StartCluster. Its methods must be
// called from the goroutine running the test (they may call tb.Fatal).
//
// The nodes are ordinary Servers, so faults are injected with their own
// methods: Kill, Pause, Resume and Restart. A restarted node keeps its
// cluster identity (its nodes.conf stays in its Dir) and rejoins the
// cluster, but like any restarted Server it has lost its data; if it was
// failed over while down it comes back as a replica and resynchronises.
type Cluster struct {
	// Nodes holds every node. Right after StartCluster, Nodes[:masters] are
	// the masters, ordered by the hash slots they serve (Nodes[0] serves slot
	// 0), and Nodes[masters:] are the replicas: first those of Nodes[0], then
	// those of Nodes[1], and so on. Failovers change the roles but not this
	// order; use Masters, MasterFor and ReplicaOf for the current roles.
	Nodes []*Server

	ids map[*Server]string // cluster node ID of each node; kept across Restart
}

// StartCluster starts a Redis Cluster of masters masters (at least 3, as
// redis-cli requires), each with replicas replicas, and returns once it is
// healthy (see WaitHealthy) and every replica is in sync with its master.
//
// Each node is a Server started as by Start, in its own directory, with
// --cluster-enabled yes, --cluster-config-file nodes.conf,
// --cluster-node-timeout ClusterNodeTimeout, --cluster-replica-validity-factor
// 0 (a replica always accepts to replace its failed master, however long it
// has been disconnected), --repl-diskless-sync-delay 0 (replicas sync at
// once) and a cluster bus port (--cluster-port) chosen free
// like the client port. The cluster is created with `redis-cli --cluster
// create ... --cluster-replicas replicas --cluster-yes`.
//
// The cleanup registered by each node stops it. If redis-server or redis-cli
// is not on PATH, StartCluster skips the test, or fails it when the
// environment variable LEASELIMIT_REQUIRE_REDIS is "1".
func StartCluster(tb testing.TB, masters, replicas int) *Cluster {
	tb.Helper()
	if masters < 3 || replicas < 0 {
		tb.Fatalf("redistest: StartCluster(%d, %d): need at least 3 masters and no negative replica count", masters, replicas)
	}
	lookBinary(tb, Binary)
	cli := lookBinary(tb, CLIBinary)

	args := []string{
		"--cluster-enabled", "yes",
		"--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", strconv.FormatInt(ClusterNodeTimeout.Milliseconds(), 10),
		"--cluster-replica-validity-factor", "0",
		"--repl-diskless-sync-delay", "0",
	}
	c := &Cluster{ids: make(map[*Server]string)}
	for range masters * (1 + replicas) {
		c.Nodes = append(c.Nodes, startServer(tb, serverConfig{args: args, portArgs: busPortArgs}))
	}

	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), createTimeout)
	defer cancel()
	cmdArgs := append([]string{"--cluster", "create"}, c.Addrs()...)
	cmdArgs = append(cmdArgs, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	cmd := exec.CommandContext(ctx, cli, cmdArgs...)
	cmd.WaitDelay = time.Second
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("redistest: %s %s: %v; output:\n%s", CLIBinary, strings.Join(cmdArgs, " "), err, out)
	}
	c.WaitHealthy(tb)

	// Record the node IDs and put the nodes in the documented order.
	first := make(map[*Server]int) // first slot served by each master
	var ms, rs []*Server
	masterOf := make(map[*Server]string) // master's node ID, for replicas
	for _, s := range c.Nodes {
		me, err := clusterMyself(s.Addr)
		if err != nil {
			tb.Fatalf("redistest: %v", err)
		}
		c.ids[s] = me.id
		if me.master {
			ms = append(ms, s)
			first[s] = me.firstSlot()
		} else {
			rs = append(rs, s)
			masterOf[s] = me.masterID
		}
	}
	if len(ms) != masters {
		tb.Fatalf("redistest: cluster created with %d masters, want %d", len(ms), masters)
	}
	sort.SliceStable(ms, func(i, j int) bool { return first[ms[i]] < first[ms[j]] })
	rank := make(map[string]int) // master node ID -> index in ms
	for i, m := range ms {
		rank[c.ids[m]] = i
	}
	sort.SliceStable(rs, func(i, j int) bool { return rank[masterOf[rs[i]]] < rank[masterOf[rs[j]]] })
	c.Nodes = append(ms, rs...)
	tb.Logf("redistest: cluster of %d masters and %d replicas ready (created in %v)",
		masters, masters*replicas, time.Since(start).Round(time.Millisecond))
	return c
}

// busPortArgs picks a free cluster bus port, other than port.
func busPortArgs(port int) ([]string, error) {
	for {
		bus, err := freePort()
		if err != nil {
			return nil, err
		}
		if bus != port {
			return []string{"--cluster-port", strconv.Itoa(bus)}, nil
		}
	}
}

// Addrs returns the addresses of all the nodes, in the order of Nodes.
func (c *Cluster) Addrs() []string {
	return addrsOf(c.Nodes)
}

// Client returns a new go-redis cluster client seeded with Addrs, with
// otherwise default options. It is closed by the test's cleanup (before the
// nodes are stopped).
//
// Mind how go-redis (v9.23) keeps its slot map: it reloads it after a MOVED
// or ASK reply, and otherwise only every ClusterStateReloadInterval (60
// seconds by default), but not after connection errors. A manual Failover is
// therefore picked up at once (the old master answers MOVED), whereas after a
// master has been killed the client keeps dialling the dead node for the
// slots it served until the interval has passed or ReloadState is called,
// even once a replica has taken over.
func (c *Cluster) Client(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// Masters returns the running nodes that currently are masters serving hash
// slots, each by its own account (CLUSTER NODES), ordered by the lowest slot
// they serve. Right after a topology change the nodes may not agree yet;
// call WaitHealthy first for a settled answer.
func (c *Cluster) Masters(tb testing.TB) []*Server {
	tb.Helper()
	var ms []*Server
	first := make(map[*Server]int)
	for _, s := range c.running() {
		me, err := clusterMyself(s.Addr)
		if err != nil {
			tb.Fatalf("redistest: Masters: %v", err)
		}
		if me.master && len(me.slots) > 0 {
			ms = append(ms, s)
			first[s] = me.firstSlot()
		}
	}
	sort.SliceStable(ms, func(i, j int) bool { return first[ms[i]] < first[ms[j]] })
	return ms
}

// MasterFor returns the node currently serving key: the running node that,
// by its own account, is the master of the key's hash slot (CLUSTER KEYSLOT).
// While no running node or more than one claims the slot, as happens during
// a failover, MasterFor waits, for at most 30 seconds.
func (c *Cluster) MasterFor(tb testing.TB, key string) *Server {
	tb.Helper()
	var slot = -1
	var owner *Server
	err := poll(waitTimeout, func() error {
		live := c.running()
		if len(live) == 0 {
			return errors.New("no node is running")
		}
		if slot < 0 {
			n, err := queryInt(live[0].Addr, "CLUSTER", "KEYSLOT", key)
			if err != nil {
				return err
			}
			slot = int(n)
		}
		var owners []*Server
		for _, s := range live {
			me, err := clusterMyself(s.Addr)
			if err != nil {
				return err
			}
			if me.master && me.serves(slot) {
				owners = append(owners, s)
			}
		}
		if len(owners) != 1 {
			return fmt.Errorf("slot %d is claimed by %d running nodes (%v)", slot, len(owners), addrsOf(owners))
		}
		owner = owners[0]
		return nil
	})
	if err != nil {
		tb.Fatalf("redistest: MasterFor(%q): %v", key, err)
	}
	return owner
}

// ReplicaOf returns a running replica of master (which may itself be down),
// by the replica's own account (CLUSTER NODES); if there are several, the
// first one in Nodes. It calls tb.Fatal if master has no running replica.
func (c *Cluster) ReplicaOf(tb testing.TB, master *Server) *Server {
	tb.Helper()
	id, ok := c.ids[master]
	if !ok {
		tb.Fatalf("redistest: ReplicaOf: %s is not a node of the cluster", master.Addr)
	}
	for _, s := range c.running() {
		me, err := clusterMyself(s.Addr)
		if err != nil {
			tb.Fatalf("redistest: ReplicaOf: %v", err)
		}
		if !me.master && me.masterID == id {
			return s
		}
	}
	tb.Fatalf("redistest: ReplicaOf: %s has no running replica", master.Addr)
	return nil
}

// Failover makes replica take over from its master with CLUSTER FAILOVER (a
// manual failover: the master stops accepting writes until the replica has
// caught up, so no acknowledged write is lost, and then becomes a replica of
// the new master). Failover waits until replica reports itself master of the
// slots and the cluster is healthy again (see WaitHealthy), for at most 30
// seconds plus the WaitHealthy bound, and logs how long it took. The master
// must be reachable; to simulate a crash, Kill it and call WaitPromoted.
func (c *Cluster) Failover(tb testing.TB, replica *Server) {
	tb.Helper()
	if !replica.running() {
		tb.Fatalf("redistest: Failover: %s is not running", replica.Addr)
	}
	me, err := clusterMyself(replica.Addr)
	if err != nil {
		tb.Fatalf("redistest: Failover: %v", err)
	}
	if me.master {
		tb.Fatalf("redistest: Failover: %s is already a master", replica.Addr)
	}
	start := time.Now()
	var sent time.Time
	err = poll(waitTimeout, func() error {
		me, err := clusterMyself(replica.Addr)
		if err != nil {
			return err
		}
		if me.master && len(me.slots) > 0 {
			return nil
		}
		// Redis aborts a manual failover that does not complete in time;
		// then ask again. A refusal (an error reply) is retried at once.
		if sent.IsZero() || time.Since(sent) > manualFailoverRetry {
			sent = time.Now()
			if _, err := query(replica.Addr, "CLUSTER", "FAILOVER"); err != nil {
				sent = time.Time{}
				return err
			}
		}
		return fmt.Errorf("%s is not master yet", replica.Addr)
	})
	if err != nil {
		tb.Fatalf("redistest: Failover to %s: %v", replica.Addr, err)
	}
	promoted := time.Since(start)
	c.WaitHealthy(tb)
	tb.Logf("redistest: CLUSTER FAILOVER to %s: master after %v, cluster healthy after %v",
		replica.Addr, promoted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// WaitPromoted waits until replica reports itself master of hash slots, as
// happens after an automatic failover once its master has been killed or
// paused, and then until the cluster is healthy (see WaitHealthy). It waits
// at most 30 seconds plus the WaitHealthy bound, and logs how long it took.
func (c *Cluster) WaitPromoted(tb testing.TB, replica *Server) {
	tb.Helper()
	start := time.Now()
	err := poll(waitTimeout, func() error {
		if !replica.running() {
			return fmt.Errorf("%s is not running", replica.Addr)
		}
		me, err := clusterMyself(replica.Addr)
		if err != nil {
			return err
		}
		if !me.master || len(me.slots) == 0 {
			return fmt.Errorf("%s is not master yet", replica.Addr)
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("redistest: WaitPromoted(%s): %v", replica.Addr, err)
	}
	promoted := time.Since(start)
	c.WaitHealthy(tb)
	tb.Logf("redistest: %s promoted after %v, cluster healthy after %v",
		replica.Addr, promoted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// WaitHealthy waits, for at most 30 seconds, until the cluster is healthy
// from the point of view of every running node (killed and paused nodes are
// ignored), and calls tb.Fatal otherwise. Healthy means that every running
// node
//
//   - reports cluster_state:ok with all 16384 slots assigned and ok (CLUSTER
//     INFO) and knows every node in Nodes;
//   - has the same slot map (CLUSTER SLOTS) as the others, in which each slot
//     is served by a running node that regards itself as a master;
//   - agrees with the others on the role of every node, and on the master of
//     every replica (CLUSTER NODES);
//   - if it is a replica, has its replication link up (INFO replication).
//
// Note that right after a master is killed the surviving nodes still look
// healthy to each other, but the dead master still owns its slots, so
// WaitHealthy waits for the failover.
func (c *Cluster) WaitHealthy(tb testing.TB) {
	tb.Helper()
	if err := poll(waitTimeout, c.healthy); err != nil {
		tb.Fatalf("redistest: cluster not healthy after %v: %v", waitTimeout, err)
	}
}

// healthy returns nil if the cluster is healthy (see WaitHealthy) and an
// error describing the first problem found otherwise.
func (c *Cluster) healthy() error {
	live := c.running()
	if len(live) == 0 {
		return errors.New("no node is running")
	}
	var refMap, refTopo string
	var refNode *Server
	var owners []string
	masters := make(map[string]bool) // addresses of running masters
	for _, s := range live {
		info, err := queryString(s.Addr, "CLUSTER", "INFO")
		if err != nil {
			return err
		}
		if v := InfoField(info, "cluster_state"); v != "ok" {
			return fmt.Errorf("%s reports cluster_state:%s", s.Addr, v)
		}
		for _, k := range []string{"cluster_slots_assigned", "cluster_slots_ok"} {
			if v := InfoField(info, k); v != strconv.Itoa(clusterSlots) {
				return fmt.Errorf("%s reports %s:%s", s.Addr, k, v)
			}
		}
		if v := InfoField(info, "cluster_known_nodes"); v != strconv.Itoa(len(c.Nodes)) {
			return fmt.Errorf("%s reports cluster_known_nodes:%s, want %d", s.Addr, v, len(c.Nodes))
		}

		m, own, err := clusterSlotMap(s.Addr)
		if err != nil {
			return err
		}
		nodes, err := clusterNodes(s.Addr)
		if err != nil {
			return err
		}
		topo := topology(nodes)
		if refNode == nil {
			refMap, refTopo, refNode, owners = m, topo, s, own
		} else if m != refMap {
			return fmt.Errorf("slot maps differ: %s has %s, %s has %s", refNode.Addr, refMap, s.Addr, m)
		} else if topo != refTopo {
			return fmt.Errorf("roles differ: %s has %s, %s has %s", refNode.Addr, refTopo, s.Addr, topo)
		}

		me, err := myselfOf(s.Addr, nodes)
		if err != nil {
			return err
		}
		if me.master {
			masters[s.Addr] = true
			continue
		}
		repl, err := queryString(s.Addr, "INFO", "replication")
		if err != nil {
			return err
		}
		if v := InfoField(repl, "master_link_status"); v != "up" {
			return fmt.Errorf("replica %s reports master_link_status:%s", s.Addr, v)
		}
	}
	for _, addr := range owners {
		if !masters[addr] {
			return fmt.Errorf("slots are served by %s, which is not a running master (slot map %s)", addr, refMap)
		}
	}
	return nil
}

// running returns the nodes that are running and not paused, in the order of
// Nodes.
func (c *Cluster) running() []*Server {
	var live []*Server
	for _, s := range c.Nodes {
		if s.running() {
			live = append(live, s)
		}
	}
	return live
}

// running reports whether the server's process is running and not paused.
func (s *Server) running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc != nil && !s.proc.exited() && !s.paused
}

// nodeView is one node as seen by some node: a line of CLUSTER NODES.
type nodeView struct {
	id       string
	myself   bool // the line of the node that was asked
	master   bool
	masterID string   // the master's node ID, for a replica
	slots    [][2]int // inclusive slot ranges served, for a master
}

// firstSlot returns the lowest slot the node serves, or clusterSlots if none.
func (v nodeView) firstSlot() int {
	first := clusterSlots
	for _, r := range v.slots {
		first = min(first, r[0])
	}
	return first
}

// serves reports whether the node serves slot.
func (v nodeView) serves(slot int) bool {
	for _, r := range v.slots {
		if r[0] <= slot && slot <= r[1] {
			return true
		}
	}
	return false
}

// clusterNodes returns the cluster as seen by the node at addr.
func clusterNodes(addr string) ([]nodeView, error) {
	text, err := queryString(addr, "CLUSTER", "NODES")
	if err != nil {
		return nil, err
	}
	nodes, err := parseNodes(text)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", addr, err)
	}
	return nodes, nil
}

// clusterMyself asks the node at addr how it sees itself.
func clusterMyself(addr string) (nodeView, error) {
	nodes, err := clusterNodes(addr)
	if err != nil {
		return nodeView{}, err
	}
	return myselfOf(addr, nodes)
}

// myselfOf returns the myself entry of nodes, from the node at addr.
func myselfOf(addr string, nodes []nodeView) (nodeView, error) {
	for _, v := range nodes {
		if v.myself {
			return v, nil
		}
	}
	return nodeView{}, fmt.Errorf("%s: CLUSTER NODES has no myself line", addr)
}

// parseNodes parses a CLUSTER NODES reply, whose lines read
// <id> <ip:port@cport> <flags> <master> <ping-sent> <pong-recv> <config-epoch>
// <link-state> <slot> ...
func parseNodes(text string) ([]nodeView, error) {
	var nodes []nodeView
	for line := range strings.Lines(text) {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if len(f) < 8 {
			return nil, fmt.Errorf("CLUSTER NODES: bad line %q", line)
		}
		flags := strings.Split(f[2], ",")
		v := nodeView{
			id:     f[0],
			myself: slices.Contains(flags, "myself"),
			master: slices.Contains(flags, "master"),
		}
		if f[3] != "-" {
			v.masterID = f[3]
		}
		for _, r := range f[8:] {
			if strings.HasPrefix(r, "[") { // a slot being imported or migrated
				continue
			}
			lo, hi, isRange := strings.Cut(r, "-")
			a, err := strconv.Atoi(lo)
			if err != nil {
				return nil, fmt.Errorf("CLUSTER NODES: bad slot %q", r)
			}
			b := a
			if isRange {
				if b, err = strconv.Atoi(hi); err != nil {
					return nil, fmt.Errorf("CLUSTER NODES: bad slot range %q", r)
				}
			}
			v.slots = append(v.slots, [2]int{a, b})
		}
		nodes = append(nodes, v)
	}
	return nodes, nil
}

// topology returns the roles in nodes in a canonical form: for each node
// ID, in order, "id:master" or "id:replica-of-<master ID>".
func topology(nodes []nodeView) string {
	roles := make([]string, len(nodes))
	for i, v := range nodes {
		if v.master {
			roles[i] = v.id + ":master"
		} else {
			roles[i] = v.id + ":replica-of-" + v.masterID
		}
	}
	slices.Sort(roles)
	return strings.Join(roles, " ")
}

// clusterSlotMap returns the node at addr's slot map (CLUSTER SLOTS) in a
// canonical form, "start-end=master ..." sorted by slot, and the addresses of
// the masters in it.
func clusterSlotMap(addr string) (string, []string, error) {
	v, err := query(addr, "CLUSTER", "SLOTS")
	if err != nil {
		return "", nil, err
	}
	ranges, ok := v.([]any)
	if !ok {
		return "", nil, fmt.Errorf("%s: CLUSTER SLOTS: unexpected reply %#v", addr, v)
	}
	type entry struct {
		start, end int64
		master     string
	}
	var es []entry
	var owners []string
	for _, r := range ranges {
		a, _ := r.([]any)
		if len(a) < 3 {
			return "", nil, fmt.Errorf("%s: CLUSTER SLOTS: unexpected entry %#v", addr, r)
		}
		start, ok1 := a[0].(int64)
		end, ok2 := a[1].(int64)
		node, _ := a[2].([]any)
		if !ok1 || !ok2 || len(node) < 2 {
			return "", nil, fmt.Errorf("%s: CLUSTER SLOTS: unexpected entry %#v", addr, r)
		}
		ip, _ := node[0].(string)
		port, _ := node[1].(int64)
		master := ip + ":" + strconv.FormatInt(port, 10)
		es = append(es, entry{start, end, master})
		if !slices.Contains(owners, master) {
			owners = append(owners, master)
		}
	}
	sort.Slice(es, func(i, j int) bool { return es[i].start < es[j].start })
	var b strings.Builder
	for i, e := range es {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%d-%d=%s", e.start, e.end, e.master)
	}
	return b.String(), owners, nil
}

// query runs one command on a fresh connection to addr, bounded by
// queryTimeout.
func query(addr string, args ...any) (any, error) {
	rc, err := dialRESP(addr, queryTimeout)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	v, err := rc.do(args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %v: %w", addr, args, err)
	}
	return v, nil
}

// queryString is query for commands replying with a string.
func queryString(addr string, args ...any) (string, error) {
	v, err := query(addr, args...)
	if err != nil {
		return "", err
	}
	s, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("%s: %v: unexpected reply %#v", addr, args, v)
	}
	return s, nil
}

// queryInt is query for commands replying with an integer.
func queryInt(addr string, args ...any) (int64, error) {
	v, err := query(addr, args...)
	if err != nil {
		return 0, err
	}
	n, ok := v.(int64)
	if !ok {
		return 0, fmt.Errorf("%s: %v: unexpected reply %#v", addr, args, v)
	}
	return n, nil
}

// poll calls check until it returns nil, pausing pollInterval between calls,
// and then returns nil. If timeout passes first, it returns the last error.
func poll(timeout time.Duration, check func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(pollInterval)
	}
}

// addrsOf returns the addresses of servers.
func addrsOf(servers []*Server) []string {
	addrs := make([]string, len(servers))
	for i, s := range servers {
		addrs[i] = s.Addr
	}
	return addrs
}
