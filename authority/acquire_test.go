package authority

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// Server times of the step tables, as offsets from t0.
const (
	ms = time.Millisecond
	us = time.Microsecond
)

// step is one Acquire in a step table: at server time t0+at, Acquire(want,
// min, share) must return g.
type step struct {
	at        time.Duration
	want, min int64
	share     float64 // 0 means 1
	g         Grant
}

// stepTable is a sequence of Acquire calls on one fresh key.
type stepTable struct {
	name  string
	limit policy.Limit
	// exactOnly marks tables whose expectations depend on the clock to the
	// microsecond: they run only where the server clock can be set exactly
	// (miniredis).
	exactOnly bool
	steps     []step
}

var (
	tenPerSec   = policy.Limit{Name: "ten", Rate: 10, Period: time.Second, Burst: 5}
	threePerSec = policy.Limit{Name: "three", Rate: 3, Period: time.Second, Burst: 3}
)

func grant(granted, remaining int64, retry, reset time.Duration) Grant {
	return Grant{Granted: granted, Remaining: remaining, RetryAfter: retry, ResetAfter: reset}
}

var stepTables = []stepTable{
	{
		// All-or-nothing takes (want = min): a full bucket to start, denials
		// consume nothing, refill of one token per 100ms, capped at Burst.
		// Every step sits on a whole number of tokens or half a token, so
		// the table tolerates a real server's clock running on during it.
		name:  "exact takes 10/s burst 5",
		limit: tenPerSec,
		steps: []step{
			{at: 0, want: 1, min: 1, g: grant(1, 4, 0, 100*ms)},
			{at: 0, want: 4, min: 4, g: grant(4, 0, 0, 500*ms)},
			{at: 0, want: 1, min: 1, g: grant(0, 0, 100*ms, 500*ms)},
			{at: 50 * ms, want: 1, min: 1, g: grant(0, 0, 50*ms, 450*ms)},
			{at: 100 * ms, want: 1, min: 1, g: grant(1, 0, 0, 500*ms)},
			{at: 300 * ms, want: 3, min: 3, g: grant(0, 2, 100*ms, 300*ms)},
			{at: 300 * ms, want: 2, min: 2, g: grant(2, 0, 0, 500*ms)},
			{at: 1000 * ms, want: 5, min: 5, g: grant(5, 0, 0, 500*ms)}, // 7 tokens of refill, capped at 5
			{at: 1400 * ms, want: 5, min: 5, g: grant(0, 4, 100*ms, 100*ms)},
			{at: 1500 * ms, want: 5, min: 5, g: grant(5, 0, 0, 500*ms)},
		},
	},
	{
		// Partial grants: min(want, max(min, floor(avail*share))).
		name:  "partial grants 10/s burst 20",
		limit: policy.Limit{Name: "partial", Rate: 10, Period: time.Second, Burst: 20},
		steps: []step{
			{at: 0, want: 10, min: 1, share: 0.5, g: grant(10, 10, 0, 1000*ms)}, // floor(20*.5)=10
			{at: 0, want: 10, min: 1, share: 0.5, g: grant(5, 5, 0, 1500*ms)},   // floor(10*.5)=5
			{at: 0, want: 10, min: 1, share: 0.5, g: grant(2, 3, 0, 1700*ms)},   // floor(5*.5)=2
			{at: 0, want: 10, min: 1, share: 0.5, g: grant(1, 2, 0, 1800*ms)},   // floor(3*.5)=1
			{at: 0, want: 10, min: 1, share: 0.5, g: grant(1, 1, 0, 1900*ms)},   // floor(2*.5)=1
			{at: 0, want: 10, min: 1, share: 0.5, g: grant(1, 0, 0, 2000*ms)},   // floor(1*.5)=0 -> min
			{at: 0, want: 10, min: 1, share: 0.5, g: grant(0, 0, 100*ms, 2000*ms)},
			{at: 200 * ms, want: 10, min: 3, share: 0.5, g: grant(0, 2, 100*ms, 1800*ms)}, // retry for min tokens
			{at: 300 * ms, want: 10, min: 3, share: 0.5, g: grant(3, 0, 0, 2000*ms)},      // floor(1.5)=1 -> min 3
			{at: 2300 * ms, want: 4, min: 1, share: 0.5, g: grant(4, 16, 0, 400*ms)},      // floor(10) -> want 4
			{at: 2300 * ms, want: 10, min: 1, share: 1, g: grant(10, 6, 0, 1400*ms)},
			{at: 2300 * ms, want: 10, min: 2, share: 0.000001, g: grant(2, 4, 0, 1600*ms)}, // floor(6e-6)=0 -> min 2
			{at: 2300 * ms, want: 10, min: 5, share: 0.5, g: grant(0, 4, 100*ms, 1600*ms)},
			{at: 2300 * ms, want: 4, min: 4, share: 0.25, g: grant(4, 0, 0, 2000*ms)}, // floor(1) -> min 4
		},
	},
	{
		// Clock going backwards (failover to a server whose clock is behind):
		// nothing is refilled, the later timestamp is kept, so refill resumes
		// from it and not from the earlier time.
		name:  "clock backwards 10/s burst 5",
		limit: tenPerSec,
		steps: []step{
			{at: 1000 * ms, want: 2, min: 2, g: grant(2, 3, 0, 200*ms)},
			{at: 500 * ms, want: 1, min: 1, g: grant(1, 2, 0, 300*ms)},
			{at: 0, want: 3, min: 3, g: grant(0, 2, 100*ms, 300*ms)},
			{at: 1000 * ms, want: 3, min: 3, g: grant(0, 2, 100*ms, 300*ms)},
			{at: 1100 * ms, want: 3, min: 3, g: grant(3, 0, 0, 500*ms)},
			{at: 600 * ms, want: 1, min: 1, g: grant(0, 0, 100*ms, 500*ms)},
			{at: 1200 * ms, want: 1, min: 1, g: grant(1, 0, 0, 500*ms)},
			{at: 1700 * ms, want: 5, min: 5, g: grant(5, 0, 0, 500*ms)},
		},
	},
	{
		// 3 per second: a token every 333333.3µs. The bucket counts in
		// thirds of a µs-token, so nothing is lost to rounding: exactly one
		// token per third of a second, retry/reset rounded up to whole µs.
		name:      "3/s non-integer µs per token",
		limit:     threePerSec,
		exactOnly: true,
		steps: []step{
			{at: 0, want: 3, min: 3, g: grant(3, 0, 0, 1000000*us)},
			{at: 0, want: 1, min: 1, g: grant(0, 0, 333334*us, 1000000*us)},
			{at: 333333 * us, want: 1, min: 1, g: grant(0, 0, 1*us, 666667*us)},
			{at: 333334 * us, want: 1, min: 1, g: grant(1, 0, 0, 1000000*us)},  // s=2 units left
			{at: 666667 * us, want: 1, min: 1, g: grant(1, 0, 0, 1000000*us)},  // s=1
			{at: 1000000 * us, want: 1, min: 1, g: grant(1, 0, 0, 1000000*us)}, // s=0: 3 tokens in 1s exactly
			{at: 1333333 * us, want: 1, min: 1, g: grant(0, 0, 1*us, 666667*us)},
			{at: 2000000 * us, want: 3, min: 3, g: grant(3, 0, 0, 1000000*us)},
			{at: 2000001 * us, want: 1, min: 1, g: grant(0, 0, 333333*us, 999999*us)},
			{at: 5000000 * us, want: 2, min: 1, share: 0.5, g: grant(1, 2, 0, 333334*us)},
		},
	},
	{
		// One token per hour, burst 2: long retry and reset.
		name:  "1/h burst 2",
		limit: policy.Limit{Name: "hourly", Rate: 1, Period: time.Hour, Burst: 2},
		steps: []step{
			{at: 0, want: 2, min: 2, g: grant(2, 0, 0, 2*time.Hour)},
			{at: 30 * time.Minute, want: 1, min: 1, g: grant(0, 0, 30*time.Minute, 90*time.Minute)},
			{at: time.Hour, want: 2, min: 2, g: grant(0, 1, time.Hour, time.Hour)},
			{at: time.Hour, want: 1, min: 1, g: grant(1, 0, 0, 2*time.Hour)},
			{at: 5 * time.Hour, want: 2, min: 1, g: grant(2, 0, 0, 2*time.Hour)},
		},
	},
}

