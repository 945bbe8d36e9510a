package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// TestQuickStart runs the README's quick start on an embedded Redis whose
// clock stands still: three requests allowed, the fourth denied for the
// 20 s a token of 3 a minute takes.
func TestQuickStart(t *testing.T) {
	mr := miniredis.RunT(t)
	mr.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	var out strings.Builder
	if err := run(context.Background(), rdb, &out); err != nil {
		t.Fatal(err)
	}
	want := "request 1: allowed, 2 left\nrequest 2: allowed, 1 left\nrequest 3: allowed, 0 left\nrequest 4: denied, retry in 20s\n"
	if out.String() != want {
		t.Errorf("output:\n%s\nwant:\n%s", out.String(), want)
	}
}
