package redistest

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// SentinelMasterName is the name under which the Sentinels started by
// StartSentinel monitor the master.
const SentinelMasterName = "mymaster"

// SentinelDownAfter is the down-after-milliseconds setting of the Sentinels
// started by StartSentinel: a master that does not answer for this long is
// subjectively down, and a failover follows within a few seconds.
const SentinelDownAfter = time.Second

// sentinelFailoverTimeout is the failover-timeout setting of the Sentinels
// started by StartSentinel. Among other things, a failover whose leader
// election failed is retried after twice this.
const sentinelFailoverTimeout = 3 * time.Second

// Sentinel is a Redis master with replicas monitored by Redis Sentinel, as
// started by StartSentinel. Its methods must be called from the goroutine
// running the test (they may call tb.Fatal).
//
// All the processes are ordinary Servers, so faults are injected with their
// own methods (Kill, Pause, Resume, Restart); a restarted Sentinel keeps
// the state it saved in the config file in its Dir.
type Sentinel struct {
	// MasterName is the name under which the master is monitored,
	// SentinelMasterName.
	MasterName string
	// Master is the initial master. After a failover it is no longer the
	// master; use CurrentMaster (and Lookup) to find the current one.
	Master *Server
	// Replicas are the initial replicas of Master.
	Replicas []*Server
	// Sentinels are the Sentinel processes (redis-server --sentinel). Their
	// Do method runs commands such as SENTINEL MASTERS.
	Sentinels []*Server
}

// StartSentinel starts a master, replicas replicas of it and sentinels
// Sentinels monitoring it under SentinelMasterName, with a quorum of a
// majority of the Sentinels (sentinels/2+1), down-after-milliseconds
// SentinelDownAfter, failover-timeout 3 seconds and parallel-syncs 1. All
// listen on free ports of 127.0.0.1; the master and replicas are Servers
// started as by Start with --repl-diskless-sync-delay 0 (the replicas also
// with --replicaof), and each Sentinel is a
// Server running `redis-server <dir>/redis.conf --sentinel`.
//
// StartSentinel returns once every replica is in sync with the master and
// every Sentinel sees the master as up, knows all replicas (none of them
// down) and all other Sentinels, and agrees that the quorum can be reached
// (SENTINEL CKQUORUM); it waits for at most about 30 seconds for each of
// these stages. The cleanup registered by each process stops it. Like Start,
// StartSentinel skips the test if redis-server is not on PATH, or fails it
// when LEASELIMIT_REQUIRE_REDIS is "1".
func StartSentinel(tb testing.TB, replicas, sentinels int) *Sentinel {
	tb.Helper()
	if replicas < 0 || sentinels < 1 {
		tb.Fatalf("redistest: StartSentinel(%d, %d): need no negative replica count and at least one Sentinel", replicas, sentinels)
	}
	start := time.Now()
	s := &Sentinel{MasterName: SentinelMasterName}
	// Replicas sync at once rather than after the default 5 seconds; every
	// data node gets the setting since any may become master.
	noDelay := []string{"--repl-diskless-sync-delay", "0"}
	s.Master = Start(tb, noDelay...)
	for range replicas {
		s.Replicas = append(s.Replicas, Start(tb, slices.Concat(noDelay, []string{"--replicaof", "127.0.0.1", strconv.Itoa(s.Master.Port)})...))
	}
	// Sentinels learn about replicas from the master's INFO, which they
	// refresh only every 10 seconds: have the replicas connected first.
	if err := poll(waitTimeout, s.replicasInSync); err != nil {
		tb.Fatalf("redistest: replicas not in sync after %v: %v", waitTimeout, err)
	}

	quorum := sentinels/2 + 1
	conf := fmt.Sprintf("sentinel monitor %[1]s 127.0.0.1 %[2]d %[3]d\n"+
		"sentinel down-after-milliseconds %[1]s %[4]d\n"+
		"sentinel failover-timeout %[1]s %[5]d\n"+
		"sentinel parallel-syncs %[1]s 1\n",
		s.MasterName, s.Master.Port, quorum,
		SentinelDownAfter.Milliseconds(), sentinelFailoverTimeout.Milliseconds())
	for range sentinels {
		s.Sentinels = append(s.Sentinels, startServer(tb, serverConfig{conf: conf, args: []string{"--sentinel"}}))
	}
	if err := poll(waitTimeout, s.sentinelsReady); err != nil {
		tb.Fatalf("redistest: Sentinels not ready after %v: %v", waitTimeout, err)
	}
	tb.Logf("redistest: master with %d replicas and %d Sentinels ready in %v",
		replicas, sentinels, time.Since(start).Round(time.Millisecond))
	return s
}

