package authority

import (
	"context"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// mustExact calls r.Exact and fails the test on error.
func mustExact(t *testing.T, r *Redis, key string, l policy.Limit, n int64) Grant {
	t.Helper()
	g, err := r.exact(context.Background(), key, l, n)
	if err != nil {
		t.Fatalf("Exact(%d): %v", n, err)
	}
	if g.At <= 0 {
		t.Fatalf("Exact(%d) = %+v: no ledger stamp", n, g)
	}
	g.At = 0 // the stamps are checked in ledger_test.go
	return g
}

// checkTokens checks that key's bucket holds exactly tokens whole tokens
// (stored state, without refill since the last write), or is missing when
// tokens < 0.
func checkTokens(t *testing.T, b *backend, key string, l policy.Limit, tokens int64) {
	t.Helper()
	s, _, ok := b.state(t, key, l)
	switch {
	case tokens < 0 && ok:
		t.Errorf("bucket %s exists (s=%d); want it deleted", key, s)
	case tokens >= 0 && !ok:
		t.Errorf("bucket %s is missing; want %d tokens", key, tokens)
	case ok && s/l.PeriodMicros() != tokens:
		t.Errorf("bucket %s holds %d tokens (s=%d); want %d", key, s/l.PeriodMicros(), s, tokens)
	}
}

// checkTTL checks the TTL of a bucket written with reset-after reset: exact
// on miniredis, within the slack on a real server.
func checkTTL(t *testing.T, b *backend, key string, reset time.Duration) {
	t.Helper()
	want := (reset+ms-1)/ms*ms + time.Second
	got := b.pttl(t, key)
	if b.exact() {
		if got != want {
			t.Errorf("PTTL %s = %v; want %v (reset %v rounded up to a ms, + 1s)", key, got, want, reset)
		}
		return
	}
	if got <= 0 || got > want || got < want-b.slack()-ms {
		t.Errorf("PTTL %s = %v; want about %v", key, got, want)
	}
}

func suiteRefund(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	l := tenPerSec // 10/s, burst 5

	t.Run("adds tokens back", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(l, "k")
		mustExact(t, r, key, l, 3) // 2 left
		rem, err := r.refundOne(ctx, key, l, 2)
		if err != nil || rem != 4 {
			t.Fatalf("refundOne(2) = %d, %v; want 4, nil", rem, err)
		}
		checkTokens(t, b, key, l, 4)
		checkTTL(t, b, key, 100*ms)
		checkGrant(t, b, "Exact(4) after the refund", mustExact(t, r, key, l, 4), grant(4, 0, 0, 500*ms))
	})

	t.Run("refills to now first", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(l, "k")
		mustExact(t, r, key, l, 5)
		b.setTime(t, t0.Add(200*ms)) // 2 tokens refilled
		rem, err := r.refundOne(ctx, key, l, 1)
		if err != nil || rem != 3 {
			t.Fatalf("refundOne(1) after 200ms = %d, %v; want 3, nil", rem, err)
		}
		checkTokens(t, b, key, l, 3)
		checkTTL(t, b, key, 200*ms)
		if b.exact() {
			if _, ts, _ := b.state(t, key, l); ts != micros(t0.Add(200*ms)) {
				t.Errorf("stored t = %d; want %d (the refund's time)", ts, micros(t0.Add(200*ms)))
			}
		}
	})

	t.Run("filling the bucket deletes the key", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		k1, k2 := r.Key(l, "exactly-full"), r.Key(l, "over-full")
		mustExact(t, r, k1, l, 2)
		mustExact(t, r, k2, l, 2)
		if rem, err := r.refundOne(ctx, k1, l, 2); err != nil || rem != l.Burst {
			t.Errorf("refundOne(2) to a bucket missing 2 = %d, %v; want %d, nil", rem, err, l.Burst)
		}
		if rem, err := r.refundOne(ctx, k2, l, 5); err != nil || rem != l.Burst {
			t.Errorf("refundOne(5) to a bucket missing 2 = %d, %v; want %d (capped), nil", rem, err, l.Burst)
		}
		if ks := b.keys(t); len(ks) != 0 {
			t.Errorf("keys left: %v; full buckets must be deleted", ks)
		}
		// A deleted bucket reads as full.
		checkGrant(t, b, "Exact(5) after refilling by refund", mustExact(t, r, k2, l, 5), grant(5, 0, 0, 500*ms))
	})

	t.Run("missing key is a no-op", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(l, "never-used")
		rem, err := r.refundOne(ctx, key, l, 3)
		if err != nil || rem != l.Burst {
			t.Fatalf("refundOne to a missing key = %d, %v; want %d, nil", rem, err, l.Burst)
		}
		if err := r.Refund(ctx, []Refund{{Key: key, Limit: l, Tokens: 3}}); err != nil {
			t.Fatalf("Refund to a missing key: %v", err)
		}
		b.noKeys(t)
	})

	t.Run("clock backwards keeps the later time", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(l, "k")
		b.setTime(t, t0.Add(time.Second))
		mustExact(t, r, key, l, 5)
		b.setTime(t, t0)
		if rem, err := r.refundOne(ctx, key, l, 1); err != nil || rem != 1 {
			t.Fatalf("refundOne(1) with the clock 1s back = %d, %v; want 1, nil", rem, err)
		}
		if b.exact() {
			if _, ts, _ := b.state(t, key, l); ts != micros(t0.Add(time.Second)) {
				t.Errorf("stored t = %d; want %d (kept, not moved back)", ts, micros(t0.Add(time.Second)))
			}
		}
		b.setTime(t, t0.Add(1100*ms)) // 1 refilled since the later time: 2 tokens
		checkGrant(t, b, "Exact(3) at 1.1s", mustExact(t, r, key, l, 3), grant(0, 2, 100*ms, 300*ms))
		checkGrant(t, b, "Exact(2) at 1.1s", mustExact(t, r, key, l, 2), grant(2, 0, 0, 500*ms))
	})

	t.Run("invalid n touches nothing", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(l, "k")
		b.rec.reset()
		for _, n := range []int64{0, -1, l.Burst + 1, 1 << 62} {
			if _, err := r.refundOne(ctx, key, l, n); !errors.Is(err, ErrScript) {
				t.Errorf("refundOne(n=%d) err = %v; want ErrScript", n, err)
			}
		}
		b.untouched(t)
	})

	t.Run("batch", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		hourly := policy.Limit{Name: "hourly", Rate: 1, Period: time.Hour, Burst: 4}
		kA, kB, kC := r.Key(l, "a"), r.Key(hourly, "b"), r.Key(l, "c")
		kD, kE, kF := r.Key(l, "d-missing"), r.Key(l, "e"), r.Key(l, "f")
		kG := r.Key(l, "g-full")
		mustExact(t, r, kA, l, 5)      // 0 left
		mustExact(t, r, kB, hourly, 3) // 1 left
		mustExact(t, r, kC, l, 1)      // 4 left
		mustExact(t, r, kE, l, 5)      // 0 left
		mustExact(t, r, kF, l, 5)      // 0 left
		// Make sure both refund scripts are cached, so that the calls
		// go by EVALSHA: refund.lua's (an adjustment with an id), and
		// refund_batch.lua's (refunds without, to a missing bucket).
		if _, err := r.refundOne(ctx, kD, l, 1); err != nil {
			t.Fatal(err)
		}
		if err := r.Refund(ctx, []Refund{{Key: kD, Limit: l, Tokens: 1}}); err != nil {
			t.Fatal(err)
		}
		b.rec.reset()
		err := r.Refund(ctx, []Refund{
			{Key: kA, Limit: l, Tokens: 2},
			{Key: kB, Limit: hourly, Tokens: 2},
			{Key: kC, Limit: l, Tokens: 10}, // capped at burst: fills, deletes
			{Key: kD, Limit: l, Tokens: 1},  // missing: no-op
			{Key: kE, Limit: l, Tokens: 0},  // skipped
			{Key: kF, Limit: l, Tokens: 2},  // a refund and a charge are
			{Key: kF, Limit: l, Tokens: -2}, // applied in turn, never netted
			{Key: kG, Limit: l, Tokens: 5},  // a full bucket: the refund is capped,
			{Key: kG, Limit: l, Tokens: -5}, // the charge still counts
		})
		if err != nil {
			t.Fatalf("Refund: %v", err)
		}
		// The refunds first, in calls of refund_batch.lua, one per limit,
		// in one pipeline; then the charges, with their ids, in one call
		// of refund.lua. A refund before a charge of one bucket can only
		// leave it lower than the other order: capped at the burst, then
		// charged.
		if got, want := b.rec.take(), []string{"[evalsha evalsha]", "evalsha"}; !reflect.DeepEqual(got, want) {
			t.Errorf("Refund sent %v; want %v (two refund calls, one per limit, then one call for the two charges, skipped entries left out)", got, want)
		}
		checkTokens(t, b, kA, l, 2)
		checkTokens(t, b, kB, hourly, 3)
		checkTokens(t, b, kC, l, -1)
		checkTokens(t, b, kD, l, -1)
		checkTokens(t, b, kE, l, 0)
		checkTokens(t, b, kF, l, 0)
		checkTokens(t, b, kG, l, 0)
		checkTTL(t, b, kA, 300*ms)
		checkTTL(t, b, kB, time.Hour)
	})

	t.Run("batch of several script calls", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		const n = 2*maxPerScript + 22
		rfs := make([]Refund, n)
		for i := range rfs {
			k := r.Key(l, "many-"+strconv.Itoa(i))
			mustExact(t, r, k, l, 5) // 0 left
			rfs[i] = Refund{Key: k, Limit: l, Tokens: int64(1 + i%4)}
		}
		b.flushScripts(t)
		b.rec.reset()
		if err := r.Refund(ctx, rfs); err != nil {
			t.Fatalf("Refund: %v", err)
		}
		// Three calls of up to maxPerScript adjustments, in one pipeline;
		// answered NOSCRIPT, the first goes again by EVAL, the others by
		// EVALSHA after it.
		if got, want := b.rec.take(), []string{"[evalsha evalsha evalsha]", "[eval evalsha evalsha]"}; !reflect.DeepEqual(got, want) {
			t.Errorf("Refund of %d adjustments sent %v; want %v", n, got, want)
		}
		for _, rf := range rfs {
			checkTokens(t, b, rf.Key, l, rf.Tokens)
		}
	})

	t.Run("batch with nothing to do", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		b.rec.reset()
		if err := r.Refund(ctx, nil); err != nil {
			t.Errorf("Refund(nil) = %v", err)
		}
		if err := r.Refund(ctx, []Refund{{Key: r.Key(l, "x"), Limit: l, Tokens: 0}}); err != nil {
			t.Errorf("Refund of 0 tokens = %v", err)
		}
		if cmds := b.rec.take(); len(cmds) != 0 {
			t.Errorf("Refund with nothing to refund sent %v", cmds)
		}
	})

	t.Run("batch with an invalid entry", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		kA, kBad, kC := r.Key(l, "a"), r.Key(l, "bad"), r.Key(l, "c")
		mustExact(t, r, kA, l, 5)
		mustExact(t, r, kBad, l, 5)
		mustExact(t, r, kC, l, 5)
		bad := l
		bad.Rate = 0
		err := r.Refund(ctx, []Refund{
			{Key: kA, Limit: l, Tokens: 1},
			{Key: kBad, Limit: bad, Tokens: 1},
			{Key: kC, Limit: l, Tokens: 2},
		})
		if !errors.Is(err, ErrScript) {
			t.Fatalf("Refund with a rate-0 entry: err = %v; want ErrScript", err)
		}
		checkTokens(t, b, kA, l, 1)
		checkTokens(t, b, kBad, l, 0)
		checkTokens(t, b, kC, l, 2)

		// A key another program holds fails its adjustment alone, in
		// Redis, within the script call it shares with the others.
		foreign := r.Key(l, "foreign")
		if err := b.client.LPush(ctx, foreign, "x").Err(); err != nil {
			t.Fatal(err)
		}
		failed := r.RefundAll(ctx, []Refund{
			{Key: kA, Limit: l, Tokens: 1},
			{Key: foreign, Limit: l, Tokens: 1},
			{Key: kC, Limit: l, Tokens: 1},
		})
		if len(failed) != 1 || failed[0].Key != foreign || !errors.Is(failed[0].Err, ErrRejected) || failed[0].Once() != "" {
			t.Fatalf("RefundAll with a foreign key failed %+v; want the foreign key's alone, ErrRejected and no id (not applied, and would fail again)", failed)
		}
		checkTokens(t, b, kA, l, 2)
		checkTokens(t, b, kC, l, 3)

		// So does one whose reset mark holds what reset.lua never writes
		// (before, a Lua error ended the call, its neighbours unapplied).
		kM := r.Key(l, "foreign-mark")
		mustExact(t, r, kM, l, 5)
		if err := b.client.Set(ctx, markKey(kM), "x", 0).Err(); err != nil {
			t.Fatal(err)
		}
		failed = r.RefundAll(ctx, []Refund{
			{Key: kA, Limit: l, Tokens: 1},
			{Key: kM, Limit: l, Tokens: 1},
			{Key: kC, Limit: l, Tokens: 1},
		})
		if len(failed) != 1 || failed[0].Key != kM || failed[0].Err == nil {
			t.Fatalf("RefundAll with a foreign reset mark failed %+v; want that adjustment's alone", failed)
		}
		checkTokens(t, b, kA, l, 3)
		checkTokens(t, b, kC, l, 4)

		// An adjustment with an id of its own (a charge, a Settle's
		// refund) whose mark cannot be read records no id: sent again,
		// it fails again. Recorded before the mark was read, the resend
		// was answered as applied, and a charge never made went
		// uncounted.
		for _, adj := range []Refund{{Key: kM, Limit: l, Tokens: -2, Since: 1, ID: "charge-1"}, {Key: kM, Limit: l, Tokens: 1, Since: 1, ID: "refund-1"}} {
			for send := 1; send <= 2; send++ {
				failed := r.RefundAll(ctx, []Refund{adj})
				if len(failed) != 1 || failed[0].Err == nil || failed[0].Once() != adj.ID {
					t.Fatalf("send %d of %+v beside a foreign reset mark failed %+v; want it failed, under its id", send, adj, failed)
				}
			}
		}
		checkTokens(t, b, kM, l, 0)
	})

	t.Run("NOSCRIPT", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		k1, k2, k3 := r.Key(l, "1"), r.Key(l, "2"), r.Key(l, "3")
		for _, k := range []string{k1, k2, k3} {
			mustExact(t, r, k, l, 5)
		}
		b.flushScripts(t)
		if b.scriptCached(t, refundBatchScript.sha) {
			t.Fatal("refund batch script cached after SCRIPT FLUSH")
		}
		b.rec.reset()
		if err := r.Refund(ctx, []Refund{
			{Key: k1, Limit: l, Tokens: 1},
			{Key: k2, Limit: l, Tokens: 2},
		}); err != nil {
			t.Fatalf("Refund after SCRIPT FLUSH: %v", err)
		}
		// The call (both adjustments) answered NOSCRIPT goes again by
		// EVAL, which caches the script (a pipeline of calls: see "batch
		// of several script calls").
		if got, want := b.rec.take(), []string{"evalsha", "eval"}; !reflect.DeepEqual(got, want) {
			t.Errorf("Refund after SCRIPT FLUSH sent %v; want %v", got, want)
		}
		checkTokens(t, b, k1, l, 1)
		checkTokens(t, b, k2, l, 2)
		if !b.scriptCached(t, refundBatchScript.sha) {
			t.Error("refund batch script not cached again after the EVAL fallback")
		}
		if err := r.Refund(ctx, []Refund{{Key: k3, Limit: l, Tokens: 3}}); err != nil {
			t.Fatal(err)
		}
		// A lone adjustment goes without a pipeline.
		if got, want := b.rec.take(), []string{"evalsha"}; !reflect.DeepEqual(got, want) {
			t.Errorf("second Refund sent %v; want %v", got, want)
		}
		checkTokens(t, b, k3, l, 3)

		// refundOne goes through the same fallback.
		b.flushScripts(t)
		b.rec.reset()
		if rem, err := r.refundOne(ctx, k3, l, 1); err != nil || rem != 4 {
			t.Fatalf("refundOne after SCRIPT FLUSH = %d, %v; want 4, nil", rem, err)
		}
		if got, want := b.rec.take(), []string{"evalsha", "eval"}; !reflect.DeepEqual(got, want) {
			t.Errorf("refundOne after SCRIPT FLUSH sent %v; want %v", got, want)
		}
	})
}

