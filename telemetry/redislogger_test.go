package telemetry

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// redisLogRig is a RedisLogger on a fake clock writing JSON lines to a
// buffer.
type redisLogRig struct {
	mu  sync.Mutex
	buf bytes.Buffer
	t   time.Time
	log *RedisLogger
}

func newRedisLogRig() *redisLogRig {
	r := &redisLogRig{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	r.log = NewRedisLogger(slog.New(slog.NewJSONHandler(writerFunc(func(p []byte) (int, error) {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.buf.Write(p)
	}), nil)))
	r.log.now = func() time.Time {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.t
	}
	return r
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

func (r *redisLogRig) add(d time.Duration) {
	r.mu.Lock()
	r.t = r.t.Add(d)
	r.mu.Unlock()
}

// lines returns the lines written since the last call.
func (r *redisLogRig) lines() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := strings.TrimSpace(r.buf.String())
	r.buf.Reset()
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

// TestRedisLoggerThrottles: go-redis's "failed to dial", repeated 100 times
// in a burst, is written once; the next line of its kind, 10 s later, says
// how many were left out. Other kinds have throttles of their own.
func TestRedisLoggerThrottles(t *testing.T) {
	r := newRedisLogRig()
	ctx := context.Background()
	dial := errors.New("dial tcp 127.0.0.1:1: connect: connection refused")
	const format = "redis: connection pool: failed to dial after %d attempts: %v"
	for range 100 {
		r.log.Printf(ctx, format, 5, dial)
		r.add(50 * time.Millisecond) // 100 lines in 5 s
	}
	got := r.lines()
	if len(got) != 1 {
		t.Fatalf("%d lines for 100 repeats within 5 s; want 1:\n%s", len(got), strings.Join(got, "\n"))
	}
	for _, want := range []string{`"level":"WARN"`, `"msg":"redis: connection pool: failed to dial after 5 attempts: dial tcp 127.0.0.1:1: connect: connection refused"`, `"logger":"go-redis"`} {
		if !strings.Contains(got[0], want) {
			t.Errorf("line %s; want %s in it", got[0], want)
		}
	}
	if strings.Contains(got[0], "suppressed") {
		t.Errorf("first line %s says lines were suppressed", got[0])
	}

	// Another kind is not held back by the first.
	r.log.Printf(ctx, "redis: failed to close connection: %v", dial)
	if got := r.lines(); len(got) != 1 {
		t.Errorf("%d lines of a new kind; want 1", len(got))
	}

	r.add(5 * time.Second) // 10 s since the first line
	r.log.Printf(ctx, format, 5, dial)
	got = r.lines()
	if len(got) != 1 || !strings.Contains(got[0], `"suppressed":99`) {
		t.Fatalf("the next line 10 s later: %q; want one line with suppressed 99", got)
	}
	r.log.Printf(ctx, format, 5, dial)
	if got := r.lines(); len(got) != 0 {
		t.Errorf("a repeat right after the line with the count was written: %q", got)
	}
}

// TestRedisLineKind: a line's kind is its format, or for lines go-redis
// formats itself ("%s"), the line without its digits.
func TestRedisLineKind(t *testing.T) {
	for _, c := range []struct {
		format   string
		args     []any
		sameAs   []any // the same format with these arguments is the same kind
		otherArg []any // and with these, another kind (nil: not checked)
	}{
		{"redis: connection pool: failed to dial after %d attempts: %v", []any{5, "refused"}, []any{3, "no route"}, nil},
		{"%s", []any{"conn[12] marked for handoff"}, []any{"conn[345] marked for handoff"}, []any{"circuit breaker opened"}},
		{"%v", []any{"handoff failed for conn[1]"}, []any{"handoff failed for conn[2]"}, []any{"handoff succeeded for conn[1]"}},
		{"%-10s%%", []any{"x1"}, []any{"x2"}, []any{"y1"}},
	} {
		kind := func(args []any) string { return redisLineKind(c.format, fmt.Sprintf(c.format, args...)) }
		if a, b := kind(c.args), kind(c.sameAs); a != b {
			t.Errorf("format %q: kinds %q and %q; want one", c.format, a, b)
		}
		if c.otherArg != nil && kind(c.args) == kind(c.otherArg) {
			t.Errorf("format %q: %v and %v share kind %q", c.format, c.args, c.otherArg, kind(c.args))
		}
	}
	long := strings.Repeat("x", 500)
	if k := redisLineKind("%s", long); len(k) != 64 {
		t.Errorf("kind of a 500-byte line: %d bytes; want 64", len(k))
	}
}

// TestRedisLoggerBoundsKinds: lines of more kinds than it tells apart share
// one throttle, so memory stays bounded whatever go-redis writes.
func TestRedisLoggerBoundsKinds(t *testing.T) {
	r := newRedisLogRig()
	for i := range 2 * maxRedisKinds {
		r.log.Printf(context.Background(), fmt.Sprintf("line of kind %d: %%v", i), "x")
	}
	if n := len(r.lines()); n != maxRedisKinds+1 {
		t.Errorf("%d lines of %d kinds; want %d (the kinds told apart, and one shared)", n, 2*maxRedisKinds, maxRedisKinds+1)
	}
	if n := len(r.log.kinds); n > maxRedisKinds+1 {
		t.Errorf("%d kinds held; want at most %d", n, maxRedisKinds+1)
	}
}

// TestRedisLoggerConcurrent: go-redis logs from many goroutines at once;
// a burst of one kind is still one line.
func TestRedisLoggerConcurrent(t *testing.T) {
	r := newRedisLogRig()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				r.log.Printf(context.Background(), "redis: connection pool: failed to dial after %d attempts: %v", 5, "refused")
			}
		})
	}
	wg.Wait()
	if n := len(r.lines()); n != 1 {
		t.Errorf("%d lines for 800 concurrent repeats; want 1", n)
	}
	r.add(redisLogEvery)
	r.log.Printf(context.Background(), "redis: connection pool: failed to dial after %d attempts: %v", 5, "refused")
	if got := r.lines(); len(got) != 1 || !strings.Contains(got[0], `"suppressed":799`) {
		t.Errorf("next line: %q; want suppressed 799", got)
	}
}

// TestRedisLoggerZeroAndNil: a zero RedisLogger throttles to
// slog.Default(), as NewRedisLogger(nil)'s; a nil one writes every line
// there. Both panicked inside go-redis.
func TestRedisLoggerZeroAndNil(t *testing.T) {
	var buf bytes.Buffer
	old, w, f := slog.Default(), log.Writer(), log.Flags() // SetDefault redirects the log package, which setting old back does not undo
	defer func() { slog.SetDefault(old); log.SetOutput(w); log.SetFlags(f) }()
	slog.SetDefault(slog.New(slog.NewTextHandler(&buf, nil)))
	zero := new(RedisLogger)
	zero.Printf(context.Background(), "redis: dial %s failed", "a")
	zero.Printf(context.Background(), "redis: dial %s failed", "b")
	if n := strings.Count(buf.String(), "dial"); n != 1 {
		t.Errorf("a zero RedisLogger wrote %d lines of one kind at once; want 1:\n%s", n, buf.String())
	}
	buf.Reset()
	var none *RedisLogger
	none.Printf(context.Background(), "redis: dial %s failed", "a")
	var noCtx context.Context // go-redis may pass one
	none.Printf(noCtx, "redis: dial %s failed", "b")
	if n := strings.Count(buf.String(), "dial"); n != 2 {
		t.Errorf("a nil RedisLogger wrote %d lines; want 2:\n%s", n, buf.String())
	}
}
