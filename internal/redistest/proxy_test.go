package redistest_test

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/internal/redistest"
)

// startEcho runs a TCP echo server until the end of the test.
func startEcho(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

// dial connects to addr and closes the connection at the end of the test.
func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip writes msg and reads len(msg) bytes back within timeout.
func roundTrip(c net.Conn, msg string, timeout time.Duration) (string, error) {
	if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
		return "", err
	}
	if _, err := io.WriteString(c, msg); err != nil {
		return "", err
	}
	buf := make([]byte, len(msg))
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

func TestProxyEcho(t *testing.T) {
	p := redistest.NewProxy(t, startEcho(t))
	c := dial(t, p.Addr)
	if got, err := roundTrip(c, "hello", 5*time.Second); err != nil || got != "hello" {
		t.Fatalf("echo = %q, %v", got, err)
	}

	// Latency applies to the live connection, once in each direction.
	const lat = 50 * time.Millisecond
	p.SetLatency(lat)
	start := time.Now()
	if got, err := roundTrip(c, "slow", 10*time.Second); err != nil || got != "slow" {
		t.Fatalf("echo with latency = %q, %v", got, err)
	}
	if elapsed := time.Since(start); elapsed < 2*lat {
		t.Errorf("round trip with latency %v took %v, want at least %v", lat, elapsed, 2*lat)
	}
	p.SetLatency(0)

	// Blackhole: nothing comes back, on old and new connections alike.
	p.Blackhole(true)
	if _, err := roundTrip(c, "lost", 200*time.Millisecond); !isTimeout(err) {
		t.Fatalf("echo through blackhole: %v, want a timeout", err)
	}
	c2 := dial(t, p.Addr) // still accepted
	if _, err := roundTrip(c2, "lost", 200*time.Millisecond); !isTimeout(err) {
		t.Fatalf("echo on new connection through blackhole: %v, want a timeout", err)
	}
	p.Blackhole(false)
	// New data flows again. (What was sent during the blackhole is normally
	// dropped, but a slow machine may not have read it before the switch.)
	if got := readUntil(t, c2, "back"); got != "back" && got != "lostback" {
		t.Errorf("after blackhole, read %q, want \"back\"", got)
	}

	// CutAll breaks live connections; new ones work.
	p.CutAll()
	if _, err := roundTrip(c2, "x", 5*time.Second); err == nil || isTimeout(err) {
		t.Fatalf("echo on cut connection: %v, want a connection error", err)
	}
	c3 := dial(t, p.Addr)
	if got, err := roundTrip(c3, "again", 5*time.Second); err != nil || got != "again" {
		t.Fatalf("echo on new connection after CutAll = %q, %v", got, err)
	}
}

// readUntil writes msg to c and reads until the data read ends with msg.
func readUntil(t *testing.T, c net.Conn, msg string) string {
	t.Helper()
	if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(c, msg); err != nil {
		t.Fatalf("write: %v", err)
	}
	var got strings.Builder
	buf := make([]byte, 64)
	for !strings.HasSuffix(got.String(), msg) {
		n, err := c.Read(buf)
		got.Write(buf[:n])
		if err != nil {
			t.Fatalf("read after %q: %v", got.String(), err)
		}
	}
	return got.String()
}

func TestProxyTargetDown(t *testing.T) {
	p := redistest.NewProxy(t, net.JoinHostPort("127.0.0.1", strconv.Itoa(redistest.FreePort(t))))
	// The proxy accepts, fails to dial the target, and resets the connection,
	// possibly before the dial has even returned.
	c, err := net.DialTimeout("tcp", p.Addr, 5*time.Second)
	if err != nil {
		return
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("read from proxy to nowhere: %v, want a connection error", err)
	}
}

func TestProxyCloseInterruptsLatency(t *testing.T) {
	p := redistest.NewProxy(t, startEcho(t))
	c := dial(t, p.Addr)
	if got, err := roundTrip(c, "hi", 5*time.Second); err != nil || got != "hi" {
		t.Fatalf("echo = %q, %v", got, err)
	}
	p.SetLatency(time.Hour)
	if _, err := io.WriteString(c, "stuck"); err != nil {
		t.Fatal(err)
	}
	p.Blackhole(true)
	p.Close() // must not wait for the hour; goleak checks the goroutines
	p.Close() // idempotent
	if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("read after Close: %v, want a connection error", err)
	}
	if _, err := net.DialTimeout("tcp", p.Addr, 5*time.Second); err == nil {
		t.Fatal("proxy still accepts connections after Close")
	}
}

