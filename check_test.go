package leaselimit_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// checkLimiter returns a Limiter on c with a 500ms budget (Check bounds
// each node by it).
func checkLimiter(t *testing.T, c redis.UniversalClient) *leaselimit.Limiter {
	t.Helper()
	lim, err := leaselimit.New(c, policy.PerSecond(10).WithName("check"), leaselimit.WithTimeout(500*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lim.Close() })
	return lim
}

// wantCheckError fails t unless err wraps authority.ErrCheck and says all
// of what.
func wantCheckError(t *testing.T, err error, what ...string) {
	t.Helper()
	if !errors.Is(err, authority.ErrCheck) {
		t.Fatalf("Check = %v; want an error wrapping authority.ErrCheck", err)
	}
	for _, w := range what {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("Check = %q; want it to say %q", err, w)
		}
	}
	t.Logf("Check: %v", err)
}

// TestCheck: Check passes on a healthy Redis and leaves nothing behind, and
// names each misconfiguration that used to fail open without a word: a
// replica (FailOpen admitted 100 of 100 on a burst-10 key), a wrong
// address, an eviction policy that drops buckets (allkeys-lru: 20,000
// admitted where about 200 were due), an ACL without a needed command, a
// hung Redis.
func TestCheck(t *testing.T) {
	mostlyWaits(t)
	ctx := context.Background()

	t.Run("healthy", func(t *testing.T) {
		srv := redistest.Start(t)
		lim := checkLimiter(t, srv.Client(t))
		before := srv.Stats(t)
		if err := lim.Check(ctx); err != nil {
			t.Fatalf("Check on a healthy Redis = %v", err)
		}
		if n := scriptCalls(srv.Stats(t).Sub(before)); n < 2 {
			t.Errorf("Check ran %d script calls; want the acquire and the refund", n)
		}
		if keys := toStrings(srv.Do(t, "KEYS", "*")); len(keys) > 0 {
			t.Errorf("Check left keys %v", keys)
		}
		// A second Check, with the scripts cached, passes too.
		if err := lim.Check(ctx); err != nil {
			t.Fatalf("second Check = %v", err)
		}
	})

	t.Run("replica", func(t *testing.T) {
		master := redistest.Start(t)
		replica := redistest.Start(t)
		host, port, _ := strings.Cut(master.Addr, ":")
		replica.Do(t, "REPLICAOF", host, port)
		wantCheckError(t, checkLimiter(t, replica.Client(t)).Check(ctx), "READONLY", "replica")
	})

	t.Run("wrong-address", func(t *testing.T) {
		addr := fmt.Sprintf("127.0.0.1:%d", redistest.FreePort(t))
		c := redis.NewClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { _ = c.Close() })
		// It names the address it tried (a node's, on a single node),
		// and why: the call ran out of time while go-redis retried its
		// dials, and it said only "context deadline exceeded".
		wantCheckError(t, checkLimiter(t, c).Check(ctx), "cannot connect to Redis", "address", addr)
	})

	t.Run("cold-first-call", func(t *testing.T) {
		// The first script call's reply is held past the budget (Redis
		// ran it: the scripts are loaded first, by a Check of another
		// client, so the held reply is the call's, not NOSCRIPT), as a
		// cold client's dial and script load can take: Check tries once
		// more, on a new connection, and passes; the second try is denied
		// the check bucket's one token, and the refund fills it again.
		srv := redistest.Start(t)
		if err := checkLimiter(t, srv.Client(t)).Check(ctx); err != nil {
			t.Fatal(err)
		}
		px := redistest.NewProxy(t, srv.Addr)
		c := redis.NewClient(&redis.Options{Addr: px.Addr, ContextTimeoutEnabled: true})
		t.Cleanup(func() { _ = c.Close() })
		px.HoldReplies(func(chunk []byte) bool { return bytes.Contains(bytes.ToLower(chunk), []byte("evalsha")) })
		defer px.ReleaseReplies()
		if err := checkLimiter(t, c).Check(ctx); err != nil {
			t.Fatalf("Check with the first call's reply held = %v", err)
		}
		if keys := toStrings(srv.Do(t, "KEYS", "*:_check:*")); len(keys) > 0 {
			t.Errorf("Check left keys %v", keys)
		}
	})

	t.Run("eviction", func(t *testing.T) {
		srv := redistest.Start(t)
		srv.Do(t, "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
		wantCheckError(t, checkLimiter(t, srv.Client(t)).Check(ctx), "maxmemory-policy is allkeys-lru", "noeviction")
		srv.Do(t, "CONFIG", "SET", "maxmemory-policy", "volatile-ttl")
		if err := checkLimiter(t, srv.Client(t)).Check(ctx); err != nil {
			t.Errorf("Check with volatile-ttl = %v", err)
		}
	})

	t.Run("acl", func(t *testing.T) {
		srv := redistest.Start(t)
		c := aclClientWithout(t, srv, "+set")
		wantCheckError(t, checkLimiter(t, c).Check(ctx), "refused", "SET", "ACL")
	})

	t.Run("credentials", func(t *testing.T) {
		// Regression: with a wrong password Check said "unexpected
		// script reply: batch reply <nil>" (the pipeline failed before
		// it was sent and its commands looked like empty replies).
		srv := redistest.Start(t)
		srv.Do(t, "CONFIG", "SET", "requirepass", "right")
		for _, pass := range []string{"", "wrong"} {
			c := redis.NewClient(&redis.Options{Addr: srv.Addr, Password: pass})
			t.Cleanup(func() { _ = c.Close() })
			wantCheckError(t, checkLimiter(t, c).Check(ctx), "credentials", "Password")
		}
	})

	t.Run("busy", func(t *testing.T) {
		// Regression (a new user's trial): Check said "cannot reach Redis
		// (BUSY ...): check the address and that Redis is running".
		srv := redistest.Start(t)
		srv.Do(t, "CONFIG", "SET", "busy-reply-threshold", "10")
		c, probe := srv.Client(t), srv.Client(t)
		looping := make(chan error, 1)
		go func() { looping <- c.Eval(ctx, "while true do end", nil).Err() }()
		for deadline := time.Now().Add(10 * time.Second); ; { // until Redis answers BUSY
			if err := probe.Ping(ctx).Err(); err != nil && strings.HasPrefix(err.Error(), "BUSY ") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("Redis never answered BUSY")
			}
		}
		err := checkLimiter(t, srv.Client(t)).Check(ctx)
		if err := probe.ScriptKill(ctx).Err(); err != nil {
			t.Fatalf("SCRIPT KILL = %v", err)
		}
		<-looping
		wantCheckError(t, err, "busy running a script or function", "FUNCTION KILL")
	})

	t.Run("hung", func(t *testing.T) {
		srv := redistest.Start(t)
		lim := checkLimiter(t, srv.Client(t))
		if err := lim.Check(ctx); err != nil {
			t.Fatal(err)
		}
		srv.Pause(t)
		defer srv.Resume(t)
		wantCheckError(t, lim.Check(ctx), "no reply within")
	})
}

// TestCheckCluster: on a Cluster, Check runs on every master.
func TestCheckCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	lim := checkLimiter(t, c.Client(t))
	masters := c.Masters(t)
	before := make([]redistest.Stats, len(masters))
	for i, m := range masters {
		before[i] = m.Stats(t)
	}
	if err := lim.Check(context.Background()); err != nil {
		t.Fatalf("Check on a healthy cluster = %v", err)
	}
	for i, m := range masters {
		if n := scriptCalls(m.Stats(t).Sub(before[i])); n < 2 {
			t.Errorf("master %s ran %d script calls; want the check's acquire and refund", m.Addr, n)
		}
	}
}
