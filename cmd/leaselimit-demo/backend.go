package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// backend is the Redis the fleet shares: an embedded miniredis, a single
// server or a Cluster.
type backend struct {
	mini    *miniredis.Miniredis // nil for a real Redis
	addr    string               // single server (miniredis or -redis)
	cluster []string             // -redis-cluster

	admin redis.UniversalClient // for INFO; nil with miniredis
	opt   *redis.Options        // -redis

	// calls counts the commands every fleet client sent (a script call is
	// one, a pipeline counts each of its commands).
	calls atomic.Int64

	mu      sync.Mutex
	down    bool // miniredis stopped for the outage act
	clients []redis.UniversalClient
}

// startBackend starts miniredis or connects to the configured Redis.
func startBackend(ctx context.Context, cfg *config) (*backend, error) {
	b := &backend{addr: cfg.redisAddr, cluster: cfg.cluster}
	switch {
	case len(cfg.cluster) > 0:
		b.admin = redis.NewClusterClient(&redis.ClusterOptions{Addrs: cfg.cluster})
	case cfg.redisAddr != "":
		opt, err := redisOptions(cfg.redisAddr)
		if err != nil {
			return nil, err
		}
		b.opt = opt
		b.admin = redis.NewClient(opt)
	default:
		m, err := miniredis.Run()
		if err != nil {
			return nil, fmt.Errorf("start the embedded Redis (miniredis): %w", err)
		}
		b.mini = m
		b.addr = m.Addr()
		return b, nil
	}
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if err := b.admin.Ping(pctx).Err(); err != nil {
		b.admin.Close()
		return nil, fmt.Errorf("cannot reach Redis at %s: %w", b.describe(), err)
	}
	return b, nil
}

// redisOptions parses -redis: host:port, or a redis:// or rediss:// URL
// (password, database, TLS).
func redisOptions(addr string) (*redis.Options, error) {
	if strings.HasPrefix(addr, "redis://") || strings.HasPrefix(addr, "rediss://") || strings.HasPrefix(addr, "unix://") {
		opt, err := redis.ParseURL(addr)
		if err != nil {
			return nil, fmt.Errorf("-redis: %w", err)
		}
		return opt, nil
	}
	return &redis.Options{Addr: addr}, nil
}

// embedded reports whether the backend is the embedded miniredis.
func (b *backend) embedded() bool { return b.mini != nil }

// describe names the backend for the report.
func (b *backend) describe() string {
	switch {
	case b.mini != nil:
		return "embedded Redis (miniredis " + b.addr + ")"
	case len(b.cluster) > 0:
		return "Redis Cluster " + strings.Join(b.cluster, ",")
	}
	if b.opt != nil {
		return "Redis " + b.opt.Addr // not the URL: it may hold a password
	}
	return "Redis " + b.addr
}

// newClient returns a new client of its own for one fleet instance, counting
// the commands it sends. close closes every client made.
func (b *backend) newClient() redis.UniversalClient {
	var c redis.UniversalClient
	if len(b.cluster) > 0 {
		c = redis.NewClusterClient(&redis.ClusterOptions{Addrs: b.cluster})
	} else if b.opt != nil {
		c = redis.NewClient(b.opt)
	} else {
		c = redis.NewClient(&redis.Options{Addr: b.addr})
	}
	c.AddHook(counter{&b.calls})
	b.mu.Lock()
	b.clients = append(b.clients, c)
	b.mu.Unlock()
	return c
}

// closeClients closes the clients made by newClient so far.
func (b *backend) closeClients() {
	b.mu.Lock()
	cs := b.clients
	b.clients = nil
	b.mu.Unlock()
	for _, c := range cs {
		c.Close()
	}
}

// close closes every client and stops miniredis.
func (b *backend) close() {
	b.closeClients()
	if b.admin != nil {
		b.admin.Close()
	}
	if b.mini != nil {
		b.mini.Close()
	}
}

// serverCommands returns the commands the server has processed, including
// those run inside scripts: miniredis's CommandCount, or the sum of INFO
// stats total_commands_processed over the servers.
func (b *backend) serverCommands(ctx context.Context) (int64, error) {
	if b.mini != nil {
		b.mu.Lock()
		defer b.mu.Unlock()
		if b.down {
			return 0, errors.New("redis is down")
		}
		return int64(b.mini.CommandCount()), nil
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if cc, ok := b.admin.(*redis.ClusterClient); ok {
		var total atomic.Int64
		err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			n, err := infoCommands(ctx, c)
			total.Add(n)
			return err
		})
		return total.Load(), err
	}
	return infoCommands(ctx, b.admin)
}

func infoCommands(ctx context.Context, c redis.UniversalClient) (int64, error) {
	info, err := c.Info(ctx, "stats").Result()
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "total_commands_processed:"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, errors.New("INFO stats has no total_commands_processed")
}

// stop stops the embedded Redis (the outage). It first refuses new
// commands for a moment (LOADING, as a Redis going down and coming back
// answers), so that no script is running when the server closes: miniredis
// fails a script whose server closes under it with a Lua error reply
// ("Error compiling script ... nil pointer dereference"), which a real
// Redis never sends and leaselimit rightly reports as an error.
func (b *backend) stop() {
	b.mu.Lock()
	b.down = true
	b.mu.Unlock()
	b.mini.SetError("LOADING Redis is loading the dataset in memory")
	time.Sleep(20 * time.Millisecond)
	b.mini.Close()
	b.mini.SetError("") // not on the restarted server
}

// restart starts the embedded Redis again on the same port, with its data.
func (b *backend) restart() error {
	var err error
	for i := 0; i < 50; i++ { // the port can take a moment to be free again
		if err = b.mini.Restart(); err == nil {
			b.mu.Lock()
			b.down = false
			b.mu.Unlock()
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("restart the embedded Redis: %w", err)
}

// redisLog receives go-redis's internal log messages (dial failures and the
// like). During the outage act they are expected, so they are only counted;
// otherwise they go to the progress output.
type redisLog struct {
	quiet   atomic.Bool
	dropped atomic.Int64
	mu      sync.Mutex
	p       *progress
}

func (l *redisLog) Printf(_ context.Context, format string, v ...any) {
	if l.quiet.Load() {
		l.dropped.Add(1)
		return
	}
	l.mu.Lock()
	p := l.p
	l.mu.Unlock()
	if p != nil {
		p.message("go-redis: " + fmt.Sprintf(format, v...))
	}
}

// logs is installed as go-redis's logger by run; the logger is global.
var logs = &redisLog{}

func init() { redis.SetLogger(logs) }

// counter is a go-redis hook that counts the commands a client sends.
type counter struct{ n *atomic.Int64 }

func (c counter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

func (c counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}
