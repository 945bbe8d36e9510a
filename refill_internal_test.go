package leaselimit

import (
	"context"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// TestPrefetchSlots: background refills are bounded by half the client's
// pool. With Redis hung, prefetches of ten keys start at most two calls; the
// rest are skipped at once instead of piling up on the pool (where they
// would hold up the callers that wait for a refill).
func TestPrefetchSlots(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 4})
	t.Cleanup(func() { c.Close() })
	l, err := New(c, policy.PerSecond(1000), WithTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if got := cap(l.slots); got != 2 {
		t.Fatalf("prefetch slots for a pool of 4 = %d; want 2", got)
	}
	// Warm the script and a connection, so the hung calls below hang in a
	// read, not in a dial.
	if _, err := l.Allow(context.Background(), "warm"); err != nil {
		t.Fatal(err)
	}

	srv.Pause(t)
	base := runtime.NumGoroutine()
	for i := 0; i < 10; i++ {
		key := "k" + strconv.Itoa(i)
		l.leases.Decide(key, 1, l.clock.now()) // a first sight: exact, and no entry yet
		l.prefetch(context.Background(), l.leases.Decide(key, 1, l.clock.now()).Ticket)
	}
	if got := len(l.slots); got != 2 {
		t.Errorf("slots in use after 10 prefetches on a hung Redis = %d; want 2", got)
	}
	time.Sleep(100 * time.Millisecond) // let the two calls reach Redis
	// Each running prefetch is its own goroutine plus the call's.
	if extra := runtime.NumGoroutine() - base; extra > 2*2+2 {
		t.Errorf("%d more goroutines after 10 prefetches with 2 slots; want at most %d", extra, 2*2+2)
	}
	srv.Resume(t)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if got := len(l.slots); got != 0 {
		t.Errorf("slots in use after Close = %d; want 0", got)
	}
}
