package leaselimit_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// Regression tests of issue 24, one per item, each through the public API.
// Every token that leaves a bucket carries its generation and window, and
// comes back to them only, once (the ledger rule; see the README).

// TestQuotaLeaseAcrossTheBoundary: a busy key of a daily quota across
// midnight, four instances: the new day admits at most its quota. The
// leases' tokens of the old day were counted as the live lease by the next
// refill and revived in the new day (5,086–5,416 of 5,000 admitted).
func TestQuotaLeaseAcrossTheBoundary(t *testing.T) {
	m, _ := newMini(t)
	ctx := context.Background()
	const quota = 5000
	daily := policy.Quota("daily", quota, policy.Day, time.UTC)
	end, _ := daily.Calendar.Window(time.Now()) // the client names windows by its own clock
	clk := newFakeClock()
	lims := make([]*leaselimit.Limiter, 4)
	for i := range lims {
		c := redis.NewClient(&redis.Options{Addr: m.Addr()})
		t.Cleanup(func() { c.Close() })
		lims[i] = mustNew(t, c, daily, leaselimit.WithClock(clk))
	}
	// The old day: a busy key, within its quota, so every instance holds
	// a lease when the day ends.
	m.SetTime(end.Add(-2 * time.Second))
	leased := 0
	for i := 0; i < quota/2; i++ {
		clk.Add(50 * time.Microsecond)
		d, err := lims[i%len(lims)].Allow(ctx, "busy")
		if err != nil || !d.Allowed {
			t.Fatalf("the old day: Allow = %+v, %v", d, err)
		}
		if d.Source == leaselimit.SourceLease {
			leased++
		}
	}
	if leased < quota/4 {
		t.Fatalf("%d of %d decisions from leases before midnight; want most", leased, quota/2)
	}
	// Midnight: both clocks step past it and past the leases' lives.
	m.SetTime(end.Add(time.Second))
	clk.Add(3 * time.Second)
	admitted := 0
	for i := 0; i < 3*quota; i++ {
		clk.Add(50 * time.Microsecond)
		d, err := lims[i%len(lims)].Allow(ctx, "busy")
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed {
			admitted++
		}
	}
	t.Logf("4 instances, the new day: %d admitted of a quota of %d", admitted, quota)
	if admitted > quota {
		t.Errorf("the new day admitted %d; want at most its quota of %d", admitted, quota)
	}
	if admitted < quota*9/10 {
		t.Errorf("the new day admitted %d of %d; want most of it", admitted, quota)
	}
}

// TestSettleSurplusIsUsable: in lease mode, a Settle surplus is not
// stranded in this instance's lease: AllowN(1), Reserve(20), Settle(8) on
// 30 a day, then Reserve(20) is admitted (Peek says 21), where it was
// denied with a RetryAfter of hours (item 2a); and on a calendar quota the
// surplus outlives the lease: it goes back to the bucket when the lease
// expires, in its window (item 2b: 22 right after Settle, 10 three seconds
// later).
func TestSettleSurplusIsUsable(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	for _, l := range []policy.Limit{
		policy.PerDay(30).WithName("surplus-day"),
		policy.Quota("surplus-quota", 30, policy.Day, time.UTC),
	} {
		t.Run(l.Name, func(t *testing.T) {
			lim := mustNew(t, srv.Client(t), l, leaselimit.WithLease(policy.Lease{TTL: 300 * time.Millisecond}))
			if d, err := lim.AllowN(ctx, "k", 1); err != nil || !d.Allowed {
				t.Fatalf("AllowN(1) = %+v, %v", d, err)
			}
			r, err := lim.Reserve(ctx, "k", 20)
			if err != nil || !r.Decision().Allowed {
				t.Fatalf("Reserve(20) = %+v, %v", r, err)
			}
			if err := r.Settle(ctx, 8); err != nil {
				t.Fatal(err)
			}
			p, err := lim.Peek(ctx, "k")
			if err != nil || p.Remaining != 21 || !p.Allowed {
				t.Fatalf("Peek after Settle(8) = %+v, %v; want 21 and allowed", p, err)
			}
			if l.IsQuota() {
				// The lease (and the surplus in it) expires: its tokens go
				// back to the bucket, in their window.
				time.Sleep(400 * time.Millisecond)
				var last leaselimit.Decision
				if _, ok := waitUntil(3*time.Second, func() bool {
					last, err = lim.Peek(ctx, "k")
					return err == nil && last.Remaining == 21
				}); !ok {
					t.Errorf("Peek once the lease expired = %+v, %v; want 21 still", last, err)
				}
			}
			r2, err := lim.Reserve(ctx, "k", 20)
			if err != nil {
				t.Fatal(err)
			}
			if d := r2.Decision(); !d.Allowed {
				t.Errorf("Reserve(20) with 21 left = %+v; want admitted (exact mode admits it)", d)
			}
			if p, err := lim.Peek(ctx, "k"); err != nil || p.Remaining != 1 {
				t.Errorf("Peek after the second Reserve(20) = %+v, %v; want 1", p, err)
			}
		})
	}
}