func TestProxyRedis(t *testing.T) {
	s := redistest.Start(t)
	p := redistest.NewProxy(t, s.Addr)
	c := redis.NewClient(shortTimeoutOptions(p.Addr))
	t.Cleanup(func() { c.Close() })

	ctx := ctxTimeout(t, 10*time.Second)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET through proxy: %v", err)
	}
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET through proxy = %q, %v", got, err)
	}
	if got := s.Do(t, "GET", "k"); got != "v" {
		t.Fatalf("the SET did not reach the server: GET = %#v", got)
	}

	t.Run("latency", func(t *testing.T) {
		const lat = 50 * time.Millisecond
		p.SetLatency(lat)
		defer p.SetLatency(0)
		start := time.Now()
		if err := c.Ping(ctxTimeout(t, 10*time.Second)).Err(); err != nil {
			t.Fatalf("PING with latency: %v", err)
		}
		if elapsed := time.Since(start); elapsed < 2*lat {
			t.Errorf("PING with latency %v took %v, want at least %v", lat, elapsed, 2*lat)
		}
	})

	t.Run("blackhole", func(t *testing.T) {
		p.Blackhole(true)
		err := c.Ping(ctxTimeout(t, 300*time.Millisecond)).Err()
		p.Blackhole(false)
		if !isTimeout(err) {
			t.Fatalf("PING through blackhole: %v, want a timeout", err)
		}
		if err := c.Ping(ctxTimeout(t, 10*time.Second)).Err(); err != nil {
			t.Fatalf("PING after blackhole: %v", err)
		}
	})

	t.Run("cut", func(t *testing.T) {
		if err := c.Ping(ctxTimeout(t, 10*time.Second)).Err(); err != nil {
			t.Fatalf("PING: %v", err)
		}
		p.CutAll()
		// The pooled connection is dead; the client notices and reconnects.
		if got, err := c.Get(ctxTimeout(t, 10*time.Second), "k").Result(); err != nil || got != "v" {
			t.Fatalf("GET after CutAll = %q, %v", got, err)
		}
	})

	t.Run("cut raw", func(t *testing.T) {
		raw := dial(t, p.Addr)
		r := bufio.NewReader(raw)
		if err := raw.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(raw, "PING\r\n"); err != nil {
			t.Fatal(err)
		}
		if line, err := r.ReadString('\n'); err != nil || line != "+PONG\r\n" {
			t.Fatalf("PING = %q, %v", line, err)
		}
		p.CutAll()
		if _, err := r.ReadString('\n'); err == nil || isTimeout(err) {
			t.Fatalf("read from cut connection: %v, want a connection error", err)
		}
	})
}

// readAll reads from c until it fails and returns what it read and the
// error that ended the read.
func readAll(t *testing.T, c net.Conn) (string, error) {
	t.Helper()
	if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	var got strings.Builder
	buf := make([]byte, 64)
	for {
		n, err := c.Read(buf)
		got.Write(buf[:n])
		if err != nil {
			return got.String(), err
		}
	}
}

// waitClientCmd waits until srv has a client running cmd.
func waitClientCmd(t *testing.T, s *redistest.Server, cmd string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if list, _ := s.Do(t, "CLIENT", "LIST").(string); strings.Contains(list, "cmd="+cmd+" ") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no client runs %s", cmd)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestProxyRefuse(t *testing.T) {
	s := redistest.Start(t)
	p := redistest.NewProxy(t, s.Addr)
	c := redis.NewClient(&redis.Options{Addr: p.Addr, DialerRetries: 1, MaxRetries: 1})
	t.Cleanup(func() { c.Close() })
	if err := c.Set(ctxTimeout(t, 10*time.Second), "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET through proxy: %v", err)
	}

	idle := dial(t, p.Addr)
	if _, err := io.WriteString(idle, "*1\r\n$4\r\nPING\r\n"); err != nil {
		t.Fatal(err)
	}
	pong := make([]byte, len("+PONG\r\n"))
	if _, err := io.ReadFull(idle, pong); err != nil || string(pong) != "+PONG\r\n" {
		t.Fatalf("PING = %q, %v", pong, err)
	}
	busy := dial(t, p.Addr)
	if _, err := io.WriteString(busy, "*3\r\n$5\r\nBLPOP\r\n$6\r\nnolist\r\n$3\r\n0.5\r\n"); err != nil {
		t.Fatal(err)
	}
	waitClientCmd(t, s, "blpop")

	p.Refuse(true)
	p.Refuse(true) // idempotent
	// A request sent while the connection waits for its reply is dropped.
	if _, err := io.WriteString(busy, "*2\r\n$4\r\nINCR\r\n$7\r\nrefused\r\n"); err != nil {
		t.Fatal(err)
	}
	// The idle connection is closed at once, gracefully.
	if got, err := readAll(t, idle); got != "" || !errors.Is(err, io.EOF) {
		t.Errorf("idle connection after Refuse read %q, %v; want EOF", got, err)
	}
	// The busy one gets its reply, then the end of the stream.
	if got, err := readAll(t, busy); got != "*-1\r\n" || !errors.Is(err, io.EOF) {
		t.Errorf("busy connection after Refuse read %q, %v; want BLPOP's null reply, then EOF", got, err)
	}
	if got := s.Do(t, "GET", "refused"); got != nil {
		t.Errorf("a request sent after Refuse reached the server: GET refused = %#v", got)
	}
	if _, err := net.DialTimeout("tcp", p.Addr, 5*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("dial while refusing: %v; want ECONNREFUSED", err)
	}
	if err := c.Get(ctxTimeout(t, 10*time.Second), "k").Err(); err == nil {
		t.Error("GET through a refusing proxy succeeded")
	}

	p.Refuse(false)
	p.Refuse(false)
	if got, err := c.Get(ctxTimeout(t, 10*time.Second), "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET after Refuse(false) = %q, %v", got, err)
	}
	p.Refuse(true)
	p.Close() // while refusing: nothing to wait for
}

