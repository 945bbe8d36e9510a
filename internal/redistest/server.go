// Package redistest provides test helpers for code that talks to Redis: it
// runs real redis-server processes (Start, Server) and offers a
// fault-injecting TCP proxy (NewProxy, Proxy) for outage tests.
//
// The package is meant to be imported only from _test.go files. Servers and
// proxies are tied to a testing.TB and are stopped by its Cleanup, and every
// goroutine the package starts has exited once the cleanups have run, so
// tests may use go.uber.org/goleak.
//
// For Redis Cluster and Redis Sentinel, StartCluster and StartSentinel start
// several such servers (and redis-cli, for the cluster) and return a Cluster
// or a Sentinel describing them, with helpers to find the current master and
// to wait for failovers.
//
// Tests that need Redis call Start. When the redis-server binary is not on
// PATH, Start skips the test, unless the environment variable
// LEASELIMIT_REQUIRE_REDIS is set to 1 (as in CI), in which case it fails
// the test instead.
package redistest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Binary is the name of the Redis server executable looked up on PATH.
const Binary = "redis-server"

// RequireEnv is the environment variable that, when set to "1", turns the
// skip issued by Start when redis-server is missing into a test failure.
const RequireEnv = "LEASELIMIT_REQUIRE_REDIS"

const (
	// readyTimeout bounds how long Start and Restart wait for PING.
	readyTimeout = 10 * time.Second
	// termGrace is how long the cleanup waits after SIGTERM before SIGKILL.
	termGrace = 3 * time.Second
	// exitTimeout bounds the wait for a killed process to be reaped.
	exitTimeout = 10 * time.Second
	// cmdTimeout bounds the short-lived connections of Stats and Do.
	cmdTimeout = 10 * time.Second
	// startAttempts is how many ports Start tries before giving up.
	startAttempts = 5
	// logTailLines is how many log lines are shown when a test fails.
	logTailLines = 30
)

// Available reports whether the redis-server binary is on PATH.
func Available() bool {
	_, err := exec.LookPath(Binary)
	return err == nil
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago. Another
// process may still take it before the caller binds it; Start copes with that
// by retrying on a new port.
func FreePort(tb testing.TB) int {
	tb.Helper()
	port, err := freePort()
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	return port
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// Server is a redis-server process started by Start. Its methods must be
// called from the goroutine running the test (they may call tb.Fatal), and
// not concurrently with each other.
type Server struct {
	// Addr is the server's address, "127.0.0.1:<Port>".
	Addr string
	// Port is the TCP port the server listens on; it stays the same across
	// Restart.
	Port int
	// Dir is the server's working directory, a fresh t.TempDir. It also holds
	// the process log, redis-server.log.
	Dir string

	bin     string
	conf    string   // config file passed as the first argument, or ""
	args    []string // extra command-line arguments from Start
	logPath string

	mu     sync.Mutex
	proc   *process // the current process; nil before the first start
	paused bool     // proc has been sent SIGSTOP and not SIGCONT

	statsSeq atomic.Int64 // number of Stats calls so far; see Stats.Sub
}

// process is one run of redis-server.
type process struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once the process has exited and been reaped
}

// exited reports whether the process has exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// wait waits up to d for the process to exit and reports whether it did.
func (p *process) wait(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-p.done:
		return true
	case <-t.C:
		return false
	}
}

// Start launches redis-server on a free port of 127.0.0.1, in its own
// t.TempDir and without persistence (--save "" --appendonly no). Extra args
// are appended to the command line, so they can override those defaults,
// e.g. Start(t, "--maxmemory", "10mb"); they must not change --port or
// --bind.
//
// Start waits (for at most a few seconds) until the server answers PING, and
// registers a cleanup that stops it (SIGCONT if paused, SIGTERM, then SIGKILL
// after a short grace period) and reaps the process. The server's stdout and
// stderr go to a log file in its directory; if the test has failed, the
// cleanup logs the last lines of that file.
//
// If redis-server is not on PATH, Start skips the test, or fails it when the
// environment variable LEASELIMIT_REQUIRE_REDIS is "1".
func Start(tb testing.TB, args ...string) *Server {
	tb.Helper()
	return startServer(tb, serverConfig{args: args})
}

