package authority

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// TestAcquireResendIsIdempotent: the same acquire call sent twice (as
// go-redis does when a connection breaks after the write) takes its tokens
// once; a new request id takes again.
func TestAcquireResendIsIdempotent(t *testing.T) {
	m := miniredis.RunT(t)
	m.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer c.Close()
	ctx := context.Background()
	l := policy.Limit{Name: "idem", Rate: 1, Period: time.Hour, Burst: 10}
	r, err := New(c, testPrefix)
	if err != nil {
		t.Fatal(err)
	}
	key := r.Key(l, "k")
	call := func(id string) Grant {
		t.Helper()
		v, err := c.Eval(ctx, acquireSrc, []string{key}, l.Rate, l.PeriodMicros(), l.Burst, 4, 4, 1_000_000, id).Result()
		if err != nil {
			t.Fatal(err)
		}
		g, err := DecodeGrant(v)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	first := call("req-1")
	again := call("req-1")
	if again.At != 0 || first.At == 0 {
		t.Errorf("stamps: first %d, resent %d; want the first stamped and the resent one unknown (0)", first.At, again.At)
	}
	again.At = first.At
	if first != again || first.Granted != 4 || first.Remaining != 6 {
		t.Fatalf("resent call = %+v, first %+v; want the same grant of 4 with 6 left", again, first)
	}
	if g := call("req-2"); g.Granted != 4 || g.Remaining != 2 {
		t.Fatalf("new id = %+v; want 4 granted, 2 left", g)
	}
	// A denial writes nothing, so resending it is harmless too.
	if g := call("req-3"); g.Granted != 0 || g.Remaining != 2 {
		t.Fatalf("over the limit = %+v; want a denial with 2 left", g)
	}
	for _, bad := range []string{"", string(make([]byte, 65))} {
		if _, err := c.Eval(ctx, acquireSrc, []string{key}, l.Rate, l.PeriodMicros(), l.Burst, 1, 1, 1_000_000, bad).Result(); err == nil {
			t.Errorf("request id of %d bytes accepted", len(bad))
		}
	}
	// Through Acquire, every call has its own id.
	if g, err := r.Acquire(ctx, key, l, 1, 1, 1); err != nil || g.Granted != 1 || g.Remaining != 1 {
		t.Fatalf("Acquire = %+v, %v; want 1 granted, 1 left", g, err)
	}
	if g, err := r.Acquire(ctx, key, l, 1, 1, 1); err != nil || g.Granted != 1 || g.Remaining != 0 {
		t.Fatalf("second Acquire = %+v, %v; want 1 granted, 0 left", g, err)
	}
}
