package redistest_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/internal/redistest"
)

// ctxTimeout returns a context that expires after d and is cancelled when
// the test ends.
func ctxTimeout(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// shortTimeoutOptions returns client options under which a call fails as soon
// as its context expires. The default client ignores context deadlines on
// reads; ContextTimeoutEnabled makes it honour them. The per-call limit comes
// from the context rather than from ReadTimeout, so that the calls checking
// recovery (which use a generous context) are not held to a few hundred
// milliseconds on a slow, loaded machine.
func shortTimeoutOptions(addr string) *redis.Options {
	return &redis.Options{
		Addr:                  addr,
		ContextTimeoutEnabled: true,
	}
}

// isTimeout reports whether err is a deadline or network timeout.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// refused reports whether nothing accepts connections on addr.
func refused(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return true
	}
	c.Close()
	return false
}

func TestStartPingSetGet(t *testing.T) {
	s := redistest.Start(t)
	if want := "127.0.0.1:" + strconv.Itoa(s.Port); s.Addr != want {
		t.Fatalf("Addr = %q, want %q", s.Addr, want)
	}
	c := s.Client(t)
	ctx := ctxTimeout(t, 10*time.Second)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET = %q, %v; want \"v\", nil", got, err)
	}

	// Do sees the same data and maps replies to plain Go values.
	if got := s.Do(t, "GET", "k"); got != "v" {
		t.Errorf("Do GET k = %#v, want \"v\"", got)
	}
	if got := s.Do(t, "GET", "missing"); got != nil {
		t.Errorf("Do GET missing = %#v, want nil", got)
	}
	if got := s.Do(t, "TTL", "k"); got != int64(-1) {
		t.Errorf("Do TTL k = %#v, want int64(-1)", got)
	}
	if got := s.Do(t, "SET", "n", 42, "EX", 100); got != "OK" {
		t.Errorf("Do SET = %#v, want \"OK\"", got)
	}
	if got, ok := s.Do(t, "KEYS", "*").([]any); !ok || len(got) != 2 {
		t.Errorf("Do KEYS * = %#v, want two keys", got)
	}

	// No persistence: nothing but the log in the directory.
	entries, err := os.ReadDir(s.Dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Name() != "redis-server.log" {
			t.Errorf("unexpected file %s in server directory", e.Name())
		}
	}
	if _, err := os.Stat(filepath.Join(s.Dir, "redis-server.log")); err != nil {
		t.Errorf("log file: %v", err)
	}
}

func TestStartExtraArgs(t *testing.T) {
	s := redistest.Start(t, "--maxmemory", "12mb")
	got := s.Do(t, "CONFIG", "GET", "maxmemory")
	want := []any{"maxmemory", "12582912"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("CONFIG GET maxmemory = %#v, want %#v", got, want)
	}
}

func TestKillRestart(t *testing.T) {
	s := redistest.Start(t)
	c := s.Client(t)
	ctx := ctxTimeout(t, 30*time.Second)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	addr := s.Addr

	s.Kill(t)
	if !refused(addr) {
		t.Fatalf("%s still accepts connections after Kill", addr)
	}
	s.Kill(t) // no-op on a dead server

	s.Restart(t)
	if s.Addr != addr {
		t.Fatalf("Addr after Restart = %s, want %s", s.Addr, addr)
	}
	// The client reconnects; the new server is empty (no persistence).
	if err := c.Get(ctx, "k").Err(); !errors.Is(err, redis.Nil) {
		t.Fatalf("GET after restart: %v, want redis.Nil", err)
	}
	if err := c.Set(ctx, "k", "v2", 0).Err(); err != nil {
		t.Fatalf("SET after restart: %v", err)
	}

	// Restart of a running server kills it first.
	s.Restart(t)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after second restart: %v", err)
	}
}

func TestPauseResume(t *testing.T) {
	s := redistest.Start(t)
	c := redis.NewClient(shortTimeoutOptions(s.Addr))
	t.Cleanup(func() { c.Close() })
	if err := c.Ping(ctxTimeout(t, 10*time.Second)).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}

	s.Pause(t)
	// The kernel still completes the TCP handshake...
	conn, err := net.DialTimeout("tcp", s.Addr, 5*time.Second)
	if err != nil {
		t.Fatalf("dial paused server: %v", err)
	}
	conn.Close()
	// ...but Redis does not reply.
	const timeout = 200 * time.Millisecond
	start := time.Now()
	err = c.Ping(ctxTimeout(t, timeout)).Err()
	elapsed := time.Since(start)
	if !isTimeout(err) {
		t.Fatalf("PING on paused server: %v, want a timeout", err)
	}
	// Lower bound only, with slack for coarse clocks in the client.
	if elapsed < timeout/2 {
		t.Errorf("PING failed after %v, want at least about %v", elapsed, timeout)
	}

	s.Resume(t)
	if err := c.Ping(ctxTimeout(t, 10*time.Second)).Err(); err != nil {
		t.Fatalf("PING after Resume: %v", err)
	}
}

func TestCleanupStopsPausedServer(t *testing.T) {
	var addr string
	t.Run("paused", func(t *testing.T) {
		s := redistest.Start(t)
		addr = s.Addr
		s.Pause(t)
	})
	if addr == "" {
		t.Skip("subtest skipped")
	}
	if !refused(addr) {
		t.Fatalf("%s still accepts connections after the subtest's cleanup", addr)
	}
}

