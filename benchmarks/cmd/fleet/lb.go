package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"text/template"
	"time"
)

// balancer is the load balancer in front of the instances: round robin,
// keep-alive on both sides, appending its peer to X-Forwarded-For.
type balancer interface {
	addr() string
	describe() string // e.g. "nginx 1.22.1", "in-process Go reverse proxy"
	pid() int         // its process (group)
	stop() error
}

// lbKinds are the values of -lb; auto takes the first one installed.
var lbKinds = []string{"auto", "nginx", "haproxy", "go"}

// startBalancer starts the load balancer of kind (see lbKinds) in front of
// backends, its files in dir.
func startBalancer(ctx context.Context, kind string, backends []string, dir string) (balancer, error) {
	if kind == "auto" {
		kind = "go"
		for _, k := range []string{"nginx", "haproxy"} {
			if _, err := exec.LookPath(k); err == nil {
				kind = k
				break
			}
		}
	}
	switch kind {
	case "nginx", "haproxy":
		bin, err := exec.LookPath(kind)
		if err != nil {
			return nil, fmt.Errorf("-lb %s: %w", kind, err)
		}
		return startOnFreePort(func(port int) (balancer, error) {
			return startExternal(ctx, kind, bin, port, backends, dir)
		})
	case "go":
		return startOnFreePort(func(port int) (balancer, error) {
			return startGoProxy(ctx, port, backends, dir)
		})
	}
	return nil, fmt.Errorf("-lb %q: want one of %s", kind, strings.Join(lbKinds, ", "))
}

// nginxConf: one upstream, round robin (nginx's default), keep-alive
// connections to the instances, the client appended to X-Forwarded-For.
// One process, without a master: the kernel then stops all of nginx if
// fleet dies (a master's workers would outlive it), and one process
// carries these rates with CPU to spare.
var nginxConf = template.Must(template.New("nginx").Parse(`# written by benchmarks/cmd/fleet
daemon off;
master_process off;
{{if .Root}}user root;
{{end}}pid {{.Dir}}/nginx.pid;
error_log {{.Dir}}/nginx-error.log warn;
events { worker_connections 4096; }
http {
	access_log off;
	client_body_temp_path {{.Dir}}/client_body;
	proxy_temp_path {{.Dir}}/proxy;
	fastcgi_temp_path {{.Dir}}/fastcgi;
	uwsgi_temp_path {{.Dir}}/uwsgi;
	scgi_temp_path {{.Dir}}/scgi;
	upstream fleet {
{{range .Backends}}		server {{.}};
{{end}}		keepalive 128;
	}
	server {
		listen {{.Listen}};
		keepalive_requests 1000000;
		location / {
			proxy_pass http://fleet;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
			proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
		}
	}
}
`))

// haproxyConf: round robin, keep-alive on both sides, option forwardfor
// (adds the client as an X-Forwarded-For line of its own).
var haproxyConf = template.Must(template.New("haproxy").Parse(`# written by benchmarks/cmd/fleet
global
	maxconn 4000
defaults
	mode http
	timeout connect 5s
	timeout client 60s
	timeout server 60s
	option http-keep-alive
	option forwardfor
frontend fleet
	bind {{.Listen}}
	default_backend instances
backend instances
	balance roundrobin
{{range $i, $b := .Backends}}	server s{{$i}} {{$b}}
{{end}}`))

// external is nginx or haproxy, run in the foreground.
type external struct {
	listen, desc string
	p            *proc
}