// replicasInSync reports an error unless the master has all replicas
// connected and every replica has its link to the master up.
func (s *Sentinel) replicasInSync() error {
	info, err := queryString(s.Master.Addr, "INFO", "replication")
	if err != nil {
		return err
	}
	if v := InfoField(info, "connected_slaves"); v != strconv.Itoa(len(s.Replicas)) {
		return fmt.Errorf("master %s reports connected_slaves:%s, want %d", s.Master.Addr, v, len(s.Replicas))
	}
	for _, r := range s.Replicas {
		info, err := queryString(r.Addr, "INFO", "replication")
		if err != nil {
			return err
		}
		if v := InfoField(info, "master_link_status"); v != "up" {
			return fmt.Errorf("replica %s reports master_link_status:%s", r.Addr, v)
		}
	}
	return nil
}

// sentinelsReady reports an error unless every Sentinel sees the master up,
// all replicas up and all other Sentinels, and the quorum reachable.
func (s *Sentinel) sentinelsReady() error {
	for _, sn := range s.Sentinels {
		m, err := queryMap(sn.Addr, "SENTINEL", "MASTER", s.MasterName)
		if err != nil {
			return err
		}
		if m["flags"] != "master" {
			return fmt.Errorf("sentinel %s reports master flags %q", sn.Addr, m["flags"])
		}
		if v := m["num-slaves"]; v != strconv.Itoa(len(s.Replicas)) {
			return fmt.Errorf("sentinel %s knows %s replicas, want %d", sn.Addr, v, len(s.Replicas))
		}
		if v := m["num-other-sentinels"]; v != strconv.Itoa(len(s.Sentinels)-1) {
			return fmt.Errorf("sentinel %s knows %s other Sentinels, want %d", sn.Addr, v, len(s.Sentinels)-1)
		}
		v, err := query(sn.Addr, "SENTINEL", "REPLICAS", s.MasterName)
		if err != nil {
			return err
		}
		list, _ := v.([]any)
		for _, r := range list {
			rm, err := pairsToMap(r)
			if err != nil {
				return fmt.Errorf("sentinel %s: SENTINEL REPLICAS: %w", sn.Addr, err)
			}
			if rm["flags"] != "slave" || rm["master-link-status"] != "ok" {
				return fmt.Errorf("sentinel %s reports replica %s:%s with flags %q and master-link-status %q",
					sn.Addr, rm["ip"], rm["port"], rm["flags"], rm["master-link-status"])
			}
		}
		ck, err := queryString(sn.Addr, "SENTINEL", "CKQUORUM", s.MasterName)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(ck, "OK") {
			return fmt.Errorf("sentinel %s: SENTINEL CKQUORUM: %s", sn.Addr, ck)
		}
	}
	return nil
}

// SentinelAddrs returns the addresses of the Sentinels, in the order of
// Sentinels.
func (s *Sentinel) SentinelAddrs() []string {
	return addrsOf(s.Sentinels)
}