// checkGrant compares an Acquire result with the expected one. On an exact
// backend they must be equal. Otherwise the server's clock ran on by at most
// slack after the emulated time, which adds refill: the counts must still be
// equal (the tables keep a margin), and the durations may be up to slack
// shorter.
func checkGrant(t *testing.T, b *backend, what string, got, want Grant) {
	t.Helper()
	got.At = 0 // the ledger stamp: see ledger_test.go
	if b.exact() {
		if got != want {
			t.Errorf("%s = %+v; want %+v", what, got, want)
		}
		return
	}
	slack := b.slack()
	within := func(g, w time.Duration) bool { return g <= w && g >= w-slack }
	if got.Granted != want.Granted || got.Remaining != want.Remaining ||
		!within(got.RetryAfter, want.RetryAfter) || !within(got.ResetAfter, want.ResetAfter) ||
		(want.RetryAfter == 0) != (got.RetryAfter == 0) {
		t.Errorf("%s = %+v; want %+v (durations up to %v shorter on a real server)", what, got, want, slack)
	}
}

// runSteps runs tt on a fresh key of b and checks every step, the bucket's
// TTL after each write and that a denial leaves the bucket unchanged.
func runSteps(t *testing.T, b *backend, tt stepTable) {
	t.Helper()
	ctx := context.Background()
	r := b.newAuthority(t, testPrefix)
	key := r.Key(tt.limit, "user-"+tt.name)
	for i, st := range tt.steps {
		at := t0.Add(st.at)
		b.setTime(t, at)
		share := st.share
		if share == 0 {
			share = 1
		}
		before := b.value(t, key)
		beforeTTL := b.pttl(t, key)
		got, err := r.Acquire(ctx, key, tt.limit, st.want, st.min, share)
		if err != nil {
			t.Fatalf("step %d: Acquire(want=%d,min=%d) at %v: %v", i, st.want, st.min, st.at, err)
		}
		checkGrant(t, b, fmt.Sprintf("step %d: Acquire(want=%d,min=%d,share=%v) at %v", i, st.want, st.min, share, st.at), got, st.g)
		if b.exact() && got.At != micros(t0.Add(st.at)) {
			t.Errorf("step %d: stamped %d; want the server's clock %d", i, got.At, micros(t0.Add(st.at)))
		}

		after := b.value(t, key)
		ttl := b.pttl(t, key)
		if got.Granted == 0 {
			if !reflect.DeepEqual(before, after) {
				t.Errorf("step %d: denial changed the bucket from %v to %v", i, before, after)
			}
			if b.exact() && ttl != beforeTTL {
				t.Errorf("step %d: denial changed the TTL from %v to %v", i, beforeTTL, ttl)
			}
			continue
		}
		// A write sets the TTL to the time until full, rounded up to a ms,
		// plus 1s.
		wantTTL := (got.ResetAfter+ms-1)/ms*ms + time.Second
		if b.exact() {
			if ttl != wantTTL {
				t.Errorf("step %d: PTTL after a grant = %v; want %v (ResetAfter %v + 1s)", i, ttl, wantTTL, got.ResetAfter)
			}
		} else if ttl <= 0 || ttl > wantTTL || ttl < wantTTL-b.slack()-ms {
			t.Errorf("step %d: PTTL after a grant = %v; want about %v", i, ttl, wantTTL)
		}
	}
}