func TestStats(t *testing.T) {
	s := redistest.Start(t)
	c := s.Client(t)
	ctx := ctxTimeout(t, 30*time.Second)
	// Connect (and handshake) before the first snapshot.
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}

	before := s.Stats(t)
	for i := range 10 {
		if err := c.Set(ctx, fmt.Sprint("k", i), i, 0).Err(); err != nil {
			t.Fatalf("SET: %v", err)
		}
	}
	after := s.Stats(t)
	if after.Calls["set"] != 10 {
		t.Errorf("Calls[set] = %d, want 10", after.Calls["set"])
	}
	d := after.Sub(before)
	if d.TotalCommands != 10 || d.Calls["set"] != 10 || len(d.Calls) != 1 {
		t.Errorf("after.Sub(before) = %+v, want 10 commands, all SET", d)
	}

	// Snapshots in a row: Sub removes all of Stats' own INFO commands.
	s1 := s.Stats(t)
	_ = s.Stats(t)
	s3 := s.Stats(t)
	if d := s3.Sub(s1); d.TotalCommands != 0 || len(d.Calls) != 0 {
		t.Errorf("no commands between snapshots, got %+v", d)
	}

	// INFO sent by others is kept; Do counts as exactly its one command.
	if err := c.Info(ctx, "server").Err(); err != nil {
		t.Fatalf("INFO: %v", err)
	}
	s.Do(t, "HSET", "h", "f", "v")
	if d := s.Stats(t).Sub(s3); d.TotalCommands != 2 || d.Calls["info"] != 1 || d.Calls["hset"] != 1 {
		t.Errorf("one INFO and one HSET, got %+v", d)
	}
}

// fakeTB records Skip and Fatal instead of acting on a real test.
type fakeTB struct {
	testing.TB
	mu      sync.Mutex
	skipped string
	fatal   string
}

func (f *fakeTB) Skip(args ...any) {
	f.mu.Lock()
	f.skipped = fmt.Sprint(args...)
	f.mu.Unlock()
	runtime.Goexit()
}

func (f *fakeTB) Fatal(args ...any) {
	f.mu.Lock()
	f.fatal = fmt.Sprint(args...)
	f.mu.Unlock()
	runtime.Goexit()
}

// startWithout runs Start with a PATH lacking redis-server.
func startWithout(t *testing.T) *fakeTB {
	t.Setenv("PATH", t.TempDir())
	if redistest.Available() {
		t.Fatal("Available() with an empty PATH")
	}
	f := &fakeTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		redistest.Start(f)
		t.Error("Start returned without redis-server")
	}()
	<-done
	return f
}

func TestStartWithoutRedis(t *testing.T) {
	t.Run("skips", func(t *testing.T) {
		t.Setenv(redistest.RequireEnv, "")
		f := startWithout(t)
		if f.fatal != "" || !strings.Contains(f.skipped, "redis-server not on PATH") {
			t.Errorf("skipped = %q, fatal = %q; want a skip", f.skipped, f.fatal)
		}
	})
	t.Run("required", func(t *testing.T) {
		t.Setenv(redistest.RequireEnv, "1")
		f := startWithout(t)
		if f.skipped != "" || !strings.Contains(f.fatal, "redis-server not on PATH") {
			t.Errorf("skipped = %q, fatal = %q; want a failure", f.skipped, f.fatal)
		}
	})
}

func TestFreePort(t *testing.T) {
	p := redistest.FreePort(t)
	if p <= 0 || p > 65535 {
		t.Fatalf("FreePort = %d", p)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
	if err != nil {
		t.Fatalf("listen on free port: %v", err)
	}
	ln.Close()
}

// TestLaunchClose: Launch (for programs, not tests) starts a server that
// answers INFO with its counters; Close stops it and removes its directory.
func TestLaunchClose(t *testing.T) {
	if !redistest.Available() {
		if os.Getenv(redistest.RequireEnv) == "1" {
			t.Fatal("redis-server not on PATH")
		}
		t.Skip("redis-server not on PATH")
	}
	s, err := redistest.Launch("--maxmemory", "10mb")
	if err != nil {
		t.Fatal(err)
	}
	info, err := redistest.ReadInfo(s.Addr, "memory")
	if err != nil {
		t.Fatal(err)
	}
	if got := redistest.InfoField(info, "maxmemory"); got != "10485760" {
		t.Errorf("maxmemory = %q; want 10485760 (the extra argument)", got)
	}
	before, err := redistest.ReadStats(s.Addr)
	if err != nil {
		t.Fatal(err)
	}
	after, err := redistest.ReadStats(s.Addr)
	if err != nil {
		t.Fatal(err)
	}
	if d := after.Sub(before).TotalCommands; d != 1 {
		t.Errorf("commands between two ReadStats = %d; want 1 (the first INFO)", d)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("directory %s after Close: %v; want it removed", s.Dir, err)
	}
	if _, err := redistest.ReadInfo(s.Addr, "server"); err == nil {
		t.Errorf("%s still answers after Close", s.Addr)
	}
}
