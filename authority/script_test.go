package authority

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

func TestScriptSHAs(t *testing.T) {
	for _, s := range []script{batchScript, refundScript} {
		h := sha1.Sum([]byte(s.src))
		if s.sha != hex.EncodeToString(h[:]) || len(s.sha) != 40 {
			t.Errorf("sha %q does not match the source", s.sha)
		}
	}
	if batchScript.src == "" || refundScript.src == "" || batchScript.sha == refundScript.sha {
		t.Error("embedded scripts missing or identical")
	}
}

func suiteScripts(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	l := tenPerSec

	t.Run("SCRIPT LOAD gives the embedded SHA", func(t *testing.T) {
		b := nb(t)
		for _, s := range []script{batchScript, refundScript} {
			sha, err := b.client.ScriptLoad(ctx, s.src).Result()
			if err != nil {
				t.Fatalf("SCRIPT LOAD: %v", err)
			}
			if sha != s.sha {
				t.Errorf("SCRIPT LOAD returned %s; embedded sha is %s", sha, s.sha)
			}
		}
	})

	t.Run("NOSCRIPT falls back to EVAL and caches again", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(l, "k")
		b.flushScripts(t)
		b.rec.reset()
		// Cold cache: EVALSHA fails with NOSCRIPT, EVAL runs and caches.
		checkGrant(t, b, "Exact(2) on a cold cache", mustExact(t, r, key, l, 2), grant(2, 3, 0, 200*ms))
		if got, want := b.rec.take(), []string{"evalsha", "eval"}; !reflect.DeepEqual(got, want) {
			t.Errorf("first Acquire sent %v; want %v", got, want)
		}
		if !b.scriptCached(t, batchScript.sha) {
			t.Fatal("batch script not cached after the EVAL fallback")
		}
		checkGrant(t, b, "Exact(2) cached", mustExact(t, r, key, l, 2), grant(2, 1, 0, 400*ms))
		if got, want := b.rec.take(), []string{"evalsha"}; !reflect.DeepEqual(got, want) {
			t.Errorf("second Acquire sent %v; want %v", got, want)
		}
		// SCRIPT FLUSH between calls (a restart or failover drops the cache
		// too): the bucket state is kept and the next call still works.
		b.flushScripts(t)
		if b.scriptCached(t, batchScript.sha) {
			t.Fatal("batch script still cached after SCRIPT FLUSH")
		}
		b.rec.reset()
		checkGrant(t, b, "Exact(2) after SCRIPT FLUSH", mustExact(t, r, key, l, 2), grant(0, 1, 100*ms, 400*ms))
		if got, want := b.rec.take(), []string{"evalsha", "eval"}; !reflect.DeepEqual(got, want) {
			t.Errorf("Acquire after SCRIPT FLUSH sent %v; want %v", got, want)
		}
		if !b.scriptCached(t, batchScript.sha) {
			t.Error("batch script not cached again")
		}
		checkGrant(t, b, "Exact(1) after SCRIPT FLUSH", mustExact(t, r, key, l, 1), grant(1, 0, 0, 500*ms))
	})

	t.Run("invalid Acquire arguments touch nothing", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(l, "k")
		b.rec.reset()
		for _, c := range []struct{ want, min int64 }{
			{1, 0}, {1, -1}, {0, 0}, {-1, -1}, {2, 3}, {6, 1}, {6, 6}, {1 << 62, 1}, {-5, 1},
		} {
			g, err := r.Acquire(ctx, key, l, c.want, c.min, 1)
			if !errors.Is(err, ErrScript) {
				t.Errorf("Acquire(want=%d,min=%d) burst %d: err = %v; want ErrScript", c.want, c.min, l.Burst, err)
			}
			if g != (Grant{}) {
				t.Errorf("Acquire(want=%d,min=%d) returned %+v with its error", c.want, c.min, g)
			}
		}
		for _, n := range []int64{0, -1, 6} {
			if _, err := r.exact(ctx, key, l, n); !errors.Is(err, ErrScript) {
				t.Errorf("Exact(%d): err = %v; want ErrScript", n, err)
			}
		}
		b.untouched(t)
	})

	t.Run("invalid limits are rejected before the script", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		// The widest limit Validate accepts must work in the script.
		edge := edgeLimit("e", 1, time.Microsecond)
		for _, bad := range []policy.Limit{
			{Name: "r0", Rate: 0, Period: time.Second, Burst: 5},
			{Name: "rneg", Rate: -3, Period: time.Second, Burst: 5},
			{Name: "p0", Rate: 1, Period: 0, Burst: 5},
			{Name: "pneg", Rate: 1, Period: -time.Second, Burst: 5},
			{Name: "psub", Rate: 1, Period: 500 * time.Nanosecond, Burst: 5},  // 0 whole µs
			{Name: "e1", Rate: 2, Period: time.Microsecond, Burst: 1<<53 - 1}, // one past the edge
			{Name: "e2", Rate: 1, Period: time.Microsecond, Burst: 1 << 53},
			{Name: "e3", Rate: 1, Period: time.Second, Burst: 1 << 60},
			{Name: "rbig", Rate: 1 << 53, Period: time.Microsecond, Burst: 5},
		} {
			if err := bad.Validate(); err == nil {
				t.Errorf("%v passes policy Validate; the test expects it invalid", bad)
			}
			key := r.Key(bad, "k")
			if _, err := r.Acquire(ctx, key, bad, 1, 1, 1); !errors.Is(err, ErrScript) {
				t.Errorf("Acquire under %v: err = %v; want ErrScript", bad, err)
			}
			if bad.Burst >= 1 {
				if _, err := r.refundOne(ctx, key, bad, 1); !errors.Is(err, ErrScript) {
					t.Errorf("refundOne under %v: err = %v; want ErrScript", bad, err)
				}
			}
		}
		b.noKeys(t)
		if _, err := r.Acquire(ctx, r.Key(edge, "k"), edge, 1, 1, 1); err != nil {
			t.Errorf("Acquire under %v (valid): %v", edge, err)
		}
	})

	t.Run("garbage ARGV via EVAL", func(t *testing.T) {
		b := nb(t)
		r := b.newAuthority(t, testPrefix)
		key := r.Key(l, "existing")
		mustExact(t, r, key, l, 2) // a bucket whose state must survive
		before := b.value(t, key)
		fresh := r.Key(l, "fresh")

		garbage := []string{"abc", "", " ", "1.5", "0.999", "-1", "0", "-0", "9007199254740992",
			"9007199254740993", "1e300", "-1e300", "nan", "NaN", "inf", "-inf", "1/2", "1,5", "--1", "1 2"}
		type call struct {
			name string
			s    *script
			argv []any
		}
		valid := []call{
			// window, one limit (r, p, burst), one call under it (L+1: not
			// exact) of want 1, min 1, share_ppm 1e6.
			{"batch", &batchScript, []any{int64(5000), int64(1), int64(10), int64(1_000_000), int64(5), int64(2), int64(1), int64(1), int64(1_000_000)}},
			// window, L = -1, one token bucket, one exact call of want 1:
			// the usual batch, on the script's own path for it.
			{"batch exact-only", &batchScript, []any{int64(5000), int64(-1), int64(10), int64(1_000_000), int64(5), int64(1)}},
			// The same form, one call of want 2 that may take 1, share 1.
			{"batch one bucket, a min", &batchScript, []any{int64(5000), int64(-1), int64(10), int64(1_000_000), int64(5), int64(-2), int64(1), int64(1_000_000)}},
			{"refund", &refundScript, []any{int64(10), int64(1_000_000), int64(5), int64(1)}},
		}
		var calls []call
		for _, v := range valid {
			name, s, argv := v.name, v.s, v.argv
			for i := range argv {
				for _, g := range garbage {
					if s == &refundScript && i == 3 && g == "-1" {
						continue // a refund of -1 is a charge of 1 (see refund.lua)
					}
					if s == &batchScript && i == 0 && g == "-1" {
						continue // a resend's window of 1ms, its reply kept even for a denial (see batch.lua's always)
					}
					if strings.HasPrefix(name, "batch exact-only") || strings.HasPrefix(name, "batch one bucket") {
						if i == 1 && g == "-1" {
							continue // the form itself
						}
						if name == "batch one bucket, a min" && i == 5 && g == "-1" {
							continue // want 1, min 1: valid
						}
					}
					a := append([]any(nil), argv...)
					a[i] = g
					calls = append(calls, call{fmt.Sprintf("%s ARGV[%d]=%q", name, i+1, g), s, a})
				}
			}
			calls = append(calls,
				call{name + " no ARGV", s, nil},
				call{name + " one ARGV short", s, argv[:len(argv)-1]},
			)
		}
		calls = append(calls,
			call{"batch share 1000001 ppm", &batchScript, []any{5000, 1, 10, 1_000_000, 5, 2, 1, 1, 1_000_001}},
			call{"batch min > want", &batchScript, []any{5000, 1, 10, 1_000_000, 5, 2, 2, 3, 1_000_000}},
			call{"batch want > burst", &batchScript, []any{5000, 1, 10, 1_000_000, 5, 1, 6}},
			call{"batch limit 0", &batchScript, []any{5000, 1, 10, 1_000_000, 5, 0, 1}},
			call{"batch limit past L", &batchScript, []any{5000, 1, 10, 1_000_000, 5, 3, 1, 1, 1_000_000}},
			call{"batch one ARGV too many", &batchScript, []any{5000, 1, 10, 1_000_000, 5, 1, 1, 1}},
			call{"batch fewer calls than keys", &batchScript, []any{5000, 1, 10, 1_000_000, 5}},
			call{"batch quota window not before next", &batchScript, []any{5000, 1, "w100", 100, 5, 1, 1}},
			call{"batch quota window garbage", &batchScript, []any{5000, 1, "wx", 100, 5, 1, 1}},
			call{"batch quota window without its start", &batchScript, []any{5000, 1, "w100", 200, 5, 1, 1}},
			call{"batch quota window starting at its end", &batchScript, []any{5000, 1, "w100:100", 200, 5, 1, 1}},
			call{"batch quota window starting at 0", &batchScript, []any{5000, 1, "w100:0", 200, 5, 1, 1}},
			call{"refund quota window without its start", &refundScript, []any{"w100", 200, 5, 1, 0, 0, 1000}},
			call{"refund quota window starting after its end", &refundScript, []any{"w100:150", 200, 5, 1, 0, 0, 1000}},
			call{"batch burst*period+rate = 2^53+1", &batchScript, []any{5000, 1, 2, 1, int64(1<<53 - 1), 1, 1}},
			call{"batch burst > 2^52", &batchScript, []any{5000, 1, 1, 1_000_000, int64(1<<52 + 1), 1, 1}},
			call{"batch exact-only want > burst", &batchScript, []any{5000, -1, 10, 1_000_000, 5, 6}},
			call{"batch exact-only want 0", &batchScript, []any{5000, -1, 10, 1_000_000, 5, 0}},
			call{"batch exact-only with a limit index", &batchScript, []any{5000, -1, 10, 1_000_000, 5, 1, 1}},
			call{"batch exact-only without a call", &batchScript, []any{5000, -1, 10, 1_000_000, 5}},
			call{"batch exact-only on a quota", &batchScript, []any{5000, -1, "w100:50", 200, 5, 1}},
			call{"batch exact-only burst > 2^52", &batchScript, []any{5000, -1, 1, 1_000_000, int64(1<<52 + 1), 1}},
			call{"batch L = -2", &batchScript, []any{5000, -2, 10, 1_000_000, 5, 1, 1}},
			call{"batch one bucket, min > want", &batchScript, []any{5000, -1, 10, 1_000_000, 5, -2, 3, 1_000_000}},
			call{"batch one bucket, want > burst", &batchScript, []any{5000, -1, 10, 1_000_000, 5, -6, 1, 1_000_000}},
			call{"batch one bucket, share 1000001 ppm", &batchScript, []any{5000, -1, 10, 1_000_000, 5, -2, 1, 1_000_001}},
			call{"batch one bucket, no share", &batchScript, []any{5000, -1, 10, 1_000_000, 5, -2, 1}},
			call{"batch one bucket, one ARGV too many", &batchScript, []any{5000, -1, 10, 1_000_000, 5, -2, 1, 1_000_000, 1}},
			call{"refund n > burst", &refundScript, []any{10, 1_000_000, 5, 6}},
			call{"refund n < -2·burst", &refundScript, []any{10, 1_000_000, 5, -11}},
			call{"refund burst*period+rate = 2^53+1", &refundScript, []any{2, 1, int64(1<<53 - 1), 1}},
		)
		for _, c := range calls {
			for _, k := range []string{key, fresh} {
				keys := []string{k}
				if c.s == &batchScript {
					keys = []string{testPrefix + ":batch:{x}:1", k}
				}
				err := b.client.Eval(ctx, c.s.src, keys, c.argv...).Err()
				if err == nil || !strings.Contains(err.Error(), "leaselimit: invalid") {
					t.Errorf("EVAL %s: err = %v; want one containing %q", c.name, err, "leaselimit: invalid")
				}
				if !errors.Is(classify(err), ErrScript) {
					t.Errorf("EVAL %s: classify(%v) does not wrap ErrScript", c.name, err)
				}
			}
		}
		if got := b.value(t, key); !reflect.DeepEqual(got, before) {
			t.Errorf("rejected calls changed the bucket from %v to %v", before, got)
		}
		if ks := b.keys(t); !reflect.DeepEqual(ks, []string{key}) {
			t.Errorf("keys after rejected calls: %v; want only %s", ks, key)
		}
	})

	t.Run("no key", func(t *testing.T) {
		b := nb(t)
		// The scripts read KEYS[1] only; with no key they must fail, not
		// write a key named "nil" or similar.
		for _, s := range []script{batchScript, refundScript} {
			_ = b.client.Eval(ctx, s.src, nil, 5000, 1, 10, 1_000_000, 5, 1, 1).Err()
		}
		if ks := b.keys(t); len(ks) != 0 {
			t.Errorf("scripts called without KEYS wrote %v", ks)
		}
	})
}

func TestScripts(t *testing.T) { forEachBackend(t, suiteScripts) }

// TestScriptLenientNumbers documents number spellings the scripts accept
// although Acquire and Refund never send them (tonumber in Lua parses hex,
// exponents, a trailing ".0" and surrounding spaces). It only logs.
func TestScriptLenientNumbers(t *testing.T) {
	forEachBackend(t, func(t *testing.T, nb backendFactory) {
		b := nb(t)
		for _, v := range []string{"0x10", "1e1", "10.0", " 10 ", "+10", "010"} {
			key := fmt.Sprintf("lenient:{%s}", v)
			err := b.client.Eval(context.Background(), batchScript.src, []string{key + ":batch", key},
				5000, 1, v, 1_000_000, 20, 1, 1).Err()
			t.Logf("%s: batch with rate %q: err = %v", b.name, v, err)
		}
	})
}