// serverConfig describes a server for startServer. Start uses only args;
// StartCluster and StartSentinel need the other fields.
type serverConfig struct {
	// conf, if not empty, is written to the file redis.conf in the server's
	// directory before each start attempt, and that file is passed to
	// redis-server as its first argument (Sentinel needs a writable config
	// file to save its state). Restart reuses the file as the server left it.
	conf string
	// args are extra command-line arguments, as for Start.
	args []string
	// portArgs, if not nil, is called on each start attempt with the port
	// chosen for it and returns more arguments to append to args (e.g. a
	// cluster bus port picked at the same time, so that a clash on it is
	// retried like one on the port). The arguments of the successful attempt
	// are kept for Restart.
	portArgs func(port int) ([]string, error)
}

// startServer is Start with a serverConfig.
func startServer(tb testing.TB, cfg serverConfig) *Server {
	tb.Helper()
	s := newServer(lookBinary(tb, Binary), tb.TempDir(), cfg) // TempDir is removed after our cleanup
	tb.Cleanup(func() { s.cleanup(tb) })
	if err := s.start(cfg); err != nil {
		tb.Fatalf("redistest: %v (its log follows)", err)
	}
	return s
}

// Launch starts redis-server from PATH as Start does, for programs rather
// than tests: on a free port of 127.0.0.1, in a new temporary directory,
// without persistence, with args appended. Close stops it and removes the
// directory.
func Launch(args ...string) (*Server, error) {
	bin, err := exec.LookPath(Binary)
	if err != nil {
		return nil, fmt.Errorf("%s is not on PATH (install the redis-server package): %w", Binary, err)
	}
	dir, err := os.MkdirTemp("", "redistest-")
	if err != nil {
		return nil, err
	}
	s := newServer(bin, dir, serverConfig{args: args})
	if err := s.start(serverConfig{args: args}); err != nil {
		err = fmt.Errorf("%w%s", err, s.logTail())
		os.RemoveAll(dir)
		return nil, err
	}
	return s, nil
}

// Close stops a server from Launch (SIGTERM, then SIGKILL) and removes its
// directory.
func (s *Server) Close() error {
	if !s.stop() {
		return fmt.Errorf("redistest: redis-server (pid %d) did not exit after SIGKILL", s.proc.cmd.Process.Pid)
	}
	return os.RemoveAll(s.Dir)
}

// newServer returns a Server, not yet started, that runs bin in dir.
func newServer(bin, dir string, cfg serverConfig) *Server {
	s := &Server{
		Dir:     dir,
		bin:     bin,
		logPath: filepath.Join(dir, "redis-server.log"),
	}
	if cfg.conf != "" {
		s.conf = filepath.Join(dir, "redis.conf")
	}
	return s
}

// start launches s on a free port, trying another one when the port is
// taken before redis-server binds it.
func (s *Server) start(cfg serverConfig) error {
	for attempt := 1; ; attempt++ {
		port, err := freePort()
		if err != nil {
			return err
		}
		s.setPort(port)
		s.args = append([]string(nil), cfg.args...)
		if cfg.portArgs != nil {
			more, err := cfg.portArgs(port)
			if err != nil {
				return err
			}
			s.args = append(s.args, more...)
		}
		if s.conf != "" {
			if err := os.WriteFile(s.conf, []byte(cfg.conf), 0o644); err != nil {
				return fmt.Errorf("write %s: %w", s.conf, err)
			}
		}
		err = s.launch()
		if err == nil {
			return nil
		}
		// Another process may have taken the port between freePort and the
		// bind; then try another one.
		if !errors.Is(err, errPortInUse) || attempt == startAttempts {
			return fmt.Errorf("start redis-server: %w", err)
		}
	}
}

