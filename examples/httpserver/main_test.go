package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"math"
	"net"
	"net/http"
	"net/netip"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/internal/syncbuf"
	"github.com/leaselimit/leaselimit/policy"
)

func TestMain(m *testing.M) {
	redistest.VerifyTestMain(m)
}

// lines is an io.Writer that hands each Write to a channel.
type lines chan string

func (l lines) Write(p []byte) (int, error) {
	select {
	case l <- string(p):
	default:
	}
	return len(p), nil
}

// start runs the command with args on a free loopback port until the test
// ends, and returns its base URL and its stderr.
//
// The budget of a Redis call is raised from 100ms to 10s (args may set it
// again): under -race on a loaded machine a miniredis script call can take
// longer than 100ms, and the default failure policy (FailOpen) would then
// admit the request, as designed, but not what the tests count.
func start(t *testing.T, args ...string) (string, *syncbuf.Buffer) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := make(lines, 16)
	stderr := &syncbuf.Buffer{}
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, append([]string{"-addr", "127.0.0.1:0", "-timeout", "10s"}, args...), out, stderr)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case code := <-done:
			if code != 0 {
				t.Errorf("exit code %d; stderr:\n%s", code, stderr)
			}
		case <-time.After(15 * time.Second):
			t.Error("no graceful shutdown")
		}
	})

	listening := regexp.MustCompile(`listening on (http://\S+)`)
	for {
		select {
		case l := <-out:
			if m := listening.FindStringSubmatch(l); m != nil {
				return m[1], stderr
			}
		case code := <-done:
			done <- code
			t.Fatalf("run returned %d before listening; stderr:\n%s", code, stderr)
		case <-time.After(10 * time.Second):
			t.Fatal("no listening line")
		}
	}
}

