package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// readyTimeout bounds the wait for a process to answer (PING, GET /healthz).
	readyTimeout = 15 * time.Second
	// exitTimeout bounds the wait for a process to be reaped after SIGKILL.
	exitTimeout = 10 * time.Second
	// startAttempts is how many free ports a start tries before giving up.
	startAttempts = 4
	// logTailLines is how many lines of a process's log an error shows.
	logTailLines = 20
)

// proc is one child process. Its output goes to a log file. It runs in a
// process group of its own, so that Ctrl-C in a terminal reaches only this
// command, which then stops its children in order (load balancer, servers,
// Redis); on Linux the kernel kills it if this command dies without
// stopping it.
type proc struct {
	name    string
	logPath string
	cmd     *exec.Cmd
	done    chan struct{} // closed once the process has exited and been reaped

	mu     sync.Mutex
	paused bool // sent SIGSTOP and not SIGCONT
}

// spawn starts bin with args in dir, its stdout and stderr appended to
// logPath. A goroutine reaps the process.
//
// That goroutine stays locked to its OS thread while the process runs: on
// Linux the child asks to be killed when its parent dies (Pdeathsig), and the
// parent there is the thread that forked it, which must not exit before the
// child.
func spawn(name, bin string, args []string, dir, logPath string) (*proc, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logf.Close() // the child has its own copy
	fmt.Fprintf(logf, "--- fleet: %s %s\n", bin, strings.Join(args, " "))
	p := &proc{name: name, logPath: logPath, done: make(chan struct{})}
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
		_ = cmd.Wait() // how it exited is in its log
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return p, nil
}

// exited reports whether the process has exited.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// wait waits up to d for the process to exit and reports whether it did.
func (p *proc) wait(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-p.done:
		return true
	case <-t.C:
		return false
	}
}

// pause stops the process with SIGSTOP.
func (p *proc) pause() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := pauseProcess(p.cmd.Process); err != nil {
		return fmt.Errorf("SIGSTOP %s: %w", p.name, err)
	}
	p.paused = true
	return nil
}

// resume continues the process with SIGCONT.
func (p *proc) resume() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := resumeProcess(p.cmd.Process); err != nil {
		return fmt.Errorf("SIGCONT %s: %w", p.name, err)
	}
	p.paused = false
	return nil
}

// kill sends SIGKILL to the process's group and waits until it is reaped.
func (p *proc) kill() error {
	killGroup(p.cmd.Process)
	if !p.wait(exitTimeout) {
		return fmt.Errorf("%s (pid %d) outlived SIGKILL", p.name, p.cmd.Process.Pid)
	}
	return nil
}

// stop ends the process if it runs: SIGCONT if paused, SIGTERM, and SIGKILL
// to its whole group after grace.
func (p *proc) stop(grace time.Duration) error {
	if p.exited() {
		return nil
	}
	p.mu.Lock()
	if p.paused {
		_ = resumeProcess(p.cmd.Process)
		p.paused = false
	}
	p.mu.Unlock()
	if err := terminateProcess(p.cmd.Process); err == nil && p.wait(grace) {
		return nil
	}
	return p.kill()
}

// logTail returns the last lines of the process's log, indented, for an
// error message.
func (p *proc) logTail() string { return fileTail(p.logPath) }

func fileTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > logTailLines {
		lines = lines[len(lines)-logTailLines:]
	}
	return "\n\t" + strings.Join(lines, "\n\t")
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// startOnFreePort runs start with free ports until one works: another
// process may take a port between freePort and the child's bind.
func startOnFreePort[T any](start func(port int) (T, error)) (T, error) {
	var zero T
	var err error
	for range startAttempts {
		var port int
		if port, err = freePort(); err != nil {
			return zero, err
		}
		var v T
		if v, err = start(port); err == nil {
			return v, nil
		}
	}
	return zero, err
}