func TestRefund(t *testing.T) { forEachBackend(t, suiteRefund) }

// suiteChargeUnkeyed: the refund script's form on the bucket alone (for a
// Cluster slot in migration; see adjustCall) charges, ignoring the reset
// mark and the id (a resend charges again: under-admission), and accepts
// only charges: a refund without its id and mark could create tokens.
func suiteChargeUnkeyed(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.Limit{Name: "unkeyed", Rate: 1, Period: time.Hour, Burst: 10}
	key := r.Key(l, "k")
	mustExact(t, r, key, l, 2)
	run := func(rf *Refund, n int64, keyed bool) (any, error) {
		keys, args := r.adjustCall(rf, n, keyed)
		return r.runKeys(ctx, refundScript, keys, args...)
	}
	// A Reset after the tokens were taken: the usual form forgives a
	// charge of them, the form on the bucket alone charges it.
	if _, err := r.Reset(ctx, key); err != nil {
		t.Fatal(err)
	}
	mustExact(t, r, key, l, 1)
	old := &Refund{Key: key, Limit: l, Tokens: -3, Since: 1, ID: "charge-1"}
	if _, err := run(old, -3, true); err != nil {
		t.Fatal(err)
	}
	checkTokens(t, b, key, l, 9)
	for i, want := range []int64{6, 3} {
		if _, err := run(old, -3, false); err != nil {
			t.Fatalf("unkeyed charge #%d: %v", i+1, err)
		}
		checkTokens(t, b, key, l, want)
	}
	ids := 0
	for _, k := range b.allKeys(t) {
		if strings.Contains(k, ":adj:") {
			ids++
		}
	}
	if ids != 1 {
		t.Errorf("%d id keys after one keyed and two unkeyed charges (%v); want the keyed one's", ids, b.allKeys(t))
	}
	// A refund (or any other list of keys) in that form is refused.
	if _, err := run(&Refund{Key: key, Limit: l, Tokens: 2, ID: "refund-1"}, 2, false); !errors.Is(err, ErrScript) {
		t.Errorf("an unkeyed refund = %v; want ErrScript", err)
	}
	keys, args := r.adjustCall(old, -3, true)
	args[len(args)-1] = 0
	if _, err := r.runKeys(ctx, refundScript, keys, args...); !errors.Is(err, ErrScript) {
		t.Errorf("an unkeyed charge with three keys = %v; want ErrScript", err)
	}
	checkTokens(t, b, key, l, 3)
}