// TestResetDropsTokensOfTheOldBucket: Reserve(10), Reset, 10 Allows,
// Cancel, then Allows: 20 admitted after the Reset where 10 is right (the
// cancelled reservation's tokens went into the fresh bucket; item 7). The
// same for a reservation settled above its estimate: its charge is not
// made to the fresh bucket.
func TestResetDropsTokensOfTheOldBucket(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	for _, mode := range []string{"exact", "lease"} {
		t.Run(mode, func(t *testing.T) {
			l := policy.Limit{Name: "reset-gen-" + mode, Rate: 1, Period: time.Hour, Burst: 20}
			var opts []leaselimit.Option
			if mode == "exact" {
				opts = append(opts, leaselimit.WithoutLease())
			}
			lim := mustNew(t, srv.Client(t), l, opts...)
			other := mustNew(t, srv.Client(t), l, opts...) // the reservation's instance
			cancelled, err := other.Reserve(ctx, "k", 10)
			if err != nil || !cancelled.Decision().Allowed {
				t.Fatalf("Reserve(10) = %+v, %v", cancelled, err)
			}
			charged, err := other.Reserve(ctx, "k", 5)
			if err != nil || !charged.Decision().Allowed {
				t.Fatalf("Reserve(5) = %+v, %v", charged, err)
			}
			if err := lim.Reset(ctx, "k"); err != nil {
				t.Fatal(err)
			}
			admitted := 0
			for range 10 {
				if d, err := lim.Allow(ctx, "k"); err == nil && d.Allowed {
					admitted++
				}
			}
			if err := cancelled.Cancel(ctx); err != nil {
				t.Fatal(err)
			}
			if err := charged.Settle(ctx, 9); err != nil { // 4 more than taken
				t.Fatal(err)
			}
			if err := other.Close(); err != nil { // returns its lease, if any: old tokens too
				t.Fatal(err)
			}
			for range 30 {
				if d, err := lim.Allow(ctx, "k"); err == nil && d.Allowed {
					admitted++
				}
			}
			// At most the fresh bucket's burst: the old bucket's tokens
			// dropped, its charge not made. (In lease mode a few may sit in
			// lim's last lease, unspent.)
			if admitted > 20 || admitted < 18 {
				t.Errorf("admitted %d after the Reset; want 20, the fresh bucket's burst", admitted)
			}
		})
	}
}