// suiteAcquireSteps runs every step table on fresh backends.
func suiteAcquireSteps(t *testing.T, nb backendFactory) {
	for _, tt := range stepTables {
		t.Run(tt.name, func(t *testing.T) {
			b := nb(t)
			if tt.exactOnly && !b.exact() {
				t.Skip("needs a settable server clock (miniredis)")
			}
			runSteps(t, b, tt)
		})
	}
}

func TestAcquireSteps(t *testing.T) { forEachBackend(t, suiteAcquireSteps) }

// TestAcquireStepsMatchModel checks the step tables' literal expectations
// against the reference model, so a wrong table cannot hide a wrong script.
func TestAcquireStepsMatchModel(t *testing.T) {
	for _, tt := range stepTables {
		m := newModel(tt.limit)
		for i, st := range tt.steps {
			share := st.share
			if share == 0 {
				share = 1
			}
			got := m.acquire(micros(t0.Add(st.at)), st.want, st.min, ppmOf(share))
			if got.At != micros(t0.Add(st.at)) {
				t.Errorf("%s: step %d: model stamps %d; want the time %d", tt.name, i, got.At, micros(t0.Add(st.at)))
			}
			got.At = 0
			if got != st.g {
				t.Errorf("%s: step %d: model gives %+v; table says %+v", tt.name, i, got, st.g)
			}
		}
	}
}