func TestChargeUnkeyed(t *testing.T) { forEachBackend(t, suiteChargeUnkeyed) }

// TestRefundMatchesModel runs random interleavings of Exact and refundOne on
// miniredis and compares replies, stored state and TTL with the model.
func TestRefundMatchesModel(t *testing.T) {
	// Covered by TestAcquireMatchesModel, which mixes refunds in; this
	// one pins the interplay of refund and refill on a slow limit.
	b := newMiniBackend(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.Limit{Name: "slow", Rate: 7, Period: 3 * time.Second, Burst: 9}
	key := r.Key(l, "k")
	m := newModel(l)
	now := t0
	for i, op := range []struct {
		dt     time.Duration
		take   int64
		refund int64
	}{
		{0, 9, 0}, {100 * ms, 0, 4}, {0, 3, 0}, {429 * ms, 0, 1}, {1, 0, 1}, {0, 5, 0},
		{2 * time.Second, 0, 9}, {0, 2, 0}, {-time.Second, 0, 3}, {3 * time.Second, 6, 0},
	} {
		now = now.Add(op.dt)
		b.setTime(t, now)
		if op.take > 0 {
			got := mustExact(t, r, key, l, op.take)
			if want := m.acquire(micros(now), op.take, op.take, 1e6); got != (Grant{Granted: want.Granted, Remaining: want.Remaining, RetryAfter: want.RetryAfter, ResetAfter: want.ResetAfter}) {
				t.Errorf("op %d: Exact(%d) = %+v; want %+v", i, op.take, got, want)
			}
		} else {
			got, err := r.refundOne(context.Background(), key, l, op.refund)
			if err != nil {
				t.Fatal(err)
			}
			if want := m.refund(micros(now), op.refund); got != want {
				t.Errorf("op %d: refundOne(%d) = %d; want %d", i, op.refund, got, want)
			}
		}
		compareState(t, b, key, l, m, i)
	}
}

// compareState checks the stored bucket and its TTL against the model.
func compareState(t *testing.T, b *backend, key string, l policy.Limit, m *model, i int) {
	t.Helper()
	s, ts, ok := b.bigState(t, key, l)
	if ok != m.present || (ok && (s.Cmp(m.s) != 0 || ts != m.t)) {
		t.Errorf("op %d: stored (s=%d t=%d present=%v); model (s=%d t=%d present=%v)", i, s, ts, ok, m.s, m.t, m.present)
		return
	}
	if ok {
		if got, want := b.pttl(t, key), m.ttl(); got != want {
			t.Errorf("op %d: PTTL = %v; want %v", i, got, want)
		}
	}
}

// TestExpiryReadsAsFull checks, on miniredis, that a bucket's key outlives
// the time it needs to refill (so expiry never forgets a debt): just before
// the TTL the bucket is already full by its own arithmetic, and once the key
// has expired the next call sees the same full bucket.
func TestExpiryReadsAsFull(t *testing.T) {
	for _, l := range []policy.Limit{tenPerSec, threePerSec, {Name: "h", Rate: 1, Period: time.Hour, Burst: 3}} {
		b := newMiniBackend(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(l, "k")
		g := mustExact(t, r, key, l, l.Burst)
		ttl := b.pttl(t, key)
		if ttl < g.ResetAfter+time.Second || ttl > g.ResetAfter+time.Second+ms {
			t.Errorf("%v: PTTL %v after draining; want ResetAfter %v + 1s (rounded up to a ms)", l, ttl, g.ResetAfter)
		}
		// Just before expiry: still there, and full.
		b.mini.FastForward(ttl - ms)
		b.setTime(t, t0.Add(ttl-ms))
		if !b.mini.Exists(key) {
			t.Fatalf("%v: key expired before its TTL", l)
		}
		before := mustExact(t, r, key, l, l.Burst)
		// After expiry: gone, and full too.
		b.mini.FastForward(2 * ttl)
		if b.mini.Exists(key) {
			t.Fatalf("%v: key still there after its TTL", l)
		}
		b.setTime(t, t0.Add(3*ttl))
		after := mustExact(t, r, key, l, l.Burst)
		if before.Granted != l.Burst || after.Granted != l.Burst {
			t.Errorf("%v: full bucket before expiry granted %d, after expiry %d; want %d both", l, before.Granted, after.Granted, l.Burst)
		}
	}
}

// TestAdjustDebt: a charge takes a bucket below empty, at most one burst
// into debt; requests are denied until the debt is paid off by refill, with
// a retry-after that counts it; a refund brings it back.
func TestAdjustDebt(t *testing.T) {
	forEachBackend(t, func(t *testing.T, nb backendFactory) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		ctx := context.Background()
		l := policy.Limit{Name: "debt", Rate: 1, Period: time.Minute, Burst: 10}
		key := r.Key(l, "k")
		if w, err := r.Adjust(ctx, key, l, -4, 0); err != nil || w != 6 {
			t.Fatalf("charge 4 of a fresh bucket = %d, %v; want 6 left", w, err)
		}
		if w, err := r.Adjust(ctx, key, l, -9, 0); err != nil || w != -3 {
			t.Fatalf("charge 9 more = %d, %v; want -3 (in debt)", w, err)
		}
		g, err := r.exact(ctx, key, l, 1)
		if err != nil || g.Granted != 0 || g.Remaining != 0 {
			t.Fatalf("Exact(1) on a bucket 3 in debt = %+v, %v; want denied, 0 remaining", g, err)
		}
		// 4 tokens must accrue (the debt of 3, then the one asked for): 4 minutes.
		if g.RetryAfter < 3*time.Minute+50*time.Second || g.RetryAfter > 4*time.Minute {
			t.Errorf("retry-after %v; want about 4m", g.RetryAfter)
		}
		if w, err := r.Adjust(ctx, key, l, -100, 0); err != nil || w != -10 {
			t.Errorf("charge 100 more = %d, %v; want -10: at most one burst of debt", w, err)
		}
		if w, err := r.Adjust(ctx, key, l, 10, 0); err != nil || w != 0 {
			t.Errorf("refund 10 = %d, %v; want 0", w, err)
		}
		if _, err := r.Adjust(ctx, key, l, 0, 0); !errors.Is(err, ErrScript) {
			t.Errorf("Adjust by 0 = %v; want ErrScript", err)
		}
	})
}

// TestRefundsRefusedForMemory: adjustments Redis refuses for memory
// (maxmemory reached, noeviction) come back failed, each with its id (a
// refund without one: its call's) and an error that lets it be sent again
// (ErrRefused, not ErrReply), in every script call of the pipeline; sent
// again once memory is free, each is applied once. A call of several adjustments answers a refused one with
// {'e', error} as a value: an error element of a typed code (OOM) made
// go-redis read the whole reply as that error and leave the rest of it
// for the pipeline's next reply to misread (a review).
func TestRefundsRefusedForMemory(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	r, err := New(c, testPrefix+"oom")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	l := policy.Limit{Name: "oom", Rate: 1, Period: time.Hour, Burst: 10}
	remaining := tokensIn(t, r)
	rfs := make([]Refund, maxPerScript+5) // two script calls
	for i := range rfs {
		k := r.Key(l, "k"+strconv.Itoa(i))
		if _, err := r.Acquire(ctx, k, l, 3, 3, 1); err != nil {
			t.Fatal(err)
		}
		rfs[i] = Refund{Key: k, Limit: l, Tokens: 2}
	}
	// The scripts cached, so that a refused call is run (EVAL would be
	// refused before it runs): refund_batch.lua's (refunds without an id)
	// and refund.lua's (an adjustment with one).
	if failed := r.RefundAll(ctx, []Refund{{Key: r.Key(l, "warm"), Limit: l, Tokens: 1},
		{Key: r.Key(l, "warm"), Limit: l, Tokens: 1, ID: "warm-1"}}); len(failed) != 0 {
		t.Fatal(failed[0].Err)
	}
	setMaxmemory := func(v string) {
		if err := c.ConfigSet(ctx, "maxmemory", v).Err(); err != nil {
			t.Fatal(err)
		}
	}
	setMaxmemory("1")
	t.Cleanup(func() { _ = c.ConfigSet(context.Background(), "maxmemory", "0").Err() })

	// One call of two adjustments, by hand: its reply is read whole.
	in := r.adjustInvocation([]*Refund{{Key: rfs[0].Key, Limit: l, Tokens: 1, ID: "by-hand-1"}, {Key: rfs[1].Key, Limit: l, Tokens: 1, ID: "by-hand-2"}})
	v, err := c.EvalSha(ctx, refundScript.sha, in.keys, in.args...).Result()
	if err != nil {
		t.Fatalf("a refused call of two adjustments: error %v; want a reply of two errors as values", err)
	}
	for i := range 2 {
		if msg, ok := adjustError(v.([]any)[i]); !ok || !strings.HasPrefix(msg, "OOM") {
			t.Fatalf("a refused call of two adjustments replied %v; want {'e', OOM ...} for each", v)
		}
	}

	failed := r.RefundAll(ctx, rfs)
	setMaxmemory("0")
	if len(failed) != len(rfs) {
		t.Fatalf("%d of %d adjustments refused for memory failed; want all", len(failed), len(rfs))
	}
	again := make([]Refund, len(failed))
	for i, f := range failed {
		if f.Call == "" || !errors.Is(f.Err, ErrRefused) {
			t.Fatalf("refused refund %+v; want its call's id and ErrRefused", f)
		}
		again[i] = f.Refund
	}
	if failed := r.RefundAll(ctx, again); len(failed) != 0 {
		t.Fatalf("sent again with memory free: %d failed, the first %v", len(failed), failed[0].Err)
	}
	if failed := r.RefundAll(ctx, again); len(failed) != 0 { // a resend: applied once
		t.Fatalf("sent a third time: %d failed, the first %v", len(failed), failed[0].Err)
	}
	for _, rf := range rfs {
		if got := remaining(rf.Key, l); got != 9 {
			t.Errorf("bucket %s: %d tokens; want 9 (3 taken, 2 back once)", rf.Key, got)
		}
	}
}

// TestRefundBatch: refunds without an id go in calls of refund_batch.lua,
// each applied at most once by one id key per call (their Call), not a key
// per refund. The same call sent again applies nothing, nor do fewer of its
// refunds sent again under its Call, while a new call applies; a bucket
// repeated in a call is adjusted in order and written once.
func TestRefundBatch(t *testing.T) {
	forEachBackend(t, func(t *testing.T, nb backendFactory) {
		ctx := context.Background()
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		l := policy.Limit{Name: "rb", Rate: 1, Period: time.Hour, Burst: 10}
		const n = 2*maxPerScript + 22
		rfs := make([]Refund, n)
		for i := range rfs {
			k := r.Key(l, "k"+strconv.Itoa(i))
			mustExact(t, r, k, l, 6) // 4 left
			rfs[i] = Refund{Key: k, Limit: l, Tokens: 2}
		}
		before := len(b.allKeys(t))
		if failed := r.RefundAll(ctx, rfs); len(failed) != 0 {
			t.Fatalf("RefundAll: %v", failed[0].Err)
		}
		if got := len(b.allKeys(t)) - before; got != 3 {
			t.Errorf("%d refunds in three calls made %d keys; want 3, an id key per call", n, got)
		}
		for _, rf := range rfs {
			checkTokens(t, b, rf.Key, l, 6)
		}

		// A call sent again, and fewer of its refunds under its Call, are
		// applied no more; a new call (no Call) is.
		rs := []*Refund{{Key: rfs[0].Key, Limit: l, Tokens: 1}, {Key: rfs[1].Key, Limit: l, Tokens: 1}}
		groups := r.batchGroups(rs)
		if len(groups) != 1 || rs[0].Call == "" || rs[0].Call != rs[1].Call {
			t.Fatalf("two refunds of one limit grouped as %v, Calls %q and %q; want one call", groups, rs[0].Call, rs[1].Call)
		}
		in := r.refundBatchInvocation(groups[0])
		for i, want := range []string{"++", "="} {
			v, err := b.client.EvalSha(ctx, refundBatchScript.sha, in.keys, in.args...).Result()
			if err != nil || v != want {
				t.Fatalf("the call sent %d times replied %v, %v; want %q", i+1, v, err, want)
			}
		}
		if failed := r.RefundAll(ctx, []Refund{*rs[1]}); len(failed) != 0 {
			t.Fatal(failed[0].Err)
		}
		checkTokens(t, b, rfs[0].Key, l, 7)
		checkTokens(t, b, rfs[1].Key, l, 7)
		if failed := r.RefundAll(ctx, []Refund{{Key: rfs[1].Key, Limit: l, Tokens: 1}}); len(failed) != 0 {
			t.Fatal(failed[0].Err)
		}
		checkTokens(t, b, rfs[1].Key, l, 8)

		// A bucket repeated in one call: since stamps differ, the refunds
		// are not merged, and each adds its tokens, capped at the burst
		// (read once: the second read before the first write would leave
		// 9).
		k := rfs[2].Key // 6 left
		// Stamps of the scripts' clock, younger than a reset mark lives.
		now, err := b.client.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		if failed := r.RefundAll(ctx, []Refund{
			{Key: k, Limit: l, Tokens: 3, Since: now.UnixMicro() - 2},
			{Key: rfs[3].Key, Limit: l, Tokens: 1},
			{Key: k, Limit: l, Tokens: 3, Since: now.UnixMicro() - 1},
		}); len(failed) != 0 {
			t.Fatal(failed[0].Err)
		}
		checkTokens(t, b, k, l, -1) // full: deleted
		checkTokens(t, b, rfs[3].Key, l, 7)

		// A call whose refunds all found their bucket full (missing)
		// records its id all the same: sent again once the bucket was
		// drained, it would add tokens the bucket could not hold the
		// first time (a review).
		gone := r.Key(l, "gone")
		rs = []*Refund{{Key: gone, Limit: l, Tokens: 3}}
		in = r.refundBatchInvocation(r.batchGroups(rs)[0])
		for i, want := range []string{"+", "="} {
			if i == 1 {
				mustExact(t, r, gone, l, 10) // drained meanwhile
			}
			v, err := b.client.EvalSha(ctx, refundBatchScript.sha, in.keys, in.args...).Result()
			if err != nil || v != want {
				t.Fatalf("a call to a missing bucket sent %d times replied %v, %v; want %q", i+1, v, err, want)
			}
		}
		checkTokens(t, b, gone, l, 0)

		// An adjustment with an id, after refunds whose pipeline took the
		// whole deadline, is not sent, and says so (ErrNotSent): it never
		// reached Redis (a review).
		done, cancel := context.WithCancel(ctx)
		cancel()
		failed := r.RefundAll(done, []Refund{{Key: rfs[4].Key, Limit: l, Tokens: 1}, {Key: rfs[5].Key, Limit: l, Tokens: -1, ID: "charge-1"}})
		if len(failed) != 2 || !errors.Is(failed[1].Err, ErrNotSent) || failed[1].ID != "charge-1" {
			t.Fatalf("RefundAll with its ctx over failed %+v; want both, the charge with ErrNotSent and its id", failed)
		}
		checkTokens(t, b, rfs[5].Key, l, 6)

		// A refund to a full bucket writes nothing (it deleted it, a write
		// that changed nothing), and one to a missing bucket does not read
		// its reset mark: it has nothing to do whatever the mark says (a
		// foreign one failed it).
		full, missing := r.Key(l, "full"), r.Key(l, "missing")
		if err := b.client.Set(ctx, full, "10 0 1 -", time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
		if err := b.client.Set(ctx, markKey(missing), "x", 0).Err(); err != nil {
			t.Fatal(err)
		}
		if failed := r.RefundAll(ctx, []Refund{{Key: full, Limit: l, Tokens: 1}, {Key: missing, Limit: l, Tokens: 1}}); len(failed) != 0 {
			t.Fatalf("refunds to a full and a missing bucket failed %+v; want both applied, with nothing to do", failed)
		}
		if v, err := b.client.Get(ctx, full).Result(); err != nil || v != "10 0 1 -" {
			t.Errorf("the full bucket after a refund: %q, %v; want it untouched", v, err)
		}
		if n, err := b.client.Exists(ctx, missing).Result(); err != nil || n != 0 {
			t.Errorf("the missing bucket after a refund: %d keys, %v; want still missing", n, err)
		}

		// A call whose every refund failed records no id, though its
		// errors name keys with a '+' in them (a review: the reply, errors
		// and all, was searched for one, and such a call was taken as
		// applied: its resend answered '=').
		plus := policy.Limit{Name: "r+b", Rate: 1, Period: time.Hour, Burst: 10}
		kPlus := r.Key(plus, "foreign")
		if err := b.client.Set(ctx, kPlus, "x", 0).Err(); err != nil {
			t.Fatal(err)
		}
		before = len(b.allKeys(t))
		rs = []*Refund{{Key: kPlus, Limit: plus, Tokens: 1}}
		in = r.refundBatchInvocation(r.batchGroups(rs)[0])
		for i := range 2 {
			v, err := b.client.EvalSha(ctx, refundBatchScript.sha, in.keys, in.args...).Result()
			if s, _ := v.(string); err != nil || !strings.HasPrefix(s, "e\n") {
				t.Fatalf("a call whose one refund failed, sent %d times, replied %q, %v; want its failure", i+1, v, err)
			}
		}
		if got := len(b.allKeys(t)) - before; got != 0 {
			t.Errorf("a call whose every refund failed made %d keys; want none (no id)", got)
		}
	})
}
