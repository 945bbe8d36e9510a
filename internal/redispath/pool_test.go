package redispath

import (
	"context"
	"fmt"
	"log"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
)

// lines is a go-redis logger that keeps what it is given.
type lines struct {
	mu  sync.Mutex
	got []string
}

func (l *lines) Printf(_ context.Context, format string, v ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, fmt.Sprintf(format, v...))
}

// stderrLogger is go-redis's own default, to put back.
type stderrLogger struct{ *log.Logger }

func (l stderrLogger) Printf(_ context.Context, format string, v ...any) {
	l.Logger.Printf(format, v...)
}

// TestHeldPoolSideClientIsQuiet: heldPool's own connection is made from
// the fields that reach the server, not a copy of the user's options,
// which share what the user's client set up: go-redis then logged that it
// could not register its maintenance-notification handlers, for every
// Client of a default go-redis client (and would panic where the user
// required them). It still reaches the server: it answers a PING.
func TestHeldPoolSideClientIsQuiet(t *testing.T) {
	got := &lines{}
	redis.SetLogger(got)
	t.Cleanup(func() { redis.SetLogger(stderrLogger{log.New(os.Stderr, "redis: ", log.LstdFlags|log.Lshortfile)}) })
	_, c := newMini(t, nil) // go-redis's defaults: RESP3
	h := newHeldPool(c, 10)
	defer h.close()
	if err := h.side.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("the side connection's PING: %v", err)
	}
	got.mu.Lock()
	defer got.mu.Unlock()
	for _, l := range got.got {
		if strings.Contains(l, "maintnotifications") || strings.Contains(l, "handler") {
			t.Errorf("go-redis logged, making the side connection: %s", l)
		}
	}
}