// suiteAcquireMisc holds behavioural checks that are not step tables.
func suiteAcquireMisc(t *testing.T, nb backendFactory) {
	ctx := context.Background()

	t.Run("fresh key is full and unwritten until a grant", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(tenPerSec, "fresh")
		if ks := b.keys(t); len(ks) != 0 {
			t.Fatalf("keys before any call: %v", ks)
		}
		g, err := r.exact(ctx, key, tenPerSec, tenPerSec.Burst)
		if err != nil {
			t.Fatal(err)
		}
		checkGrant(t, b, "Exact(burst) on a fresh key", g, grant(5, 0, 0, 500*ms))
		if ks := b.keys(t); !reflect.DeepEqual(ks, []string{key}) {
			t.Fatalf("keys after a grant: %v; want [%s]", ks, key)
		}
	})

	t.Run("Exact is Acquire(n, n, 1)", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		k1, k2 := r.Key(tenPerSec, "a"), r.Key(tenPerSec, "b")
		for i, n := range []int64{2, 2, 2, 1} {
			g1, err1 := r.exact(ctx, k1, tenPerSec, n)
			g2, err2 := r.Acquire(ctx, k2, tenPerSec, n, n, 1)
			if err1 != nil || err2 != nil {
				t.Fatalf("call %d: %v, %v", i, err1, err2)
			}
			if g1.Granted != g2.Granted || g1.Remaining != g2.Remaining {
				t.Errorf("call %d: Exact = %+v, Acquire = %+v", i, g1, g2)
			}
		}
	})

	t.Run("burst lowered and raised", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		big := policy.Limit{Name: "b", Rate: 10, Period: time.Second, Burst: 10}
		small := big.WithBurst(3)
		key := r.Key(big, "k")
		g, err := r.exact(ctx, key, big, 4) // 6 left
		if err != nil {
			t.Fatal(err)
		}
		checkGrant(t, b, "Exact(4) burst 10", g, grant(4, 6, 0, 400*ms))
		// Under burst 3 the 6 stored tokens count as 3.
		g, err = r.exact(ctx, key, small, 1)
		if err != nil {
			t.Fatal(err)
		}
		checkGrant(t, b, "Exact(1) burst 3", g, grant(1, 2, 0, 100*ms))
		g, err = r.exact(ctx, key, small, 3)
		if err != nil {
			t.Fatal(err)
		}
		checkGrant(t, b, "Exact(3) burst 3", g, grant(0, 2, 100*ms, 100*ms))
		// Raised again: the 2 tokens stay and the bucket refills towards 10.
		g, err = r.exact(ctx, key, big, 3)
		if err != nil {
			t.Fatal(err)
		}
		checkGrant(t, b, "Exact(3) burst 10", g, grant(0, 2, 100*ms, 800*ms))
		b.setTime(t, t0.Add(800*ms))
		g, err = r.exact(ctx, key, big, 10)
		if err != nil {
			t.Fatal(err)
		}
		checkGrant(t, b, "Exact(10) burst 10 after 800ms", g, grant(10, 0, 0, time.Second))
	})

	t.Run("concurrent takes never exceed the bucket", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		// One token per hour: a real server's clock adds nothing during
		// the test, so exactly Burst tokens can be taken.
		l := policy.Limit{Name: "conc", Rate: 1, Period: time.Hour, Burst: 100}
		key := r.Key(l, "hot")
		var (
			wg    sync.WaitGroup
			mu    sync.Mutex
			total int64
			errs  []error
		)
		for w := 0; w < 16; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				for i := 0; i < 20; i++ {
					g, err := r.Acquire(ctx, key, l, 3, 1, 0.5)
					mu.Lock()
					if err != nil {
						errs = append(errs, err)
					}
					total += g.Granted
					mu.Unlock()
				}
			}(w)
		}
		wg.Wait()
		if len(errs) > 0 {
			t.Fatalf("%d errors, first: %v", len(errs), errs[0])
		}
		if total != l.Burst {
			t.Errorf("16×20 concurrent Acquire(3,1,0.5) granted %d tokens in total; want exactly %d", total, l.Burst)
		}
	})

	t.Run("context cancelled", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		key := r.Key(tenPerSec, "k")
		_, err := r.Acquire(cctx, key, tenPerSec, 1, 1, 1)
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Acquire with a cancelled context: err = %v; want context.Canceled", err)
		}
		if errors.Is(err, ErrScript) {
			t.Errorf("a cancelled context must not be reported as ErrScript: %v", err)
		}
		if _, err := r.refundOne(cctx, key, tenPerSec, 1); !errors.Is(err, context.Canceled) {
			t.Errorf("refundOne with a cancelled context: err = %v; want context.Canceled", err)
		}
		if err := r.Refund(cctx, []Refund{{Key: key, Limit: tenPerSec, Tokens: 1}}); !errors.Is(err, context.Canceled) {
			t.Errorf("Refund with a cancelled context: err = %v; want context.Canceled", err)
		}
		b.noKeys(t)
	})
}

