package telemetry

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// redisLogEvery is the least time between two go-redis lines of one kind,
// as between two of leaselimit's own lines of one kind.
const redisLogEvery = 10 * time.Second

// RedisLogger writes go-redis's own log lines (such as "failed to dial",
// which go-redis repeats several times a second while Redis is down) to a
// slog.Logger, throttled the way leaselimit's own lines are
// (leaselimit.WithLogger): at most one line of each kind every 10 seconds,
// the next one saying how many were left out (attribute suppressed). Its
// lines are warnings, with the attribute logger=go-redis. It is safe for
// concurrent use.
//
// go-redis has one logger per process, which leaselimit never sets. To
// route go-redis's lines through the logger given to leaselimit.WithLogger,
// set it once, at start-up:
//
//	redis.SetLogger(telemetry.NewRedisLogger(logger))
//
// A zero RedisLogger is NewRedisLogger(nil)'s; a nil one writes every
// line to slog.Default(), unthrottled (it has nowhere to count), rather
// than panic inside go-redis.
type RedisLogger struct {
	out *slog.Logger
	now func() time.Time // time.Now; tests set it

	mu    sync.Mutex
	kinds map[string]*redisKind
}

// redisKind is the throttle of one kind of go-redis line.
type redisKind struct {
	last       time.Time // when a line of this kind was last written
	suppressed int64     // lines left out since
}

// maxRedisKinds bounds the kinds a RedisLogger tells apart; lines of
// further kinds share one throttle.
const maxRedisKinds = 256

// NewRedisLogger returns a RedisLogger writing to out (slog.Default() if
// nil), for redis.SetLogger.
func NewRedisLogger(out *slog.Logger) *RedisLogger {
	if out == nil {
		out = slog.Default()
	}
	return &RedisLogger{out: out, now: time.Now, kinds: make(map[string]*redisKind)}
}

// Printf writes one go-redis line, unless a line of its kind was written
// in the last 10 seconds. It implements go-redis's logging interface.
func (r *RedisLogger) Printf(ctx context.Context, format string, v ...any) {
	msg := strings.TrimSuffix(fmt.Sprintf(format, v...), "\n")
	if ctx == nil {
		ctx = context.Background()
	}
	if r == nil {
		slog.Default().Log(ctx, slog.LevelWarn, msg, slog.String("logger", "go-redis"))
		return
	}
	kind := redisLineKind(format, msg)
	r.mu.Lock()
	if r.kinds == nil { // a zero RedisLogger
		r.out, r.now, r.kinds = slog.Default(), time.Now, make(map[string]*redisKind)
	}
	now := r.now()
	k := r.kinds[kind]
	if k == nil {
		if len(r.kinds) >= maxRedisKinds {
			kind = ""
			k = r.kinds[kind]
		}
		if k == nil {
			k = &redisKind{}
			r.kinds[kind] = k
		}
	}
	if !k.last.IsZero() && now.Sub(k.last) < redisLogEvery {
		k.suppressed++
		r.mu.Unlock()
		return
	}
	suppressed := k.suppressed
	k.last, k.suppressed = now, 0
	out := r.out
	r.mu.Unlock()
	if suppressed > 0 {
		out.Log(ctx, slog.LevelWarn, msg, slog.String("logger", "go-redis"), slog.Int64("suppressed", suppressed))
		return
	}
	out.Log(ctx, slog.LevelWarn, msg, slog.String("logger", "go-redis"))
}

// redisLineKind is the kind of a go-redis line: its format (one per place
// in go-redis that logs), or for a format with no words of its own ("%s":
// go-redis formats some lines itself) the line without its digits (so that
// connection ids and counts do not make kinds), at most 64 bytes of it.
func redisLineKind(format, msg string) string {
	if hasWords(format) {
		return format
	}
	b := make([]byte, 0, min(len(msg), 64))
	for i := 0; i < len(msg) && len(b) < 64; i++ {
		if c := msg[i]; c < '0' || c > '9' {
			b = append(b, c)
		}
	}
	return string(b)
}

// hasWords reports whether format has letters outside its verbs.
func hasWords(format string) bool {
	letter := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	for i := 0; i < len(format); i++ {
		switch c := format[i]; {
		case c == '%':
			// Skip flags, width, precision and argument index to the verb.
			for i++; i < len(format) && !letter(format[i]) && format[i] != '%'; i++ {
			}
		case letter(c):
			return true
		}
	}
	return false
}
