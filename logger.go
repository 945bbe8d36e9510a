package leaselimit

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaselimit/leaselimit/breaker"
)

// logEvery is the least time between two lines of one kind: leaselimit logs
// what an operator must know (the breaker moved, the failure policy took
// over, Redis replied with misconfiguration), never a line per decision.
const logEvery = 10 * time.Second

// The kinds of lines, each rate-limited on its own.
const (
	logFallback  = iota // the failure policy decides
	logMisconfig        // Redis replied with an error that is not an outage
	logReadonly         // READONLY: a failover, or a replica by mistake
	logSaturated        // a reply not read within the hard cap
	logBreaker          // the breaker opened (closing is always logged)
	logUncharged        // a failure policy's admission found the debt book full
	logKinds
)

// logger writes operational events to a slog.Logger (see WithLogger): a
// set of limits' (limit=<names>) or the engine's own, for what concerns no
// one limit (prefix=<key prefix>: the breakers, the debt book). A nil
// *logger logs nothing.
type logger struct {
	out   *slog.Logger
	whose slog.Attr              // limit=… or prefix=…
	last  [logKinds]atomic.Int64 // unix ns of the last line of each kind
	state breaker.State          // last breaker state logged; the janitor's alone
}

func newLogger(out *slog.Logger, key, value string) *logger {
	if out == nil {
		return nil
	}
	return &logger{out: out, whose: slog.String(key, value)}
}

// due reports whether a line of kind may be written now, and claims it.
func (g *logger) due(kind int) bool {
	now := time.Now().UnixNano()
	last := g.last[kind].Load()
	return (last == 0 || now-last >= int64(logEvery)) && g.last[kind].CompareAndSwap(last, now)
}

// fallback logs that the failure policy decided, at most once per logEvery.
func (g *logger) fallback(mode, reason string) {
	if g == nil || !g.due(logFallback) {
		return
	}
	g.out.Warn("leaselimit: Redis unavailable, the failure policy decides", g.whose,
		slog.String("mode", mode), slog.String("reason", reason))
}

// misconfig logs a Redis reply that is neither a decision nor an outage.
func (g *logger) misconfig(err error) {
	if g == nil || !g.due(logMisconfig) {
		return
	}
	g.out.Error("leaselimit: Redis replied with an error that is not an outage; fix the deployment (Client.Check says what)", g.whose,
		slog.String("error", err.Error()))
}

// readonly logs a READONLY reply: counted as an outage (a failover demotes
// a master for a moment), but one that lasts means a client pointed at a
// replica.
func (g *logger) readonly(err error) {
	if g == nil || !g.due(logReadonly) {
		return
	}
	g.out.Warn("leaselimit: Redis answered READONLY: a failover in progress, or, if it lasts, the client points at a replica (Client.Check tells)", g.whose,
		slog.String("error", err.Error()))
}

// saturated logs a call abandoned at the hard cap while this process was
// behind.
func (g *logger) saturated() {
	if g == nil || !g.due(logSaturated) {
		return
	}
	g.out.Warn("leaselimit: instance saturated: a Redis reply was not read within the hard cap; Redis may be healthy", g.whose)
}

// uncharged logs that an admission of the failure policy could not be
// recorded for charging: the debt book holds max buckets already.
func (g *logger) uncharged(max int) {
	if g == nil || !g.due(logUncharged) {
		return
	}
	g.out.Warn("leaselimit: the failure policy admitted a request that will not be charged to its bucket: the debt book is full (WithMaxKeys); counted on ratelimit.settle.charges.dropped", g.whose,
		slog.Int("max_keys", max))
}

// breakerState logs a change of the breaker's state (the most severe of a
// Cluster's). Called by the janitor only.
func (g *logger) breakerState(s breaker.State) {
	if g == nil || s == g.state {
		return
	}
	if s != breaker.Closed && !g.due(logBreaker) {
		return // flapping: the next line comes once logEvery has passed
	}
	g.state = s
	if s == breaker.Closed {
		g.out.Info("leaselimit: circuit breaker closed: decisions come from Redis again", g.whose)
		return
	}
	g.out.Warn("leaselimit: circuit breaker "+s.String()+": Redis calls are held back", g.whose)
}

// RedisLogger writes go-redis's own log lines (such as "failed to dial",
// which go-redis repeats several times a second while Redis is down) to a
// slog.Logger, throttled the way leaselimit's own lines are: at most one
// line of each kind every 10 seconds, the next one saying how many were
// left out (attribute suppressed). Its lines are warnings, with the
// attribute logger=go-redis. It is safe for concurrent use.
//
// go-redis has one logger per process, which leaselimit never sets. To
// route go-redis's lines through the logger given to WithLogger, set it
// once, at start-up:
//
//	redis.SetLogger(leaselimit.NewRedisLogger(logger))
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
	kind := redisLineKind(format, msg)
	now := r.now()
	r.mu.Lock()
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
	if !k.last.IsZero() && now.Sub(k.last) < logEvery {
		k.suppressed++
		r.mu.Unlock()
		return
	}
	suppressed := k.suppressed
	k.last, k.suppressed = now, 0
	r.mu.Unlock()
	if ctx == nil {
		ctx = context.Background()
	}
	if suppressed > 0 {
		r.out.Log(ctx, slog.LevelWarn, msg, slog.String("logger", "go-redis"), slog.Int64("suppressed", suppressed))
		return
	}
	r.out.Log(ctx, slog.LevelWarn, msg, slog.String("logger", "go-redis"))
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