func TestAcquireMisc(t *testing.T) { forEachBackend(t, suiteAcquireMisc) }

// TestAcquireConnectionError checks that an outage is returned as an error
// that is not ErrScript or ErrReply (the breaker must count it).
func TestAcquireConnectionError(t *testing.T) {
	m := miniredis.RunT(t)
	addr := m.Addr()
	m.Close()
	// No retries: the point is the classification of the error.
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = c.Close() })
	r, err := New(c, testPrefix)
	if err != nil {
		t.Fatal(err)
	}
	key := r.Key(tenPerSec, "k")
	_, err = r.Acquire(context.Background(), key, tenPerSec, 1, 1, 1)
	if err == nil {
		t.Fatal("Acquire on a closed server succeeded")
	}
	if errors.Is(err, ErrScript) || errors.Is(err, ErrReply) {
		t.Errorf("outage reported as %v; want a plain connection error", err)
	}
	if err := r.Refund(context.Background(), []Refund{{Key: key, Limit: tenPerSec, Tokens: 1}}); err == nil {
		t.Error("Refund on a closed server succeeded")
	}
}

// TestAcquireShareOutOfRange pins what Acquire does with a share outside
// (0, 1]: at or below 0 it acts as the smallest share (grants min), above 1
// as 1.
func TestAcquireShareOutOfRange(t *testing.T) {
	ctx := context.Background()
	l := policy.Limit{Name: "s", Rate: 10, Period: time.Second, Burst: 100}
	for _, tc := range []struct {
		share float64
		want  int64
	}{
		{0, 2}, {-1, 2}, {1e-9, 2}, {1, 50}, {1.5, 50}, {2, 50}, {1000, 50},
	} {
		b := newMiniBackend(t)
		r := b.newAuthority(t, testPrefix)
		g, err := r.Acquire(ctx, r.Key(l, "k"), l, 50, 2, tc.share)
		if err != nil {
			t.Fatalf("share %v: %v", tc.share, err)
		}
		if g.Granted != tc.want {
			t.Errorf("Acquire(want=50,min=2,share=%v) on a full bucket of 100 granted %d; want %d", tc.share, g.Granted, tc.want)
		}
	}
}
