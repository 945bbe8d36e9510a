package bench

import (
	"context"
	"errors"
	"strconv"
	"testing"

	"github.com/go-redis/redis_rate/v10"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/benchmarks/internal/design"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// topology is a Redis deployment the cluster benchmark runs on.
type topology struct {
	name string
	// client returns a new client with default options, its commands
	// counted by c.
	client func(c *design.Counter) redis.UniversalClient
	// servers are the processes whose command counters make cmds/op.
	servers []*redistest.Server
}

// BenchmarkManyKeysCluster: the ManyKeys workload (10,000 keys, limit 1e9/s,
// every decision admitted) on one standalone redis-server and on a 3-master
// Redis Cluster (no replicas; every process on this machine), side by side in
// one run: sub-benchmarks <design>/standalone and <design>/cluster3. The
// designs are those that take any go-redis client (a ClusterClient too):
// redis_rate (its limiter takes an interface that *redis.ClusterClient
// satisfies) and leaselimit in exact and lease mode. cmds/op is summed over
// the cluster's masters; reqs/op counts the commands the ClusterClient sent
// (not its own CLUSTER SLOTS and COMMAND calls).
func BenchmarkManyKeysCluster(b *testing.B) {
	srv := redistest.Start(b)
	cl := redistest.StartCluster(b, 3, 0)
	topos := []topology{
		{"standalone", func(c *design.Counter) redis.UniversalClient { return design.NewClient(srv.Addr, c) }, []*redistest.Server{srv}},
		{"cluster3", func(c *design.Counter) redis.UniversalClient {
			cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs()})
			cc.AddHook(c)
			return cc
		}, cl.Nodes},
	}
	for _, name := range []string{design.RedisRate, design.LeaselimitExact, design.LeaselimitLease} {
		for _, tp := range topos {
			b.Run(name+"/"+tp.name, func(b *testing.B) { benchTopology(b, tp, name, unlimited, 10_000) })
		}
	}
}

// newUniversal returns the named design on any go-redis client, built as
// design.New builds it on a *redis.Client (same key prefixes and options).
func newUniversal(name string, client redis.UniversalClient, limit policy.Limit) (design.Decider, error) {
	switch name {
	case design.RedisRate:
		rl := redis_rate.Limit{Rate: int(limit.Rate), Burst: int(limit.Burst), Period: limit.Period}
		return rateDecider{redis_rate.NewLimiter(client), rl}, nil
	case design.LeaselimitExact:
		return design.NewLeaselimit(client, limit, leaselimit.WithoutLease(), leaselimit.WithPrefix("ll-exact"))
	case design.LeaselimitLease:
		return design.NewLeaselimit(client, limit, leaselimit.WithPrefix("ll-lease"))
	}
	return nil, errors.New("bench: design " + name + " needs a *redis.Client")
}

type rateDecider struct {
	l     *redis_rate.Limiter
	limit redis_rate.Limit
}

func (d rateDecider) Allow(ctx context.Context, key string) (design.Result, error) {
	res, err := d.l.Allow(ctx, key, d.limit)
	if err != nil {
		return design.Result{}, err
	}
	return design.Result{Allowed: res.Allowed > 0}, nil
}

func (d rateDecider) Close() error { return nil }

// totalCommands sums total_commands_processed over servers.
func totalCommands(b *testing.B, servers []*redistest.Server) []redistest.Stats {
	st := make([]redistest.Stats, len(servers))
	for i, s := range servers {
		st[i] = s.Stats(b)
	}
	return st
}

// benchTopology is benchDesign on any topology: the same warm-up, key walk,
// latency sampling and metrics.
func benchTopology(b *testing.B, tp topology, name string, limit policy.Limit, nkeys int) {
	ctx := context.Background()
	r := round.Add(1)
	keys := make([]string, nkeys)
	for i := range keys {
		keys[i] = "r" + strconv.FormatInt(r, 10) + ":k" + strconv.Itoa(i)
	}

	var reqs design.Counter
	rdb := tp.client(&reqs)
	defer rdb.Close()

	// Warm up on another key: connections, script caches (on the master
	// serving that key; the others load the script on their first NOSCRIPT).
	warm, err := newUniversal(name, rdb, limit)
	if err != nil {
		b.Fatal(err)
	}
	warmUp(b, ctx, warm, "r"+strconv.FormatInt(r, 10)+":warm")

	dec, err := newUniversal(name, rdb, limit)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		if err := dec.Close(); err != nil {
			b.Error(err)
		}
	}()

	before := totalCommands(b, tp.servers)
	reqs0 := reqs.Load()
	run := runDecisions(b, ctx, dec, keys)
	after := totalCommands(b, tp.servers)
	var cmds int64
	for i := range after {
		cmds += after[i].Sub(before[i]).TotalCommands
	}
	run.report(b, name+"/"+tp.name, cmds, reqs.Load()-reqs0)
}