func startExternal(ctx context.Context, kind, bin string, port int, backends []string, dir string) (*external, error) {
	listen := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	data := struct {
		Dir, Listen string
		Backends    []string
		Root        bool
	}{dir, listen, backends, os.Geteuid() == 0}
	conf := filepath.Join(dir, kind+".conf")
	f, err := os.Create(conf)
	if err != nil {
		return nil, err
	}
	tmpl := nginxConf
	args := []string{"-p", dir, "-c", conf, "-e", filepath.Join(dir, "nginx-error.log")}
	if kind == "haproxy" {
		tmpl = haproxyConf
		args = []string{"-db", "-f", conf}
	}
	err = tmpl.Execute(f, data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	p, err := spawn(kind, bin, args, dir, filepath.Join(dir, kind+".log"))
	if err != nil {
		return nil, err
	}
	if err := waitHealthy(ctx, p, listen); err != nil {
		_ = p.kill()
		return nil, err
	}
	return &external{listen: listen, desc: version(ctx, kind, bin), p: p}, nil
}

func (e *external) addr() string     { return e.listen }
func (e *external) describe() string { return e.desc }
func (e *external) pid() int         { return e.p.cmd.Process.Pid }
func (e *external) stop() error      { return e.p.stop(5 * time.Second) }

// version returns "nginx 1.22.1" or "haproxy 2.6.12", or kind alone.
func version(ctx context.Context, kind, bin string) string {
	out, _ := exec.CommandContext(ctx, bin, "-v").CombinedOutput()
	line, _, _ := strings.Cut(string(out), "\n")
	// nginx: "nginx version: nginx/1.22.1"; haproxy: "HAProxy version 2.6.12-1 2023/...".
	if _, v, ok := strings.Cut(line, "nginx/"); ok {
		return kind + " " + strings.Fields(v)[0]
	}
	if _, v, ok := strings.Cut(line, "version "); ok {
		return kind + " " + strings.Fields(v)[0]
	}
	return kind
}

// goProxy is the fallback: net/http/httputil's ReverseProxy, round robin,
// run by this command as a process of its own (-proxy-listen), so that it
// does not share a Go runtime with the load generator.
type goProxy struct {
	listen string
	p      *proc
}

func startGoProxy(ctx context.Context, port int, backends []string, dir string) (*goProxy, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find this executable to run the Go proxy: %w", err)
	}
	listen := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	args := []string{"-proxy-listen", listen, "-proxy-backends", strings.Join(backends, ",")}
	p, err := spawn("go proxy", self, args, dir, filepath.Join(dir, "goproxy.log"))
	if err != nil {
		return nil, err
	}
	if err := waitHealthy(ctx, p, listen); err != nil {
		_ = p.kill()
		return nil, err
	}
	return &goProxy{listen: listen, p: p}, nil
}

func (g *goProxy) addr() string { return g.listen }
func (g *goProxy) describe() string {
	return "Go reverse proxy (net/http/httputil, a process of its own)"
}
func (g *goProxy) pid() int    { return g.p.cmd.Process.Pid }
func (g *goProxy) stop() error { return g.p.stop(5 * time.Second) }

// serveProxy is fleet -proxy-listen: it serves a round-robin reverse proxy
// to backends on listen until SIGTERM or SIGINT.
func serveProxy(ctx context.Context, listen string, backends []string) error {
	if len(backends) == 0 {
		return errors.New("-proxy-backends: none")
	}
	targets := make([]*url.URL, len(backends))
	for i, b := range backends {
		targets[i] = &url.URL{Scheme: "http", Host: b}
	}
	var next atomic.Uint64
	rp := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(targets[(next.Add(1)-1)%uint64(len(targets))])
			// Append to the client's X-Forwarded-For as nginx and HAProxy
			// do (Rewrite starts from a request without it).
			r.Out.Header["X-Forwarded-For"] = r.In.Header["X-Forwarded-For"]
			r.SetXForwarded()
		},
		Transport: &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        4096,
			MaxIdleConnsPerHost: 1024,
			IdleConnTimeout:     90 * time.Second,
		},
		ErrorLog: log.New(os.Stderr, "proxy: ", log.LstdFlags),
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: rp, ReadHeaderTimeout: 5 * time.Second, IdleTimeout: 90 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	err = srv.Close()
	if serr := <-errc; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}