// get sends GET url with the header fields in hdr (name, value, ...).
func get(t *testing.T, url string, hdr ...string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	client := &http.Client{Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp, string(body)
}

// TestRun starts the command on the embedded Redis, sends it requests and
// stops it as SIGINT would (by ending ctx).
func TestRun(t *testing.T) {
	base, _ := start(t, "-legacy-headers")
	var codes []int
	for i := 0; i < 11; i++ {
		resp, body := get(t, base+"/")
		codes = append(codes, resp.StatusCode)
		if i == 0 {
			if !strings.HasPrefix(body, "hello, 127.0.0.1") {
				t.Errorf("body %q", body)
			}
			if got := resp.Header.Get("RateLimit-Policy"); got != `"burst";q=10;w=60, "daily";q=1000;w=86400` {
				t.Errorf("RateLimit-Policy %q", got)
			}
			// The daily quota's t is the seconds until midnight UTC.
			untilMidnight := time.Until(time.Now().UTC().Truncate(24 * time.Hour).Add(24 * time.Hour))
			m := regexp.MustCompile(`^"burst";r=9;t=6, "daily";r=999;t=(\d+)$`).FindStringSubmatch(resp.Header.Get("RateLimit"))
			if m == nil {
				t.Errorf("RateLimit %q", resp.Header.Get("RateLimit"))
			} else if secs, _ := strconv.Atoi(m[1]); math.Abs(float64(secs)-untilMidnight.Seconds()) > 5 {
				t.Errorf("RateLimit %q: daily t=%d, want the %.0f s until midnight UTC", resp.Header.Get("RateLimit"), secs, untilMidnight.Seconds())
			}
			if resp.Header.Get("X-RateLimit-Remaining") != "9" {
				t.Errorf("X-RateLimit-Remaining %q", resp.Header.Get("X-RateLimit-Remaining"))
			}
		}
		if resp.StatusCode == http.StatusTooManyRequests && resp.Header.Get("Retry-After") == "" {
			t.Error("429 without Retry-After")
		}
	}
	for i, c := range codes {
		if want := map[bool]int{true: 200, false: 429}[i < 10]; c != want {
			t.Errorf("statuses %v, want 10 × 200 then 429", codes)
			break
		}
	}
}

// TestRunLimitFlags: -rate, -period, -burst and -daily 0 reach the server.
// (A token comes back every 30 minutes: none during the test.)
func TestRunLimitFlags(t *testing.T) {
	base, _ := start(t, "-rate", "2", "-period", "1h", "-burst", "3", "-daily", "0")
	for i := 0; i < 4; i++ {
		resp, _ := get(t, base+"/")
		if want := map[bool]int{true: 200, false: 429}[i < 3]; resp.StatusCode != want {
			t.Fatalf("request %d: status %d, want %d", i, resp.StatusCode, want)
		}
		if got := resp.Header.Get("RateLimit-Policy"); strings.Contains(got, "daily") || !strings.HasPrefix(got, `"burst";`) {
			t.Errorf("RateLimit-Policy %q, want the burst limit alone", got)
		}
	}
}

// TestRunTrustedProxies: a request forwarded by an untrusted peer is keyed by
// the peer, and the server warns once; -trusted-proxies makes it honour
// X-Forwarded-For, without a warning.
func TestRunTrustedProxies(t *testing.T) {
	const warning = "is keyed by the peer's address"
	t.Run("untrusted", func(t *testing.T) {
		base, stderr := start(t)
		if _, body := get(t, base+"/"); body != "hello, 127.0.0.1\n" {
			t.Errorf("body %q", body)
		}
		if strings.Contains(stderr.String(), warning) {
			t.Errorf("warning for a request without X-Forwarded-For:\n%s", stderr)
		}
		for i := 0; i < 3; i++ {
			if _, body := get(t, base+"/", "X-Forwarded-For", "198.51.100.1"); body != "hello, 127.0.0.1\n" {
				t.Errorf("body %q", body)
			}
		}
		logs := stderr.String()
		if n := strings.Count(logs, warning); n != 1 {
			t.Fatalf("%d warnings, want 1:\n%s", n, logs)
		}
		for _, s := range []string{"level=WARN", "header=X-Forwarded-For", "remote_addr=127.0.0.1", `127.0.0.1/32`} {
			if !strings.Contains(logs, s) {
				t.Errorf("warning without %q:\n%s", s, logs)
			}
		}
	})
	t.Run("trusted", func(t *testing.T) {
		base, stderr := start(t, "-trusted-proxies", "10.0.0.0/8, 127.0.0.1")
		if _, body := get(t, base+"/", "X-Forwarded-For", "198.51.100.1"); body != "hello, 198.51.100.1\n" {
			t.Errorf("body %q", body)
		}
		if strings.Contains(stderr.String(), warning) {
			t.Errorf("warning for a trusted proxy:\n%s", stderr)
		}
	})
}

// TestRunFailureModes: with Redis unreachable, the failure mode and the
// fleet size decide.
func TestRunFailureModes(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := ln.Addr().String()
	ln.Close() // nothing listens there now: connections are refused

	for _, tc := range []struct {
		mode  string
		fleet string
		want  []bool // admitted, request by request
	}{
		{"open", "1", []bool{true, true, true, true, true}},
		{"closed", "1", []bool{false, false}},
		{"local", "2", []bool{true, true, false, false}}, // 4/min over 2 instances: 2 here
	} {
		t.Run(tc.mode, func(t *testing.T) {
			base, stderr := start(t, "-redis", down, "-timeout", "100ms",
				"-failure-mode", tc.mode, "-fleet-size", tc.fleet, "-rate", "4", "-daily", "0")
			for i, want := range tc.want {
				resp, body := get(t, base+"/")
				if got := resp.StatusCode == http.StatusOK; got != want {
					t.Fatalf("request %d: status %d (%s), want admitted %v; stderr:\n%s", i, resp.StatusCode, body, want, stderr)
				}
			}
		})
	}
}

func TestParseFlags(t *testing.T) {
	c, err := parseFlags(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.addr != "127.0.0.1:8080" || c.redis != nil || c.mode != policy.FailOpen || c.fleet != 1 ||
		c.timeout != leaselimit.DefaultTimeout || c.exact || c.cfg.LegacyHeaders || len(c.cfg.TrustedProxies) != 0 {
		t.Errorf("defaults: %+v", c)
	}
	if want := policy.PerMinute(10).WithName("burst"); c.cfg.Burst != want {
		t.Errorf("burst %v, want %v", c.cfg.Burst, want)
	}
	if want := policy.Quota("daily", 1000, policy.Day, time.UTC); c.cfg.Daily != want {
		t.Errorf("daily %v, want %v", c.cfg.Daily, want)
	}
	if len(c.options()) != 3 {
		t.Errorf("%d options, want 3", len(c.options()))
	}

	c, err = parseFlags([]string{
		"-addr", ":9000", "-redis", "redis://:secret@10.0.0.9:6380/2",
		"-rate", "100", "-period", "1s", "-burst", "200", "-daily", "0",
		"-failure-mode", "local", "-fleet-size", "4", "-timeout", "300ms",
		"-trusted-proxies", " 10.0.0.0/8,fd00::/8 ,192.0.2.7,,fe80::1%eth0",
		"-legacy-headers", "-exact",
	}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.addr != ":9000" || c.redis == nil || c.redis.Addr != "10.0.0.9:6380" || c.redis.DB != 2 || c.redis.Password != "secret" {
		t.Errorf("addresses: %q, %+v", c.addr, c.redis)
	}
	if want := (policy.Limit{Name: "burst", Rate: 100, Period: time.Second, Burst: 200}); c.cfg.Burst != want {
		t.Errorf("burst %v, want %v", c.cfg.Burst, want)
	}
	if c.cfg.Daily != (policy.Limit{}) {
		t.Errorf("daily %v, want none", c.cfg.Daily)
	}
	if c.mode != policy.FailLocal || c.fleet != 4 || c.timeout != 300*time.Millisecond || !c.exact || !c.cfg.LegacyHeaders {
		t.Errorf("mode %v, fleet %d, timeout %v, exact %v, legacy %v", c.mode, c.fleet, c.timeout, c.exact, c.cfg.LegacyHeaders)
	}
	if len(c.options()) != 4 {
		t.Errorf("%d options, want 4", len(c.options()))
	}
	want := []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8"),
		netip.MustParsePrefix("192.0.2.7/32"), netip.MustParsePrefix("fe80::1/128"),
	}
	if !reflect.DeepEqual(c.cfg.TrustedProxies, want) {
		t.Errorf("trusted proxies %v, want %v", c.cfg.TrustedProxies, want)
	}
	for _, m := range []string{"open", "closed", "local"} {
		if c, err := parseFlags([]string{"-failure-mode", m}, io.Discard); err != nil || c.mode.String() != m {
			t.Errorf("-failure-mode %s: %v, %v", m, c, err)
		}
	}
}

// TestParseFlagsErrors: every bad value is named on stderr, and run exits 2.
func TestParseFlagsErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-nope"}, "flag provided but not defined: -nope"},
		{[]string{"-rate", "ten"}, `invalid value "ten" for flag -rate`},
		{[]string{"extra"}, `unexpected argument "extra"`},
		{[]string{"-rate", "0"}, "-rate 0: must be at least 1"},
		{[]string{"-rate", "-5"}, "-rate -5: must be at least 1"},
		{[]string{"-period", "0s"}, "-period 0s: must be > 0"},
		{[]string{"-period", "1ns"}, "-rate, -period, -burst: policy: invalid limit: burst: period 1ns must be a whole number of microseconds"},
		{[]string{"-burst", "-1"}, "-burst -1: must be >= 0"},
		{[]string{"-daily", "-1"}, "-daily -1: must be >= 0"},
		{[]string{"-fleet-size", "0"}, "-fleet-size 0: must be at least 1"},
		{[]string{"-timeout", "0s"}, "-timeout 0s: must be > 0"},
		{[]string{"-failure-mode", "half"}, `-failure-mode "half": want open, closed or local`},
		{[]string{"-failure-mode", "Open"}, `-failure-mode "Open": want open, closed or local`},
		{[]string{"-trusted-proxies", "10.0.0.0/33"}, `-trusted-proxies: "10.0.0.0/33" is neither a CIDR prefix`},
		{[]string{"-trusted-proxies", "10.0.0.0/8,lb.internal"}, `"lb.internal" is neither a CIDR prefix`},
		{[]string{"-redis", "redis://h:notaport"}, `-redis "redis://h:notaport"`},
	} {
		var stderr bytes.Buffer
		_, err := parseFlags(tc.args, &stderr)
		if err == nil {
			t.Errorf("%q: no error", tc.args)
			continue
		}
		if !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%q: stderr %q, want it to contain %q", tc.args, stderr.String(), tc.want)
		}
		if code := run(context.Background(), tc.args, io.Discard, io.Discard); code != 2 {
			t.Errorf("%q: exit code %d, want 2", tc.args, code)
		}
	}
}

func TestHelp(t *testing.T) {
	var stderr bytes.Buffer
	if _, err := parseFlags([]string{"-h"}, &stderr); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v, want flag.ErrHelp", err)
	}
	for _, f := range []string{"-addr", "-redis", "-rate", "-period", "-burst", "-daily", "-failure-mode", "-fleet-size", "-timeout", "-trusted-proxies", "-legacy-headers", "-exact"} {
		if !strings.Contains(stderr.String(), "  "+f+" ") && !strings.Contains(stderr.String(), "  "+f+"\n") {
			t.Errorf("-h does not list %s:\n%s", f, stderr.String())
		}
	}
	if code := run(context.Background(), []string{"-h"}, io.Discard, io.Discard); code != 0 {
		t.Errorf("-h: exit code %d, want 0", code)
	}
}
