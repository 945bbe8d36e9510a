package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// redisBinary is the executable compare starts when -redis is not given.
const redisBinary = "redis-server"

// server is a redis-server process started by compare.
type server struct {
	Addr string
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has exited and been reaped
	log  *lockedBuffer // its output, for error messages
}

// startServer runs redis-server on a free loopback port, without
// persistence, and waits until it answers PING. Call stop when done.
func startServer() (*server, error) {
	bin, err := exec.LookPath(redisBinary)
	if err != nil {
		return nil, fmt.Errorf("%s is not on PATH (install it, e.g. apt-get install redis-server, or pass -redis ADDR): %w", redisBinary, err)
	}
	var last error
	for range 5 { // another process may take the free port first
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		s, err := launch(bin, port)
		if err == nil {
			return s, nil
		}
		last = err
	}
	return nil, last
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

func launch(bin string, port int) (*server, error) {
	s := &server{
		Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
		done: make(chan struct{}),
		log:  new(lockedBuffer),
	}
	args := []string{
		"--port", strconv.Itoa(port),
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		"--daemonize", "no",
		"--dir", os.TempDir(),
	}
	// The goroutine that starts the process stays locked to its OS thread
	// until the process exits: Pdeathsig fires when that thread dies.
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer close(s.done)
		cmd := exec.Command(bin, args...)
		cmd.Stdout = s.log
		cmd.Stderr = s.log
		cmd.SysProcAttr = sysProcAttr()
		if err := cmd.Start(); err != nil {
			started <- fmt.Errorf("start %s: %w", bin, err)
			return
		}
		s.cmd = cmd
		started <- nil
		_ = cmd.Wait()
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := s.probe()
		if err == nil {
			return s, nil
		}
		select {
		case <-s.done:
			return nil, fmt.Errorf("%s exited before answering PING: %v\n%s", bin, err, s.log.String())
		default:
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("%s did not answer PING on %s within 10s: %v\n%s", bin, s.Addr, err, s.log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// probe checks that s.Addr answers PING and is served by our process (not
// by another server that got the port first).
func (s *server) probe() error {
	c, err := dialInfo(s.Addr)
	if err != nil {
		return err
	}
	defer c.Close()
	if v, err := c.do("PING"); err != nil || v != "PONG" {
		return fmt.Errorf("PING: %q, %v", v, err)
	}
	info, err := c.do("INFO", "server")
	if err != nil {
		return err
	}
	if pid := infoField(info, "process_id"); pid != strconv.Itoa(s.cmd.Process.Pid) {
		s.stop()
		return fmt.Errorf("%s is served by process %s, not by ours", s.Addr, pid)
	}
	return nil
}

// stop terminates the server (SIGTERM, then SIGKILL after 3s) and waits for it.
func (s *server) stop() {
	select {
	case <-s.done:
		return
	default:
	}
	_ = s.cmd.Process.Signal(os.Interrupt)
	select {
	case <-s.done:
	case <-time.After(3 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}

// lockedBuffer is an io.Writer safe for the exec package's copying goroutine.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// infoConn is a plain RESP2 connection with no handshake, so Redis counts
// exactly the commands sent on it.
type infoConn struct {
	c net.Conn
	r *bufio.Reader
}

func dialInfo(addr string) (*infoConn, error) {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return nil, err
	}
	return &infoConn{c: c, r: bufio.NewReader(c)}, nil
}

func (c *infoConn) Close() error { return c.c.Close() }

// do sends a command and returns a simple or bulk string reply.
func (c *infoConn) do(args ...string) (string, error) {
	_ = c.c.SetDeadline(time.Now().Add(10 * time.Second))
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := io.WriteString(c.c, b.String()); err != nil {
		return "", err
	}
	line, err := c.r.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimRight(line, "\r\n")
	if line == "" {
		return "", errors.New("empty reply")
	}
	switch line[0] {
	case '+':
		return line[1:], nil
	case '-':
		return "", fmt.Errorf("redis: %s", line[1:])
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < 0 {
			return "", fmt.Errorf("bad bulk reply %q", line)
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(c.r, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	}
	return "", fmt.Errorf("unexpected reply %q", line)
}

// totalCommands returns total_commands_processed. The INFO command itself
// is counted by Redis after it replies, so each call adds one to the next
// reading; callers subtract their own INFO calls.
func (c *infoConn) totalCommands() (int64, error) {
	info, err := c.do("INFO", "stats")
	if err != nil {
		return 0, fmt.Errorf("INFO stats: %w", err)
	}
	v := infoField(info, "total_commands_processed")
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("INFO stats: total_commands_processed %q: %w", v, err)
	}
	return n, nil
}

func infoField(info, key string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), key+":"); ok {
			return v
		}
	}
	return ""
}