// lookBinary returns the path of the executable name found on PATH. If there
// is none, it skips the test, or fails it when RequireEnv is "1".
func lookBinary(tb testing.TB, name string) string {
	tb.Helper()
	bin, err := exec.LookPath(name)
	if err != nil {
		msg := fmt.Sprintf("redistest: %s not on PATH; install the redis-server package "+
			"(Redis 7 or later) or add the directory holding %s to PATH "+
			"(set %s=1 to make this a failure instead of a skip)", name, name, RequireEnv)
		if os.Getenv(RequireEnv) == "1" {
			tb.Fatal(msg)
		}
		tb.Skip(msg)
	}
	return bin
}

// errPortInUse reports that redis-server could not have the port to itself.
var errPortInUse = errors.New("port in use")

func (s *Server) setPort(port int) {
	s.Port = port
	s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}

// launch starts a new process on s.Port and waits until it answers. On
// failure the process is gone when launch returns, and the error wraps
// errPortInUse if the port was taken by another process.
func (s *Server) launch() error {
	var args []string
	if s.conf != "" {
		args = append(args, s.conf)
	}
	args = append(args,
		"--port", strconv.Itoa(s.Port),
		"--bind", "127.0.0.1",
		"--dir", s.Dir,
		"--daemonize", "no",
		"--save", "",
		"--appendonly", "no",
		"--logfile", "", // log to stdout, which is the log file
	)
	args = append(args, s.args...)

	logf, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open log file: %w", err)
	}
	logStart, _ := logf.Seek(0, io.SeekEnd)
	fmt.Fprintf(logf, "--- redistest: %s %s\n", Binary, strings.Join(quoteArgs(args), " "))

	p, err := spawn(s.bin, args, s.Dir, logf)
	logf.Close() // the child has its own copy
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.proc, s.paused = p, false
	s.mu.Unlock()

	if err := s.waitReady(p); err != nil {
		killAndReap(p)
		if !errors.Is(err, errPortInUse) && s.logSince(logStart, "Address already in use") {
			err = fmt.Errorf("%w: %w", errPortInUse, err)
		}
		return err
	}
	return nil
}

// logSince reports whether the log, from offset on, contains text.
func (s *Server) logSince(offset int64, text string) bool {
	b, err := os.ReadFile(s.logPath)
	if err != nil || offset < 0 || offset > int64(len(b)) {
		return false
	}
	return bytes.Contains(b[offset:], []byte(text))
}

// spawn starts bin and returns once it is running. A goroutine reaps the
// process; it exits when the process does.
//
// The goroutine starting the process is locked to its OS thread for the
// lifetime of the process: on Linux the child is asked to be killed when its
// parent dies (Pdeathsig), and "parent" there means the thread that forked it,
// so that thread must not exit while the child runs. This keeps a crashed or
// timed-out test binary from leaking redis-server processes.
func spawn(bin string, args []string, dir string, logf *os.File) (*process, error) {
	p := &process{done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer close(p.done)
		cmd := exec.Command(bin, args...)
		cmd.Dir = dir
		cmd.Stdout = logf
		cmd.Stderr = logf
		cmd.SysProcAttr = sysProcAttr()
		if err := cmd.Start(); err != nil {
			started <- fmt.Errorf("run %s: %w", bin, err)
			return
		}
		p.cmd = cmd
		started <- nil
		_ = cmd.Wait() // the exit status of a test server is of no interest
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return p, nil
}

// waitReady polls until the process p answers PING on s.Addr and reports its
// own process id (so that a different server that happens to own the port is
// not mistaken for ours), p exits, or readyTimeout passes.
func (s *Server) waitReady(p *process) error {
	deadline := time.Now().Add(readyTimeout)
	var lastErr error
	for {
		if p.exited() {
			if lastErr == nil {
				return errors.New("redis-server exited at once")
			}
			return fmt.Errorf("redis-server exited before answering PING (last probe: %w)", lastErr)
		}
		if lastErr = probe(s.Addr, p.cmd.Process.Pid); lastErr == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redis-server did not answer PING within %v: %w", readyTimeout, lastErr)
		}
		t := time.NewTimer(20 * time.Millisecond)
		select {
		case <-p.done:
		case <-t.C:
		}
		t.Stop()
	}
}

