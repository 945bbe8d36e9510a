package telemetry_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/leaselimit/leaselimit/telemetry"
)

// KeyDigest turns keys into stable digests for spans (with
// leaselimit.WithKeyRedactor): the same on every instance that shares the
// secret, never the key itself.
func ExampleKeyDigest() {
	redact := telemetry.KeyDigest([]byte("a secret shared by the fleet"))
	a, b := redact("user:42"), redact("user:42")
	fmt.Println(len(a), a == b, a != redact("user:43"))
	// Output:
	// 16 true true
}

func ExampleNewRedisLogger() {
	// A handler without the time, so that the output is stable.
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return a
		},
	}))
	rl := telemetry.NewRedisLogger(logger)
	// In a program, hand it to go-redis once, at start-up (go-redis has one
	// logger per process; leaselimit never sets it):
	//
	//	redis.SetLogger(rl)
	//
	// go-redis then calls its Printf; here, as go-redis does while Redis is
	// down, several times in a row:
	for range 3 {
		rl.Printf(context.Background(), "redis: connection pool: failed to dial after %d attempts: %v", 5,
			"dial tcp 10.0.0.7:6379: connect: connection refused")
	}
	// Output:
	// level=WARN msg="redis: connection pool: failed to dial after 5 attempts: dial tcp 10.0.0.7:6379: connect: connection refused" logger=go-redis
}