// TestResetThenSurplusOnTheSameInstance: Reserve(10), Reset, an Allow that
// builds a lease from the fresh bucket, then Cancel on the same instance:
// the reservation's 10 tokens must not join that lease (they were spent
// from it: 30 admitted after the Reset on a burst of 20).
func TestResetThenSurplusOnTheSameInstance(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	l := policy.Limit{Name: "reset-same", Rate: 1, Period: time.Hour, Burst: 20}
	lim := mustNew(t, srv.Client(t), l)
	r, err := lim.Reserve(ctx, "k", 10)
	if err != nil || !r.Decision().Allowed {
		t.Fatalf("Reserve(10) = %+v, %v", r, err)
	}
	if err := lim.Reset(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	admitted := 0
	if d, err := lim.Allow(ctx, "k"); err == nil && d.Allowed {
		admitted++
	}
	if err := r.Cancel(ctx); err != nil {
		t.Fatal(err)
	}
	for range 40 {
		if d, err := lim.Allow(ctx, "k"); err == nil && d.Allowed {
			admitted++
		}
	}
	if admitted > 20 {
		t.Errorf("admitted %d after the Reset; want at most the fresh bucket's 20", admitted)
	}
}

// TestResetWithAReservationOnAnotherInstance: a reservation outstanding on
// another instance at a Reset is tokens that instance holds, as its lease
// is: cancelled after the Reset, its surplus joins that instance's lease
// of the old bucket (it cannot know of the Reset) and is spent there. The
// fleet then admits after the Reset the fresh burst plus what the others
// held at it, leases and reservations (docs/semantics.md, Reset), and no
// more: the surplus is not also returned to the fresh bucket. Found by a
// review: the docs counted the leases only, and the fleet admitted the
// fresh 400, B's lease and B's cancelled 60 (13 of 13 runs).
func TestResetWithAReservationOnAnotherInstance(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	l := policy.Limit{Name: "reset-reserved", Rate: 1, Period: time.Hour, Burst: 400}
	const reserved = 60
	lease := leaselimit.WithLease(policy.Lease{DenyCap: 20 * time.Millisecond})
	a, b, c := mustNew(t, srv.Client(t), l, lease), mustNew(t, srv.Client(t), l, lease), mustNew(t, srv.Client(t), l, lease)
	bucket := mustNew(t, srv.Client(t), l, leaselimit.WithoutLease()) // Peek: the bucket alone
	for range 200 {                                                   // B builds a lease
		if d, err := b.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("B's Allow = %+v, %v", d, err)
		}
	}
	r, err := b.Reserve(ctx, "k", reserved)
	if err != nil || !r.Decision().Allowed {
		t.Fatalf("B's Reserve(%d) = %+v, %v", reserved, r, err)
	}
	spendUntilDenied(t, "k", c, a) // the bucket spent
	inB, err := b.Peek(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	inBucket, err := bucket.Peek(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	bLease := inB.Remaining - inBucket.Remaining // what B's lease holds
	if err := a.Reset(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	if err := r.Cancel(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(40 * time.Millisecond) // past DenyCap: every instance asks Redis again
	var after int64
	for range 3 {
		after += spendUntilDenied(t, "k", b, c, a)
	}
	t.Logf("after the Reset: admitted %d; B held %d in its lease and %d reserved", after, bLease, reserved)
	if most := l.Burst + bLease + reserved; after > most {
		t.Errorf("admitted %d after the Reset; want at most the fresh %d, B's lease %d and its reservation %d", after, l.Burst, bLease, reserved)
	}
	if after < l.Burst {
		t.Errorf("admitted %d after the Reset; want the fresh bucket's %d at least", after, l.Burst)
	}
}

// spendUntilDenied has each of lims, in turn, Allow key until denied, and
// returns how many were admitted.
func spendUntilDenied(t *testing.T, key string, lims ...*leaselimit.Limiter) (admitted int64) {
	t.Helper()
	for _, lim := range lims {
		for {
			d, err := lim.Allow(context.Background(), key)
			if err != nil {
				t.Fatal(err)
			}
			if !d.Allowed {
				break
			}
			admitted++
		}
	}
	return admitted
}

// TestPrefetchAfterResetGoesBack: a lease's prefetch that Redis runs
// after another instance's Reset lands on a lease still holding the old
// generation's tokens; at Close the prefetched tokens, taken from the fresh
// bucket, go back to it. On a real redis-server. Regression: the lease
// stamped them with its older tokens' time, and the fresh bucket dropped
// them with the old ones (a lease's worth lost per Reset; the fleet
// accounting test once admitted 48 of a fresh burst of 49).
func TestPrefetchAfterResetGoesBack(t *testing.T) {
	pr := prefetchAfterReset(t)
	if err := pr.leased.Close(); err != nil {
		t.Fatal(err)
	}
	// The fresh bucket lost at most the admissions after the Reset (fewer
	// when they came from the old lease), not the prefetch.
	got := peekRemaining(t, pr.exact, "k")
	t.Logf("%d admitted after the Reset; the prefetch took %d; after Close the fresh bucket holds %d", pr.after, pr.took, got)
	if got < pr.limit.Burst-pr.after || got > pr.limit.Burst {
		t.Errorf("after Close the fresh bucket holds %d; want between %d and %d: the prefetch's %d tokens taken from it went back as old ones", got, pr.limit.Burst-pr.after, pr.limit.Burst, pr.took)
	}
}

// TestExcessOfFreshTokensCharged: a reservation that takes all of a lease
// holding old tokens and a prefetch made after another instance's Reset
// has tokens of the fresh bucket; settled above its estimate, its excess is
// charged to the fresh bucket. On a real redis-server. Regression: the
// excess was stamped with the lease's older tokens' time, and the fresh
// bucket forgave it, admitting that much more than its burst (found by an
// adversarial review).
func TestExcessOfFreshTokensCharged(t *testing.T) {
	pr := prefetchAfterReset(t)
	ctx := context.Background()
	// Take a chunk of the fresh bucket, so that Peek on the lease
	// instance (the bucket and its lease, at most a burst) tells its lease.
	if d, err := pr.exact.AllowN(ctx, "k", 5000); err != nil || !d.Allowed {
		t.Fatalf("AllowN(5000) = %+v, %v", d, err)
	}
	// Read until two readings agree: a prefetch the last admission started
	// may still be landing (then the lease holds more than the reading,
	// or less, and the Reserve below was decided at Redis).
	var bucket, h int64
	var r *leaselimit.Reservation
	for attempt := 0; ; attempt++ {
		for prev := int64(-1); h != prev || prev < 0; {
			prev = h
			bucket = peekRemaining(t, pr.exact, "k")
			h = peekRemaining(t, pr.leased, "k") - bucket
		}
		var err error
		r, err = pr.leased.Reserve(ctx, "k", h)
		if err != nil || !r.Decision().Allowed {
			t.Fatalf("Reserve(%d), the whole lease = %+v, %v", h, r.Decision(), err)
		}
		if r.Decision().Source == leaselimit.SourceLease {
			break
		}
		// A prefetch landed between the readings and the Reserve (seen
		// in CI): decided at Redis instead. Give it back and read again.
		if attempt == 4 {
			t.Fatalf("Reserve(%d), the whole lease, decided at Redis 5 times: %+v", h, r.Decision())
		}
		if err := r.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Settle(ctx, h+5); err != nil {
		t.Fatal(err)
	}
	if err := pr.leased.Close(); err != nil {
		t.Fatal(err)
	}
	if got, want := peekRemaining(t, pr.exact, "k"), bucket-5; got != want {
		t.Errorf("the fresh bucket holds %d; want %d: the excess of 5 of a reservation of its tokens was not charged", got, want)
	}
}

// prefetched is a lease instance whose lease holds the old generation's
// tokens and a prefetch of the fresh bucket (see prefetchAfterReset).
type prefetched struct {
	leased, exact *leaselimit.Limiter
	limit         policy.Limit
	after, took   int64 // admissions after the Reset; the prefetch's tokens
}

// prefetchAfterReset grows a lease of key "k" on a real redis-server,
// resets the key on another instance, and spends the lease until a
// prefetch reaches the fresh bucket while the lease still holds old
// tokens.
func prefetchAfterReset(t *testing.T) prefetched {
	t.Helper()
	srv := redistest.Start(t)
	ctx := context.Background()
	pr := prefetched{limit: policy.Limit{Name: "prefetch-after-reset", Rate: 1, Period: 24 * time.Hour, Burst: 10_000}}
	pr.leased = mustNew(t, srv.Client(t), pr.limit, leaselimit.WithLease(policy.Lease{TTL: time.Hour, IdleTTL: time.Hour}))
	pr.exact = mustNew(t, srv.Client(t), pr.limit, leaselimit.WithoutLease(), leaselimit.WithTimeout(5*time.Second))
	allow := func() leaselimit.Decision {
		t.Helper()
		d, err := pr.leased.Allow(ctx, "k")
		if err != nil || !d.Allowed {
			t.Fatalf("Allow = %+v, %v", d, err)
		}
		return d
	}
	// A lease grown by use, then the bucket at rest: no refill in flight.
	for range 500 {
		allow()
	}
	for level, prev := peekRemaining(t, pr.exact, "k"), int64(-1); level != prev; level, prev = peekRemaining(t, pr.exact, "k"), level {
	}
	if err := pr.exact.Reset(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	for peekRemaining(t, pr.exact, "k") == pr.limit.Burst {
		if pr.after == pr.limit.Burst {
			t.Fatal("no refill reached the fresh bucket")
		}
		if d := allow(); d.Source != leaselimit.SourceLease {
			t.Skipf("admission %d after the Reset came from %v, not the old lease: no prefetch landed on old tokens this run", pr.after+1, d.Source)
		}
		pr.after++
	}
	pr.took = pr.limit.Burst - peekRemaining(t, pr.exact, "k")
	return pr
}

// TestLateRefillAfterResetStaysOld: a lease refill that Redis ran before
// another instance's Reset, whose reply arrives after the lease has been
// refilled from the fresh bucket and handed out to reservations, joins the
// lease as older tokens: the fresh bucket gets back, at Close and at the
// reservations' Cancel, no more than it gave. On a real redis-server,
// behind a proxy that holds the late reply. Regression: the lease's fresh
// part still counted tokens the reservations had taken, and the late
// tokens went back as fresh (296 tokens created in a bucket of 10,000; found
// by an adversarial review).
func TestLateRefillAfterResetStaysOld(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	l := policy.Limit{Name: "late-refill", Rate: 1, Period: 24 * time.Hour, Burst: 10_000}
	px := redistest.NewProxy(t, srv.Addr)
	leased := mustNew(t, redis.NewClient(&redis.Options{Addr: px.Addr}), l, leaselimit.WithTimeout(5*time.Second),
		leaselimit.WithLease(policy.Lease{TTL: time.Minute, IdleTTL: time.Hour, Prefetch: -1}))
	exact := mustNew(t, srv.Client(t), l, leaselimit.WithoutLease(), leaselimit.WithTimeout(5*time.Second))
	const key = "k"
	ok := func(d leaselimit.Decision, err error) {
		t.Helper()
		if err != nil || !d.Allowed {
			t.Fatalf("decision %+v, %v", d, err)
		}
	}
	reserve := func(n int64) *leaselimit.Reservation {
		t.Helper()
		r, err := leased.Reserve(ctx, key, n)
		if err != nil || !r.Decision().Allowed || r.Decision().Source != leaselimit.SourceLease {
			t.Fatalf("Reserve(%d) = %+v, %v; want it from the lease", n, r.Decision(), err)
		}
		return r
	}
	bucket := func() int64 { t.Helper(); return peekRemaining(t, exact, key) }
	for range 300 {
		ok(leased.Allow(ctx, key))
	}
	// The next refill runs on Redis now; its caller gives up on the reply.
	px.HoldReplies(func(chunk []byte) bool {
		return bytes.Contains(chunk, []byte("EVALSHA")) || bytes.Contains(chunk, []byte("evalsha"))
	})
	for i := 0; ; i++ {
		short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		_, err := leased.Allow(short, key)
		cancel()
		if err != nil {
			break
		}
		if i == int(l.Burst) {
			t.Fatal("no refill was held")
		}
	}
	if err := exact.Reset(ctx, key); err != nil {
		t.Fatal(err)
	}
	ok(exact.AllowN(ctx, key, 5000))
	// Two refills from the fresh bucket, each handed out to a reservation
	// but for one token.
	ok(leased.Allow(ctx, key))
	first := 5000 - bucket()
	r1 := reserve(first - 2)
	ok(leased.AllowN(ctx, key, 2))
	second := 5000 - first - bucket()
	r2 := reserve(second - 2)
	// The late reply lands in the lease (Peek counts it).
	px.ReleaseReplies()
	for deadline := time.Now().Add(time.Minute); ; {
		d, err := leased.Peek(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if d.Remaining-bucket() > 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the late reply never reached the lease")
		}
	}
	if err := leased.Close(); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*leaselimit.Reservation{r1, r2} {
		if err := r.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// The fresh bucket gave 5000 to the exact instance and the two
	// refills to the lease; of those, 3 tokens were admitted and the rest
	// came back. Nothing of the late refill may.
	if got, want := bucket(), l.Burst-5000-3; got != want {
		t.Errorf("the fresh bucket holds %d; want %d: %d tokens of a refill run before the Reset given to it", got, want, got-want)
	}
}

// TestSettleWhileConnectionsRefused: exact mode, two reservations of 10,
// then connections are refused for 1.5s (Redis up, its data kept):
// Settle(60) and Settle(0) return nil and are applied once Redis can be
// reached, once each: the bucket ends at 40 where it stayed at 80 (the
// calls were counted as maybe applied although no byte reached Redis;
// item 4).
func TestSettleWhileConnectionsRefused(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.NewProxy(t, srv.Addr)
	c := redis.NewClient(&redis.Options{Addr: proxy.Addr})
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	l := policy.Limit{Name: "refused", Rate: 1, Period: time.Hour, Burst: 100}
	lim := mustNew(t, c, l, leaselimit.WithoutLease(), leaselimit.WithTimeout(100*time.Millisecond))
	a, err := lim.Reserve(ctx, "k", 10)
	if err != nil || !a.Decision().Allowed {
		t.Fatalf("Reserve = %+v, %v", a, err)
	}
	b, err := lim.Reserve(ctx, "k", 10)
	if err != nil || !b.Decision().Allowed {
		t.Fatalf("Reserve = %+v, %v", b, err)
	}
	proxy.Refuse(true)
	if err := a.Settle(ctx, 60); err != nil {
		t.Errorf("Settle(60) while refused = %v; want nil (queued)", err)
	}
	if err := b.Settle(ctx, 0); err != nil {
		t.Errorf("Settle(0) while refused = %v; want nil (queued)", err)
	}
	time.Sleep(1500 * time.Millisecond)
	proxy.Refuse(false)
	direct := mustNew(t, srv.Client(t), l, leaselimit.WithoutLease())
	var last int64
	if _, ok := waitUntil(10*time.Second, func() bool {
		p, err := direct.Peek(ctx, "k")
		last = p.Remaining
		return err == nil && p.Remaining == 40
	}); !ok {
		t.Fatalf("bucket holds %d; want 40 (100 - 60 charged in all - 0): the settlements queued and applied once", last)
	}
	time.Sleep(500 * time.Millisecond) // a resend would land by now
	if p, err := direct.Peek(ctx, "k"); err != nil || p.Remaining != 40 {
		t.Errorf("bucket = %+v, %v later; want 40 still (applied once)", p, err)
	}
}