// probe checks that addr answers PING and is the redis-server with pid.
func probe(addr string, pid int) error {
	rc, err := dialRESP(addr, time.Second)
	if err != nil {
		return err
	}
	defer rc.Close()
	v, err := rc.do("PING")
	if err != nil {
		return fmt.Errorf("PING: %w", err)
	}
	if v != "PONG" {
		return fmt.Errorf("PING: unexpected reply %v", v)
	}
	v, err = rc.do("INFO", "server")
	if err != nil {
		return fmt.Errorf("INFO server: %w", err)
	}
	info, _ := v.(string)
	if got := InfoField(info, "process_id"); got != strconv.Itoa(pid) {
		return fmt.Errorf("%w: %s is served by process %q, not by ours (%d)", errPortInUse, addr, got, pid)
	}
	return nil
}

// killAndReap sends SIGKILL to p and waits for it to be reaped.
func killAndReap(p *process) bool {
	_ = p.cmd.Process.Kill()
	return p.wait(exitTimeout)
}

// stop ends the running process, if any: SIGCONT if paused, SIGTERM, then
// SIGKILL after termGrace. It reports false if the process outlived SIGKILL.
func (s *Server) stop() bool {
	s.mu.Lock()
	p, paused := s.proc, s.paused
	s.paused = false
	s.mu.Unlock()
	if p == nil || p.exited() {
		return true
	}
	if paused {
		_ = resumeProcess(p.cmd.Process)
	}
	if err := terminateProcess(p.cmd.Process); err != nil || !p.wait(termGrace) {
		return killAndReap(p)
	}
	return true
}

// cleanup stops the server at the end of the test.
func (s *Server) cleanup(tb testing.TB) {
	if !s.stop() {
		tb.Errorf("redistest: redis-server (pid %d) did not exit after SIGKILL", s.proc.cmd.Process.Pid)
	}
	if tb.Failed() {
		tb.Logf("redistest: redis-server %s log (%s):%s", s.Addr, s.logPath, s.logTail())
	}
}

// current returns the running process, or calls tb.Fatal if there is none.
func (s *Server) current(tb testing.TB, op string) *process {
	tb.Helper()
	if s.proc == nil || s.proc.exited() {
		tb.Fatalf("redistest: %s: redis-server %s is not running", op, s.Addr)
	}
	return s.proc
}

// Kill sends SIGKILL to the server and waits until the process has exited.
// It does nothing if the server is not running. Use Restart to bring the
// server back on the same port.
func (s *Server) Kill(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.proc
	s.paused = false
	if p == nil || p.exited() {
		return
	}
	if !killAndReap(p) {
		tb.Fatalf("redistest: redis-server (pid %d) did not exit after SIGKILL", p.cmd.Process.Pid)
	}
}