// waitUntil polls ready every 20ms until it returns nil, p exits, ctx ends
// or readyTimeout passes. p may be nil (an in-process server).
func waitUntil(ctx context.Context, p *proc, what string, ready func() error) error {
	deadline := time.Now().Add(readyTimeout)
	name, tail := "the in-process proxy", ""
	var done <-chan struct{}
	if p != nil {
		name, done = p.name, p.done
	}
	for {
		err := ready()
		if err == nil {
			return nil
		}
		if p != nil {
			tail = "; its log:" + p.logTail()
			if p.exited() {
				return fmt.Errorf("%s exited before it could %s (last try: %v)%s", name, what, err, tail)
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not %s within %v (last try: %v)%s", name, what, readyTimeout, err, tail)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-done:
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// redisServer is the one redis-server of the fleet. Kill and restart keep
// its port.
type redisServer struct {
	bin, dir string
	port     int
	addr     string
	version  string
	p        *proc
}

func startRedis(ctx context.Context, dir string) (*redisServer, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server is not on PATH (Debian/Ubuntu: apt-get install redis-server): %w", err)
	}
	return startOnFreePort(func(port int) (*redisServer, error) {
		r := &redisServer{bin: bin, dir: dir, port: port, addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}
		if err := r.start(ctx); err != nil {
			return nil, err
		}
		return r, nil
	})
}

// start runs redis-server on r.port and waits until it answers PING.
func (r *redisServer) start(ctx context.Context) error {
	args := []string{
		"--port", strconv.Itoa(r.port),
		"--bind", "127.0.0.1",
		"--dir", r.dir,
		"--daemonize", "no",
		"--save", "",
		"--appendonly", "no",
		"--logfile", "",
	}
	p, err := spawn("redis-server", r.bin, args, r.dir, filepath.Join(r.dir, "redis-server.log"))
	if err != nil {
		return err
	}
	r.p = p
	rdb := redis.NewClient(&redis.Options{Addr: r.addr, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
	defer rdb.Close()
	err = waitUntil(ctx, p, "answer PING", func() error {
		info, err := rdb.Info(ctx, "server").Result()
		if err != nil {
			return err
		}
		// The port may belong to another server that took it first.
		if pid := infoField(info, "process_id"); pid != strconv.Itoa(p.cmd.Process.Pid) {
			return fmt.Errorf("%s is served by process %s, not ours", r.addr, pid)
		}
		r.version = infoField(info, "redis_version")
		return nil
	})
	if err != nil {
		_ = p.kill()
		return err
	}
	return nil
}

// restart starts redis-server again on the same port after a kill, trying
// for a few seconds if the port is not free yet.
func (r *redisServer) restart(ctx context.Context) error {
	var err error
	for range startAttempts {
		if err = r.start(ctx); err == nil || ctx.Err() != nil {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
	return err
}

func (r *redisServer) stop() error { return r.p.stop(5 * time.Second) }

// infoField returns the value of key in an INFO reply, or "".
func infoField(info, key string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), key+":"); ok {
			return v
		}
	}
	return ""
}

// buildServer builds examples/httpserver of the root module in src into dir
// and returns the binary's path.
func buildServer(ctx context.Context, src, dir string) (string, error) {
	bin := filepath.Join(dir, "httpserver")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./examples/httpserver")
	cmd.Dir = src
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./examples/httpserver in %s: %w\n%s", src, err, out)
	}
	return bin, nil
}

// rootModuleDir returns the directory of the root module, as the workspace
// (the repository's go.work) provides it.
func rootModuleDir(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", "github.com/leaselimit/leaselimit").Output()
	if err != nil {
		return "", fmt.Errorf("go list -m github.com/leaselimit/leaselimit (run fleet inside the repository, whose go.work provides the root module, or pass -server-src or -server-bin): %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// checkServerFlags runs bin -h and checks that it has the flags fleet
// passes: examples/httpserver before they were added has none of them.
func checkServerFlags(ctx context.Context, bin string) error {
	out, _ := exec.CommandContext(ctx, bin, "-h").CombinedOutput()
	for _, f := range serverFlags {
		if !bytes.Contains(out, []byte("-"+f+" ")) && !bytes.Contains(out, []byte("-"+f+"\n")) {
			return fmt.Errorf("%s has no -%s flag: build examples/httpserver as it is now against the library you want to measure (see README.md)", bin, f)
		}
	}
	return nil
}

// serverFlags are the flags of examples/httpserver that fleet sets.
var serverFlags = []string{"addr", "redis", "rate", "period", "burst", "daily", "failure-mode", "fleet-size", "timeout", "trusted-proxies", "exact"}

// instance is one process of examples/httpserver.
type instance struct {
	addr string
	p    *proc
}

// startInstance starts the server i of the fleet and waits until it
// answers GET /healthz.
func startInstance(ctx context.Context, cfg *config, bin, redisAddr, dir string, i int) (*instance, error) {
	return startOnFreePort(func(port int) (*instance, error) {
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		args := []string{
			"-addr", addr,
			"-redis", redisAddr,
			"-rate", strconv.FormatInt(cfg.limit.Rate, 10),
			"-period", cfg.limit.Period.String(),
			"-burst", strconv.FormatInt(cfg.limit.Burst, 10),
			"-daily", "0",
			"-failure-mode", cfg.mode,
			"-fleet-size", strconv.Itoa(cfg.instances),
			"-timeout", cfg.timeout.String(),
			"-trusted-proxies", "127.0.0.0/8",
		}
		if cfg.exact {
			args = append(args, "-exact")
		}
		name := fmt.Sprintf("httpserver %d", i+1)
		p, err := spawn(name, bin, args, dir, filepath.Join(dir, fmt.Sprintf("httpserver-%d.log", i+1)))
		if err != nil {
			return nil, err
		}
		if err := waitHealthy(ctx, p, addr); err != nil {
			_ = p.kill()
			return nil, err
		}
		return &instance{addr: addr, p: p}, nil
	})
}

// waitHealthy waits until GET http://addr/healthz answers 200.
func waitHealthy(ctx context.Context, p *proc, addr string) error {
	c := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	return waitUntil(ctx, p, "answer GET /healthz on "+addr, func() error {
		req, err := http.NewRequestWithContext(ctx, "GET", "http://"+addr+"/healthz", nil)
		if err != nil {
			return err
		}
		resp, err := c.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return errors.New(resp.Status)
		}
		return nil
	})
}