func TestProxyDropReplies(t *testing.T) {
	s := redistest.Start(t)
	p := redistest.NewProxy(t, s.Addr)
	c := redis.NewClient(&redis.Options{Addr: p.Addr, MaxRetries: 3})
	t.Cleanup(func() { c.Close() })
	ctx := ctxTimeout(t, 30*time.Second)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}

	// The first INCR is applied, its reply dropped and its connection cut;
	// go-redis sends it again on a new connection: applied twice.
	var matched atomic.Int64
	p.DropReplies(func(chunk []byte) bool {
		return bytes.Contains(bytes.ToLower(chunk), []byte("incr")) && matched.Add(1) == 1
	})
	if got, err := c.Incr(ctx, "n").Result(); err != nil || got != 2 {
		t.Fatalf("INCR with its first reply dropped = %d, %v; want 2 (applied, then resent)", got, err)
	}
	if got := s.Do(t, "GET", "n"); got != "2" {
		t.Errorf("GET n = %#v; want \"2\"", got)
	}
	if n := p.DroppedReplies(); n != 1 {
		t.Errorf("DroppedReplies = %d; want 1", n)
	}

	// Every reply dropped: each attempt is applied, none answered.
	p.DropReplies(redistest.AnyRequest)
	if err := c.Incr(ctx, "n").Err(); err == nil {
		t.Error("INCR with every reply dropped succeeded")
	}
	applied, _ := strconv.Atoi(s.Do(t, "GET", "n").(string))
	if applied < 3 || p.DroppedReplies() < 2 {
		t.Errorf("after INCR with every reply dropped: n = %d, %d connections cut; want each attempt applied and cut", applied, p.DroppedReplies())
	}

	p.DropReplies(nil)
	if got, err := c.Incr(ctx, "n").Result(); err != nil || got != int64(applied)+1 {
		t.Fatalf("INCR after DropReplies(nil) = %d, %v; want %d", got, err, applied+1)
	}
}

// TestProxyHoldReplies: the held connection's request is applied at once,
// its reply comes only after ReleaseReplies; other connections are not
// held.
func TestProxyHoldReplies(t *testing.T) {
	s := redistest.Start(t)
	p := redistest.NewProxy(t, s.Addr)
	c := redis.NewClient(&redis.Options{Addr: p.Addr})
	t.Cleanup(func() { c.Close() })
	ctx := ctxTimeout(t, 30*time.Second)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	p.HoldReplies(func(chunk []byte) bool { return bytes.Contains(bytes.ToLower(chunk), []byte("incr")) })
	held := make(chan int64, 1)
	go func() { held <- c.Incr(ctx, "n").Val() }()
	for deadline := time.Now().Add(10 * time.Second); s.Do(t, "GET", "n") != "1"; {
		if time.Now().After(deadline) {
			t.Fatal("the held INCR was not applied")
		}
	}
	if got, err := c.Incr(ctx, "m").Result(); err != nil || got != 1 {
		t.Fatalf("INCR on another connection while one is held = %d, %v; want 1", got, err)
	}
	select {
	case v := <-held:
		t.Fatalf("the held INCR returned %d before ReleaseReplies", v)
	default:
	}
	p.ReleaseReplies()
	if v := <-held; v != 1 {
		t.Errorf("the held INCR returned %d after ReleaseReplies; want 1", v)
	}
}