// Restart starts the server again on the same port and directory, with the
// same arguments, and waits until it answers PING. If it is still running it
// is killed first (see Kill). Because there is no persistence, the restarted
// server is empty, and its INFO counters start from zero.
//
// If the port cannot be bound yet (or is briefly held by another process),
// Restart retries for a few seconds.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	s.Kill(tb)
	deadline := time.Now().Add(readyTimeout)
	for {
		err := s.launch()
		if err == nil {
			return
		}
		if !errors.Is(err, errPortInUse) || time.Now().After(deadline) {
			tb.Fatalf("redistest: restart redis-server on %s: %v (its log follows)", s.Addr, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Pause stops the server process with SIGSTOP. The kernel still completes TCP
// handshakes (up to the listen backlog) and buffers requests, but Redis
// never replies, which is what a hung server looks like to clients. Call
// Resume to continue; the cleanup resumes a paused server before stopping it.
func (s *Server) Pause(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.current(tb, "Pause")
	if err := pauseProcess(p.cmd.Process); err != nil {
		tb.Fatalf("redistest: pause redis-server: %v", err)
	}
	s.paused = true
}

// Resume continues a server stopped by Pause, with SIGCONT.
func (s *Server) Resume(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.current(tb, "Resume")
	if err := resumeProcess(p.cmd.Process); err != nil {
		tb.Fatalf("redistest: resume redis-server: %v", err)
	}
	s.paused = false
}

// Client returns a new go-redis client for s.Addr with otherwise default
// options. It is closed by the test's cleanup (before the server is stopped).
func (s *Server) Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// Do runs one command on a fresh, short-lived connection and returns its
// reply; it calls tb.Fatal if the command fails or the server returns an
// error reply. It is meant for housekeeping and checks such as
// Do(t, "SCRIPT", "FLUSH"), Do(t, "KEYS", "*") or Do(t, "TTL", key).
//
// Arguments are sent as strings: string and []byte as is, bool as "1" or
// "0", time.Duration as its number of nanoseconds, nil as "", and anything
// else formatted with fmt.Sprint. The connection speaks RESP2 and sends no
// handshake, so the command is the only one Redis counts for it (see
// Stats.Sub). The reply is a string (status and bulk replies), an int64, nil
// (null replies, e.g. GET of a missing key) or a []any of such values.
func (s *Server) Do(tb testing.TB, args ...any) any {
	tb.Helper()
	if len(args) == 0 {
		tb.Fatal("redistest: Do needs a command")
	}
	rc, err := dialRESP(s.Addr, cmdTimeout)
	if err != nil {
		tb.Fatalf("redistest: Do %v: %v", args, err)
	}
	defer rc.Close()
	v, err := rc.do(args...)
	if err != nil {
		tb.Fatalf("redistest: Do %v: %v", args, err)
	}
	return v
}

// Stats is a snapshot of the server's command counters. Take snapshots with
// Server.Stats and compare them with Sub.
type Stats struct {
	// TotalCommands is total_commands_processed from INFO stats.
	TotalCommands int64
	// Calls maps a command name, in lower case as Redis reports it in INFO
	// commandstats (e.g. "evalsha", "eval", "hset", or "script|flush" for a
	// subcommand), to its number of calls. Commands never called are absent.
	Calls map[string]int64
	// Usec maps the same names to the microseconds Redis spent in them (usec
	// in INFO commandstats); a script's includes the commands it ran, which
	// also count under their own names.
	Usec map[string]int64
	// CPU is the server's CPU time so far (used_cpu_sys + used_cpu_user
	// from INFO cpu), main thread and all.
	CPU time.Duration

	seq int64 // 1-based number of the Server.Stats call that took this snapshot
}

// Stats reads the server's counters from the sections "stats" and
// "commandstats" of INFO, with a single INFO command sent over its own
// short-lived connection. See Stats.Sub for how to discount the INFO commands
// Stats itself sends. Stats calls tb.Fatal on error; it must not be called
// while the server is paused.
func (s *Server) Stats(tb testing.TB) Stats {
	tb.Helper()
	st, err := s.readStats()
	if err != nil {
		tb.Fatalf("redistest: Stats of %s: %v", s.Addr, err)
	}
	return st
}

func (s *Server) readStats() (Stats, error) {
	seq := s.statsSeq.Add(1)
	st, err := ReadStats(s.Addr)
	st.seq = seq
	return st, err
}

// ReadStats reads the counters of the Redis at addr (any Redis, not only a
// Server) with a single INFO command on a fresh connection with no
// handshake, so the reading adds exactly one command to the next one.
// Snapshots from it carry no sequence number: Sub discounts nothing.
func ReadStats(addr string) (Stats, error) {
	// A single INFO command returning both sections ("all" includes
	// commandstats; naming several sections needs Redis 7).
	info, err := ReadInfo(addr, "all")
	if err != nil {
		return Stats{}, err
	}
	return parseStats(info)
}

// ReadInfo returns the INFO section of the Redis at addr, read with a single
// command on a fresh connection with no handshake.
func ReadInfo(addr, section string) (string, error) {
	rc, err := dialRESP(addr, cmdTimeout)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	v, err := rc.do("INFO", section)
	if err != nil {
		return "", fmt.Errorf("INFO: %w", err)
	}
	info, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("INFO: unexpected reply type %T", v)
	}
	return info, nil
}

// parseStats extracts the counters from an INFO reply.
func parseStats(info string) (Stats, error) {
	st := Stats{Calls: make(map[string]int64), Usec: make(map[string]int64)}
	found := false
	for line := range strings.Lines(info) {
		key, val, ok := strings.Cut(strings.TrimRight(line, "\r\n"), ":")
		if !ok {
			continue
		}
		switch {
		case key == "used_cpu_sys" || key == "used_cpu_user":
			secs, err := strconv.ParseFloat(val, 64)
			if err != nil {
				return Stats{}, fmt.Errorf("parse %s: %w", key, err)
			}
			st.CPU += time.Duration(secs * float64(time.Second))
		case key == "total_commands_processed":
			n, err := strconv.ParseInt(val, 10, 64)
			if err != nil {
				return Stats{}, fmt.Errorf("parse %s: %w", key, err)
			}
			st.TotalCommands, found = n, true
		case strings.HasPrefix(key, "cmdstat_"):
			name := strings.ToLower(strings.TrimPrefix(key, "cmdstat_"))
			for field := range strings.SplitSeq(val, ",") {
				counter, c, _ := strings.Cut(field, "=")
				var into map[string]int64
				switch counter {
				case "calls":
					into = st.Calls
				case "usec":
					into = st.Usec
				default:
					continue
				}
				n, err := strconv.ParseInt(c, 10, 64)
				if err != nil {
					return Stats{}, fmt.Errorf("parse %s: %w", key, err)
				}
				into[name] = n
			}
		}
	}
	if !found {
		return Stats{}, errors.New("INFO reply has no total_commands_processed")
	}
	return st, nil
}

// Sub returns the counters accumulated between the snapshot earlier and s,
// both taken from the same Server (and the same run of it: counters restart
// from zero after Restart). Commands whose count did not change are absent
// from the result's Calls. The result is a difference, not a snapshot, and
// should not itself be passed to Sub.
//
// Redis counts the INFO commands that Stats sends like any other command, and
// Sub removes them, so the result counts only the commands sent by others:
// clients (including their connection handshakes, such as HELLO and CLIENT
// SETINFO) and Do (which adds exactly its one command). Precisely: each Stats
// call sends exactly one command, INFO, on a fresh connection with no
// handshake, and Redis updates its counters only after a command has
// completed, so a snapshot includes the INFO of every earlier Stats call on
// the Server but not its own. Between earlier and s, Redis therefore counted n
// INFO commands from Stats, n being the number of Stats calls from the one
// that took earlier (inclusive) to the one that took s (exclusive); every
// snapshot records its call's sequence number, and Sub subtracts n from both
// TotalCommands and Calls["info"]. This is exact as long as Stats calls on a
// Server do not overlap. INFO commands sent by other connections are kept.
// Usec keeps the time of every INFO command, Stats' own included.
func (s Stats) Sub(earlier Stats) Stats {
	own := s.seq - earlier.seq
	d := Stats{
		TotalCommands: s.TotalCommands - earlier.TotalCommands - own,
		Calls:         subCounts(s.Calls, earlier.Calls),
		Usec:          subCounts(s.Usec, earlier.Usec),
		CPU:           s.CPU - earlier.CPU,
	}
	if d.Calls["info"] -= own; d.Calls["info"] == 0 {
		delete(d.Calls, "info")
	}
	return d
}

// subCounts returns later - earlier per name, leaving out the names whose
// count did not change.
func subCounts(later, earlier map[string]int64) map[string]int64 {
	d := make(map[string]int64)
	for name, n := range later {
		if n -= earlier[name]; n != 0 {
			d[name] = n
		}
	}
	return d
}

// InfoField returns the value of key in an INFO reply, or "".
func InfoField(info, key string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), key+":"); ok {
			return v
		}
	}
	return ""
}

// logTail returns the last lines of the server log, formatted for appending
// to a message, or "" if there is nothing to show.
func (s *Server) logTail() string {
	b, err := os.ReadFile(s.logPath)
	if err != nil || len(b) == 0 {
		return ""
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > logTailLines {
		lines = lines[len(lines)-logTailLines:]
	}
	return "\n\t" + string(bytes.Join(lines, []byte("\n\t")))
}

// quoteArgs quotes empty and space-containing arguments for the log.
func quoteArgs(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " \t\"") {
			a = strconv.Quote(a)
		}
		out[i] = a
	}
	return out
}
