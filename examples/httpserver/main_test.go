package main

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
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

// TestRun starts the command on the embedded Redis, sends it requests and
// stops it as SIGINT would (by ending ctx).
func TestRun(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := make(lines, 16)
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"-addr", "127.0.0.1:0", "-legacy-headers"}, out, io.Discard) }()

	listening := regexp.MustCompile(`listening on (http://\S+)`)
	var base string
	for base == "" {
		select {
		case l := <-out:
			if m := listening.FindStringSubmatch(l); m != nil {
				base = m[1]
			}
		case code := <-done:
			t.Fatalf("run returned %d before listening", code)
		case <-time.After(10 * time.Second):
			t.Fatal("no listening line")
		}
	}

	client := &http.Client{Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	var codes []int
	for i := 0; i < 11; i++ {
		resp, err := client.Get(base + "/")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		codes = append(codes, resp.StatusCode)
		if i == 0 {
			if !strings.HasPrefix(string(body), "hello, 127.0.0.1") {
				t.Errorf("body %q", body)
			}
			if got := resp.Header.Get("RateLimit-Policy"); got != `"burst";q=10;w=60, "daily";q=1000;w=86400` {
				t.Errorf("RateLimit-Policy %q", got)
			}
			if got := resp.Header.Get("RateLimit"); !regexp.MustCompile(`^"burst";r=9;t=6, "daily";r=999;t=8[67]$`).MatchString(got) {
				t.Errorf("RateLimit %q", got)
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

	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Errorf("exit code %d", code)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("no graceful shutdown")
	}
}

func TestRunBadFlags(t *testing.T) {
	for _, args := range [][]string{{"-nope"}, {"-trusted-proxies", "10.0.0.0/33"}} {
		if code := run(context.Background(), args, io.Discard, io.Discard); code != 2 {
			t.Errorf("%q: exit code %d, want 2", args, code)
		}
	}
}