// FailoverClient returns a new go-redis client that finds the master through
// the Sentinels (redis.NewFailoverClient with MasterName and SentinelAddrs),
// with otherwise default options. It is closed by the test's cleanup (before
// the servers are stopped).
func (s *Sentinel) FailoverClient(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewFailoverClient(&redis.FailoverOptions{
		MasterName:    s.MasterName,
		SentinelAddrs: s.SentinelAddrs(),
	})
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// CurrentMaster returns the address of the master according to the first
// running Sentinel that answers SENTINEL GET-MASTER-ADDR-BY-NAME. During a
// failover the Sentinels may disagree; WaitFailover waits for them to agree.
func (s *Sentinel) CurrentMaster(tb testing.TB) string {
	tb.Helper()
	var errs []error
	for _, sn := range s.Sentinels {
		if !sn.running() {
			continue
		}
		addr, err := s.masterAddr(sn)
		if err == nil {
			return addr
		}
		errs = append(errs, err)
	}
	tb.Fatalf("redistest: CurrentMaster: no running Sentinel answered: %v", errors.Join(errs...))
	return ""
}

// masterAddr asks the Sentinel sn for the master's address.
func (s *Sentinel) masterAddr(sn *Server) (string, error) {
	v, err := query(sn.Addr, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", s.MasterName)
	if err != nil {
		return "", err
	}
	a, _ := v.([]any)
	if len(a) != 2 {
		return "", fmt.Errorf("sentinel %s: SENTINEL GET-MASTER-ADDR-BY-NAME: unexpected reply %#v", sn.Addr, v)
	}
	ip, _ := a[0].(string)
	port, _ := a[1].(string)
	return net.JoinHostPort(ip, port), nil
}

// WaitFailover waits until every running Sentinel reports the same master
// address, other than from, with the master flagged up (SENTINEL MASTER),
// and the server at that address reports role:master; it returns that
// address. It waits for at most 30 seconds, and logs how long it took.
//
// Typically from is the address of a master the test has just killed or
// paused: the Sentinels then notice it is down after SentinelDownAfter, agree
// that it is, elect a leader and promote a replica, which takes a few
// seconds.
func (s *Sentinel) WaitFailover(tb testing.TB, from string) string {
	tb.Helper()
	start := time.Now()
	var master string
	err := poll(waitTimeout, func() error {
		master = ""
		for _, sn := range s.Sentinels {
			if !sn.running() {
				continue
			}
			addr, err := s.masterAddr(sn)
			if err != nil {
				return err
			}
			if addr == from {
				return fmt.Errorf("sentinel %s still reports master %s", sn.Addr, from)
			}
			if master != "" && addr != master {
				return fmt.Errorf("sentinels disagree on the master: %s and %s", master, addr)
			}
			master = addr
			m, err := queryMap(sn.Addr, "SENTINEL", "MASTER", s.MasterName)
			if err != nil {
				return err
			}
			if m["flags"] != "master" {
				return fmt.Errorf("sentinel %s reports master flags %q", sn.Addr, m["flags"])
			}
		}
		if master == "" {
			return errors.New("no sentinel is running")
		}
		info, err := queryString(master, "INFO", "replication")
		if err != nil {
			return err
		}
		if v := InfoField(info, "role"); v != "master" {
			return fmt.Errorf("new master %s reports role:%s", master, v)
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("redistest: WaitFailover(%s): no failover within %v: %v", from, waitTimeout, err)
	}
	tb.Logf("redistest: Sentinels switched from %s to %s after %v", from, master, time.Since(start).Round(time.Millisecond))
	return master
}

// Lookup returns whichever of Master and Replicas listens on addr, or
// nil if there is none. It maps the address returned by CurrentMaster or
// WaitFailover back to a Server.
func (s *Sentinel) Lookup(addr string) *Server {
	if s.Master.Addr == addr {
		return s.Master
	}
	for _, r := range s.Replicas {
		if r.Addr == addr {
			return r
		}
	}
	return nil
}

// queryMap is query for commands replying with a flat array of field names
// and values, such as SENTINEL MASTER.
func queryMap(addr string, args ...any) (map[string]string, error) {
	v, err := query(addr, args...)
	if err != nil {
		return nil, err
	}
	m, err := pairsToMap(v)
	if err != nil {
		return nil, fmt.Errorf("%s: %v: %w", addr, args, err)
	}
	return m, nil
}

// pairsToMap converts a flat array of string names and values to a map.
func pairsToMap(v any) (map[string]string, error) {
	a, ok := v.([]any)
	if !ok || len(a)%2 != 0 {
		return nil, fmt.Errorf("unexpected reply %#v", v)
	}
	m := make(map[string]string, len(a)/2)
	for i := 0; i < len(a); i += 2 {
		k, ok1 := a[i].(string)
		val, ok2 := a[i+1].(string)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("unexpected reply %#v", v)
		}
		m[k] = val
	}
	return m, nil
}
