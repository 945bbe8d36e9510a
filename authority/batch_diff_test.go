package authority

import (
	"context"
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// holdWallClock fixes the client's clock (which picks a calendar quota's
// windows) at at for the rest of the test.
func holdWallClock(t *testing.T, at time.Time) {
	old := wallClock
	wallClock = func() time.Time { return at }
	t.Cleanup(func() { wallClock = old })
}

// bucketFields returns a bucket's "<w> <f> <t>" ("" when missing): what the
// batch script and the reference must agree on, whatever their tails.
func bucketFields(v string) string {
	f := strings.Fields(v)
	if len(f) < 3 {
		return v
	}
	return strings.Join(f[:3], " ")
}

// TestBatchMatchesReference decides random batches of calls with the batch
// script (AcquireAll) on one miniredis and call by call with the replaced
// acquire script (refAcquireSrc) on another, both clocks set alike, and
// wants every Grant field identical, and the buckets and their TTLs too.
// The batches repeat keys; the limits are everyday ones, ones at the edge of
// the exact range (muldiv's slow path, saturation at 2^52) and hourly and
// daily quotas; the clock jumps forwards and back, past windows' ends;
// charges put buckets in debt; a third of the batches are calls under
// one token bucket, which the script decides on a path of its own; and the
// batch side now and then reads the reference's buckets, in the old
// 8-field form.
func TestBatchMatchesReference(t *testing.T) {
	ctx := context.Background()
	client := time.Date(2025, 3, 1, 12, 30, 0, 0, time.UTC) // the client's clock
	holdWallClock(t, client)
	seeds := 25
	if testing.Short() {
		seeds = 10
	}
	var granted, denied, debts, exactOnly, ranged int
	for seed := int64(1); seed <= int64(seeds); seed++ {
		rng := rand.New(rand.NewSource(seed))
		limits := []policy.Limit{randomLimit(rng, 1), randomLimit(rng, 2),
			policy.Quota("hq", rng.Int63n(20)+1, policy.Hour, nil), policy.Quota("dq", rng.Int63n(1e12)+1, policy.Day, nil)}
		if seed%3 == 0 {
			limits = append(limits, edgeLimit("edge", policy.MaxRate, policy.MaxPeriod))
		}
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			nb, ref := newMiniBackend(t), newMiniBackend(t)
			r, rr := nb.newAuthority(t, testPrefix), ref.newAuthority(t, testPrefix)
			refSHA, err := ref.client.ScriptLoad(ctx, refAcquireSrc).Result()
			if err != nil {
				t.Fatal(err)
			}
			type bucket struct {
				key string
				l   policy.Limit
			}
			var buckets []bucket
			for _, l := range limits {
				for u := range 3 {
					buckets = append(buckets, bucket{r.Key(l, fmt.Sprint("u", u)), l})
				}
			}
			window := map[string]int64{} // a quota bucket's window at its last grant
			now := client.Add(-time.Duration(rng.Int63n(int64(2 * time.Hour))))
			for step := range 60 {
				switch rng.Intn(6) {
				case 0:
				case 1:
					now = now.Add(-time.Duration(rng.Int63n(int64(time.Second))))
				case 2:
					now = now.Add(time.Duration(rng.Int63n(1000)) * time.Microsecond)
				case 3: // at a window's end, or a µs off it
					now = client.Truncate(time.Hour).Add(time.Duration(rng.Intn(3)+1)*time.Hour +
						time.Duration(rng.Intn(3)-1)*time.Microsecond)
				default:
					now = now.Add(time.Duration(rng.Int63n(int64(40 * time.Minute))))
				}
				nb.setTime(t, now)
				ref.setTime(t, now)
				what := fmt.Sprintf("step %d at %v", step, now.Sub(client))

				if rng.Intn(8) == 0 { // the batch side reads the old form
					for _, bk := range buckets {
						if v := ref.value(t, bk.key); v != "" {
							if err := nb.client.Set(ctx, bk.key, v, ref.pttl(t, bk.key)).Err(); err != nil {
								t.Fatal(err)
							}
						}
					}
				}
				if rng.Intn(5) == 0 { // a refund or, more often, a charge into debt
					bk := buckets[rng.Intn(len(buckets))]
					n := rng.Int63n(2*bk.l.Burst) - bk.l.Burst*3/2
					if n == 0 {
						n = -1
					}
					w := window[bk.key]
					rf1 := Refund{Key: bk.key, Limit: bk.l, Tokens: n, Window: w}
					rf2 := rf1
					got, err1 := r.Apply(ctx, &rf1)
					want, err2 := rr.Apply(ctx, &rf2)
					if err1 != nil || err2 != nil || got != want {
						t.Fatalf("%s: Apply(%d) = %d, %v; reference %d, %v", what, n, got, err1, want, err2)
					}
					if got < 0 {
						debts++
					}
				}

				// A third of the batches are the usual kind, which the
				// script decides on a path of its own: calls under one
				// token bucket (limits 0 and 1, and the edge one).
				from, usual := buckets, rng.Intn(3) == 0
				if usual {
					k := rng.Intn(2)
					if len(limits) == 5 && rng.Intn(2) == 0 {
						k = 4
					}
					from = buckets[3*k : 3*k+3]
				}
				var as []*Acquisition
				for range rng.Intn(12) + 1 {
					bk := from[rng.Intn(len(from))]
					if rng.Intn(3) == 0 && len(as) > 0 { // the same key again
						bk = bucket{as[len(as)-1].Key, as[len(as)-1].Limit}
					}
					want := rng.Int63n(min(bk.l.Burst, 5)) + 1
					if rng.Intn(3) == 0 {
						want = rng.Int63n(bk.l.Burst) + 1
					}
					mn, share := want, 1.0
					if rng.Intn(3) == 0 { // a lease's refill
						mn, share = rng.Int63n(want)+1, rng.Float64()
						if usual {
							ranged++
						}
					}
					as = append(as, &Acquisition{Key: bk.key, Limit: bk.l, Want: want, Min: mn, Share: share})
				}
				if usual {
					exactOnly++
				}
				r.AcquireAll(ctx, as)
				for i, a := range as {
					rate, period := spec(a.Limit)
					v, err := ref.client.EvalSha(ctx, refSHA, []string{a.Key}, rate, period, a.Limit.Burst, a.Want, a.Min, ppm(a.Share)).Result()
					if err != nil {
						t.Fatalf("%s: reference call %d: %v", what, i, err)
					}
					want, err := decodeRefGrant(v)
					if err != nil {
						t.Fatal(err)
					}
					if a.Err != nil || a.Grant != want {
						t.Fatalf("%s: call %d of %d (%v want=%d min=%d share=%v) = %+v, %v; reference %+v",
							what, i, len(as), a.Limit, a.Want, a.Min, a.Share, a.Grant, a.Err, want)
					}
					if a.Grant.Granted > 0 {
						granted++
					} else {
						denied++
					}
					if a.Limit.IsQuota() && a.Grant.Granted > 0 {
						window[a.Key] = a.Grant.At + a.Grant.ResetAfter.Microseconds()
					}
				}
				for _, bk := range buckets {
					got, want := bucketFields(nb.value(t, bk.key)), bucketFields(ref.value(t, bk.key))
					if got != want {
						t.Fatalf("%s: bucket %s = %q; reference %q", what, bk.key, got, want)
					}
					if got != "" {
						if a, b := nb.pttl(t, bk.key), ref.pttl(t, bk.key); a != b {
							t.Fatalf("%s: bucket %s TTL %v; reference %v", what, bk.key, a, b)
						}
					}
				}
			}
		})
	}
	t.Logf("%d calls granted, %d denied; %d charges left a bucket in debt; %d batches of the usual kind, %d calls with a min and a share in them", granted, denied, debts, exactOnly, ranged)
	if granted == 0 || denied == 0 || debts == 0 || exactOnly == 0 || ranged == 0 {
		t.Error("the random calls do not exercise grants, denials, debt and the usual batch")
	}
}

// suiteBatchFullBucketStamp: a bucket stored full at an old time (as a
// refund can leave it) is full now, not fuller: the grant taken from it is
// stamped now, so that the time it sat full never refills it. Both forms
// of the script: the usual batch (calls on one token bucket), with an
// exact call and with one that may take less, and the general one.
func suiteBatchFullBucketStamp(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.Limit{Name: "stamp", Rate: 1, Period: time.Second, Burst: 5}
	other := policy.Limit{Name: "other", Rate: 1, Period: time.Second, Burst: 5}
	for _, tc := range []struct {
		form    string
		min     int64
		general bool // a call under another limit sends the batch to the general path
	}{{"usual, exact", 2, false}, {"usual, a min", 1, false}, {"general", 1, true}} {
		key := r.Key(l, tc.form)
		if err := b.client.Set(ctx, key, "5 0 1000000 -", time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
		as := []*Acquisition{{Key: key, Limit: l, Want: 2, Min: tc.min, Share: 1}}
		if tc.general {
			as = append(as, &Acquisition{Key: r.Key(other, tc.form), Limit: other, Want: 1, Min: 1, Share: 1})
		}
		r.AcquireAll(ctx, as)
		if a := as[0]; a.Err != nil || a.Grant.Granted != 2 || a.Grant.Remaining != 3 {
			t.Fatalf("%s: %+v, %v; want 2 granted, 3 left", tc.form, a.Grant, a.Err)
		}
		var w, f, stamp int64
		if _, err := fmt.Sscanf(b.value(t, key), "%d %d %d -", &w, &f, &stamp); err != nil {
			t.Fatal(err)
		}
		if w != 3 || f != 0 || stamp != as[0].Grant.At {
			t.Errorf("%s: bucket %d %d %d; want 3 0 %d (stamped at the grant)", tc.form, w, f, stamp, as[0].Grant.At)
		}
	}
}

func TestBatchFullBucketStamp(t *testing.T) { forEachBackend(t, suiteBatchFullBucketStamp) }

// TestBatchSaturatedRefill: both paths of the script refill a bucket in
// deep debt alike when the tokens due pass 2^52 (HUGE), where muldiv
// saturates: 2^52 - 1 tokens 5 µs after "-1" at 2^50 a µs, burst 2^52, so
// a call for 2^52 is denied on either. A limit past policy.Validate's
// bounds, which the authority accepts (a review: the usual path's inline
// refill compared the unsaturated count, and granted it).
func TestBatchSaturatedRefill(t *testing.T) {
	ctx := context.Background()
	b := newMiniBackend(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.Limit{Name: "huge", Rate: 1 << 50, Period: time.Microsecond, Burst: 1 << 52}
	other := policy.Limit{Name: "other", Rate: 1, Period: time.Second, Burst: 5}
	for _, general := range []bool{false, true} {
		key := r.Key(l, fmt.Sprint("general ", general))
		stamp := t0.UnixMicro() - 5
		if err := b.client.Set(ctx, key, fmt.Sprintf("-1 0 %d -", stamp), time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
		as := []*Acquisition{{Key: key, Limit: l, Want: 1 << 52, Min: 1 << 52, Share: 1}}
		if general {
			as = append(as, &Acquisition{Key: r.Key(other, "x"), Limit: other, Want: 1, Min: 1, Share: 1})
		}
		r.AcquireAll(ctx, as)
		if a := as[0]; a.Err != nil || a.Grant.Granted != 0 || a.Grant.Remaining != 1<<52-1 {
			t.Errorf("general path %v: %+v, %v; want a denial, 2^52 - 1 left", general, a.Grant, a.Err)
		}
	}
}

// suiteBatchRepeatedKey: one key six times in one batch, burst 5: decided
// in order (five granted, the sixth denied) and written once.
func suiteBatchRepeatedKey(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.Limit{Name: "rep", Rate: 1, Period: time.Hour, Burst: 5}
	key := r.Key(l, "k")
	as := repeated(key, l, 6)
	if err := b.client.ScriptLoad(ctx, batchScript.src).Err(); err != nil {
		t.Fatal(err)
	}
	b.rec.reset()
	r.AcquireAll(ctx, as)
	if got := b.rec.take(); len(got) != 1 || got[0] != "evalsha" {
		t.Errorf("sent %v; want one evalsha", got)
	}
	for i, a := range as {
		wantG, wantR := int64(1), int64(4-i)
		if i == 5 {
			wantG, wantR = 0, 0
		}
		if a.Err != nil || a.Grant.Granted != wantG || a.Grant.Remaining != wantR {
			t.Errorf("call %d: %+v, %v; want %d granted, %d left", i, a.Grant, a.Err, wantG, wantR)
		}
		if i == 5 && a.Grant.RetryAfter <= 0 {
			t.Errorf("call %d denied without a RetryAfter: %+v", i, a.Grant)
		}
	}
	if v := b.value(t, key); !strings.HasPrefix(v, "0 ") || !strings.HasSuffix(v, " -") {
		t.Errorf("bucket %q; want \"0 <f> <t> -\"", v)
	}
	if b.exact() {
		// One SET of the bucket and one of the batch key: miniredis counts
		// no commands, so the bucket's TTL is the check: the last grant's.
		if ttl := b.pttl(t, key); ttl != 5*time.Hour+time.Second {
			t.Errorf("TTL %v; want 5h1s", ttl)
		}
	}
}

func TestBatchRepeatedKey(t *testing.T) { forEachBackend(t, suiteBatchRepeatedKey) }

// repeated returns n exact calls of one token on key under l.
func repeated(key string, l policy.Limit, n int) []*Acquisition {
	as := make([]*Acquisition, n)
	for i := range as {
		as[i] = &Acquisition{Key: key, Limit: l, Want: 1, Min: 1, Share: 1}
	}
	return as
}

// TestBatchWritesOnce counts the writes on a real server: a key that
// appears six times in a batch is SET once.
func TestBatchWritesOnce(t *testing.T) {
	forEachBackend(t, func(t *testing.T, nb backendFactory) {
		b := nb(t)
		if b.exact() {
			t.Skip("miniredis keeps no command statistics")
		}
		ctx := context.Background()
		r := b.newAuthority(t, testPrefix)
		l := policy.Limit{Name: "rep", Rate: 1, Period: time.Hour, Burst: 5}
		key := r.Key(l, "k")
		as := repeated(key, l, 6)
		r.AcquireAll(ctx, as)              // loads the script
		b.setTime(t, t0.Add(10*time.Hour)) // full again
		if err := b.client.ConfigResetStat(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		r.AcquireAll(ctx, as)
		stats := b.client.Info(ctx, "commandstats").Val()
		for _, want := range []string{"cmdstat_set:calls=2,", "cmdstat_get:calls=2,"} {
			if !strings.Contains(stats, want) {
				t.Errorf("commandstats lack %q (one bucket, one batch key):\n%s", want, stats)
			}
		}

		// Two keys in turn, three calls each: put together (see grouped),
		// each bucket is still read and written once.
		other := r.Key(l, "other")
		var mixed []*Acquisition
		for i := range 6 {
			k := key
			if i%2 == 1 {
				k = other
			}
			mixed = append(mixed, &Acquisition{Key: k, Limit: l, Want: 1, Min: 1, Share: 1})
		}
		b.setTime(t, t0.Add(20*time.Hour))
		if err := b.client.ConfigResetStat(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		r.AcquireAll(ctx, mixed)
		for i, a := range mixed {
			if a.Err != nil || a.Grant.Granted != 1 || a.Grant.Remaining != int64(4-i/2) {
				t.Errorf("mixed call %d: %+v, %v; want 1 granted, %d left", i, a.Grant, a.Err, 4-i/2)
			}
		}
		stats = b.client.Info(ctx, "commandstats").Val()
		for _, want := range []string{"cmdstat_set:calls=3,", "cmdstat_get:calls=3,"} {
			if !strings.Contains(stats, want) {
				t.Errorf("commandstats lack %q (two buckets, one batch key):\n%s", want, stats)
			}
		}
	})
}

// TestBatchMissingKeyOneCommand counts the commands on a real server: a
// lone call of cost 1 on a missing bucket is decided and written in one
// (SET NX GET); once a batch finds more buckets present than missing, it
// reads them with GET, which costs a present bucket less.
func TestBatchMissingKeyOneCommand(t *testing.T) {
	_, c, r := startReal(t)
	ctx := context.Background()
	// A bucket lives until it is full again: an hour, whatever the
	// machine's pace between the two steps.
	l := policy.Limit{Name: "one", Rate: 1, Period: time.Hour, Burst: 10}
	as := make([]*Acquisition, 8)
	for i := range as {
		as[i] = &Acquisition{Key: r.Key(l, fmt.Sprint("user", i)), Limit: l, Want: 1, Min: 1, Share: 1}
	}
	r.AcquireAll(ctx, []*Acquisition{{Key: r.Key(l, "load"), Limit: l, Want: 1, Min: 1, Share: 1}}) // loads the script
	for _, step := range []struct {
		name     string
		set, get int
		left     int64
	}{
		// eight SET NX GET that write, the batch key's GET and SET
		{"missing", 9, 1, 9},
		// the first SET NX GET finds its bucket; then seven GET, and
		// eight SET of the buckets, the batch key's GET and SET
		{"present", 10, 8, 8},
	} {
		if err := c.ConfigResetStat(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		r.AcquireAll(ctx, as)
		for i, a := range as {
			if a.Err != nil || a.Grant.Granted != 1 || a.Grant.Remaining != step.left {
				t.Errorf("%s: call %d: %+v, %v; want 1 granted, %d left", step.name, i, a.Grant, a.Err, step.left)
			}
		}
		stats := c.Info(ctx, "commandstats").Val()
		for _, want := range []string{fmt.Sprintf("cmdstat_set:calls=%d,", step.set), fmt.Sprintf("cmdstat_get:calls=%d,", step.get)} {
			if !strings.Contains(stats, want) {
				t.Errorf("%s: commandstats lack %q:\n%s", step.name, want, stats)
			}
		}
	}
}

// TestGrouped: grouped puts the calls on each key together, keys in the
// order of their first calls and each key's calls in their order, and
// leaves a batch whose keys never come back as it is.
func TestGrouped(t *testing.T) {
	calls := func(keys string) []*Acquisition {
		as := make([]*Acquisition, len(keys))
		for i, k := range keys {
			as[i] = &Acquisition{Key: string(k), Want: int64(i + 1)}
		}
		return as
	}
	describe := func(as []*Acquisition) string {
		var s strings.Builder
		for _, a := range as {
			fmt.Fprintf(&s, "%s%d ", a.Key, a.Want)
		}
		return s.String()
	}
	for _, tc := range []struct{ keys, want string }{
		{"", ""},
		{"a", "a1 "},
		{"aba", "a1 a3 b2 "},
		{"abacba", "a1 a3 a6 b2 b5 c4 "},
		{"aabbcc", "a1 a2 b3 b4 c5 c6 "},
		{"abcdefg", "a1 b2 c3 d4 e5 f6 g7 "},
		{"aaaa", "a1 a2 a3 a4 "},
		{"aaabb", "a1 a2 a3 b4 b5 "},
		{"aaaba", "a1 a2 a3 a5 b4 "},
	} {
		in := calls(tc.keys)
		got := grouped(in)
		if describe(got) != tc.want {
			t.Errorf("grouped(%q) = %s; want %s", tc.keys, describe(got), tc.want)
		}
		if apart := tc.keys == "aba" || tc.keys == "abacba" || tc.keys == "aaaba"; len(in) > 0 && !apart && &got[0] != &in[0] {
			t.Errorf("grouped(%q) copied calls whose keys never come back", tc.keys)
		}
	}
}

// suiteBatchKeyComesBack sends the script a batch whose first key comes
// back after another (batchOf, not grouped): the second run of calls on it
// is decided on what the first left, not on the bucket as the batch found
// it. Burst 5: a takes 3, b 2, then a's 3 more are denied (2 left).
func suiteBatchKeyComesBack(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.Limit{Name: "back", Rate: 1, Period: time.Hour, Burst: 5}
	a, o := r.Key(l, "a"), r.Key(l, "b")
	as := []*Acquisition{{Key: a, Limit: l, Want: 3, Min: 3, Share: 1}, {Key: o, Limit: l, Want: 2, Min: 2, Share: 1},
		{Key: a, Limit: l, Want: 3, Min: 3, Share: 1}}
	for _, c := range as {
		if !r.check(c) {
			t.Fatal(c.Err)
		}
	}
	bt := r.batchOf(as, true)
	reply, err := b.client.Eval(ctx, batchScript.src, bt.keys, bt.args...).Text()
	if err != nil {
		t.Fatal(err)
	}
	if err := decodeBatch(reply, bt.calls, bt.oneBucket); err != nil {
		t.Fatal(err)
	}
	for i, want := range []struct{ granted, left int64 }{{3, 2}, {2, 3}, {0, 2}} {
		if g := as[i].Grant; as[i].Err != nil || g.Granted != want.granted || g.Remaining != want.left {
			t.Errorf("call %d: %+v, %v; want %d granted, %d left", i, g, as[i].Err, want.granted, want.left)
		}
	}
	if v := b.value(t, a); !strings.HasPrefix(v, "2 ") {
		t.Errorf("bucket a %q; want 2 tokens left", v)
	}
}

func TestBatchKeyComesBack(t *testing.T) { forEachBackend(t, suiteBatchKeyComesBack) }

// TestBatchForeignKeyFailsAlone: a bucket key that holds another type
// fails the calls on it, not the others of its invocation.
func TestBatchForeignKeyFailsAlone(t *testing.T) {
	forEachBackend(t, func(t *testing.T, nb backendFactory) {
		b := nb(t)
		ctx := context.Background()
		r := b.newAuthority(t, testPrefix)
		l := policy.PerSecond(10)
		foreign := r.Key(l, "foreign")
		if err := b.client.LPush(ctx, foreign, "x").Err(); err != nil {
			t.Fatal(err)
		}
		mixed := []*Acquisition{
			{Key: r.Key(l, "a"), Limit: l, Want: 1, Min: 1, Share: 1},
			{Key: foreign, Limit: l, Want: 1, Min: 1, Share: 1},
			{Key: r.Key(l, "b"), Limit: l, Want: 2, Min: 1, Share: 0.5},
			{Key: foreign, Limit: l, Want: 1, Min: 1, Share: 1},
		}
		// Exact calls on one limit: the script's two values per call.
		exactOnly := []*Acquisition{
			{Key: r.Key(l, "c"), Limit: l, Want: 1, Min: 1, Share: 1},
			{Key: foreign, Limit: l, Want: 1, Min: 1, Share: 1},
			{Key: r.Key(l, "c"), Limit: l, Want: 3, Min: 3, Share: 1},
		}
		for _, as := range [][]*Acquisition{mixed, exactOnly} {
			r.AcquireAll(ctx, as)
			for i, a := range as {
				if i%2 == 1 {
					if a.Err == nil || !strings.Contains(a.Err.Error(), "WRONGTYPE") || !strings.Contains(a.Err.Error(), refusedMark) {
						t.Errorf("call %d on a list: %v; want WRONGTYPE, refused in the script", i, a.Err)
					}
					continue
				}
				if a.Err != nil || a.Grant.Granted != a.Want {
					t.Errorf("call %d: %+v, %v; want %d granted", i, a.Grant, a.Err, a.Want)
				}
			}
		}
	})
}

// TestBatchRefusedWriteTakesNothing: on a Redis that refuses every write
// (maxmemory reached, noeviction), a call fails and nothing is written,
// whether its bucket is missing (the lone call's SET NX GET is refused,
// and the key read again with GET) or present, alone or among others.
func TestBatchRefusedWriteTakesNothing(t *testing.T) {
	srv, _, r := startReal(t)
	ctx := context.Background()
	l := policy.PerSecond(10)
	present := r.Key(l, "present")
	seed := []*Acquisition{{Key: present, Limit: l, Want: 1, Min: 1, Share: 1}}
	if r.AcquireAll(ctx, seed); seed[0].Err != nil || seed[0].Grant.Granted != 1 {
		t.Fatalf("seed: %+v, %v", seed[0].Grant, seed[0].Err)
	}
	before := srv.Do(t, "GET", present)
	srv.Do(t, "CONFIG", "SET", "maxmemory-policy", "noeviction")
	srv.Do(t, "CONFIG", "SET", "maxmemory", "1")
	t.Cleanup(func() { srv.Do(t, "CONFIG", "SET", "maxmemory", "0") })

	missing := r.Key(l, "missing")
	batches := map[string][]*Acquisition{
		"lone missing":     {{Key: missing, Limit: l, Want: 1, Min: 1, Share: 1}},
		"lone present":     {{Key: present, Limit: l, Want: 1, Min: 1, Share: 1}},
		"missing, present": {{Key: missing, Limit: l, Want: 1, Min: 1, Share: 1}, {Key: present, Limit: l, Want: 1, Min: 1, Share: 1}},
		"with a share":     {{Key: missing, Limit: l, Want: 1, Min: 1, Share: 1}, {Key: r.Key(l, "other"), Limit: l, Want: 2, Min: 1, Share: 0.5}},
	}
	for name, as := range batches {
		// Keyed, as AcquireAll sends it, and without a batch key (the form
		// for a Cluster slot in migration), whose failure no refused write
		// of the batch key would hide.
		for _, keyed := range []bool{true, false} {
			for _, a := range as {
				a.Err, a.Grant = nil, Grant{}
			}
			if keyed {
				r.AcquireAll(ctx, as)
			} else {
				for _, a := range as {
					if !r.check(a) {
						t.Fatal(a.Err)
					}
				}
				bt := r.batchOf(grouped(as), false)
				r.runAll(ctx, batchScript, []*invocation{&bt.invocation})
				bt.decode()
			}
			// The refusal is the buckets' SET's, as it was before SET NX
			// GET: a refused one reads again with GET.
			for i, a := range as {
				if a.Err == nil || !strings.Contains(a.Err.Error(), "OOM") || !strings.Contains(a.Err.Error(), refusedMark+"SET") || a.Grant.Granted != 0 {
					t.Errorf("%s, keyed %v: call %d: %+v, %v; want an OOM error of a refused SET and nothing granted", name, keyed, i, a.Grant, a.Err)
				}
			}
		}
	}
	if n := srv.Do(t, "EXISTS", missing, r.Key(l, "other")); n != int64(0) {
		t.Errorf("%d of the missing buckets written under OOM", n)
	}
	if after := srv.Do(t, "GET", present); after != before {
		t.Errorf("present bucket %q became %q under OOM", before, after)
	}
}

// TestLoneClaimRefusedLeavesNothing: a lone call whose claim of its batch
// key Redis refuses (here the key holds a list, as a key of another
// program might: WRONGTYPE) fails with the refusal and leaves nothing
// behind: the bucket it found missing and wrote (SET NX GET) is deleted
// again, its claim coming after that write (see batch.lua's lone); a
// present bucket is not written at all.
func TestLoneClaimRefusedLeavesNothing(t *testing.T) {
	srv, _, r := startReal(t)
	ctx := context.Background()
	l := policy.PerSecond(10).WithName("claim")
	present := r.Key(l, "present")
	srv.Do(t, "SET", present, "5 0 1 -")
	for _, key := range []string{r.Key(l, "missing"), present} {
		before := srv.Do(t, "GET", key)
		a := &Acquisition{Key: key, Limit: l, Want: 1, Min: 1, Share: 1}
		if !r.check(a) {
			t.Fatal(a.Err)
		}
		bt := r.newBatch([]*Acquisition{a})
		srv.Do(t, "RPUSH", bt.keys[0], "another program's")
		r.runAll(ctx, batchScript, []*invocation{&bt.invocation})
		bt.decode()
		if a.Err == nil || !strings.Contains(a.Err.Error(), "WRONGTYPE") || !strings.Contains(a.Err.Error(), refusedMark+"SET") || a.Grant.Granted != 0 {
			t.Errorf("%s: %+v, %v; want the batch key's refused SET and nothing granted", key, a.Grant, a.Err)
		}
		if after := srv.Do(t, "GET", key); after != before {
			t.Errorf("%s: bucket %v became %v", key, before, after)
		}
	}
}

// TestBucketWriteRefusedAfterClaim: under an ACL selector that lets SET
// reach batch keys and not buckets, a call alone whose claim of its resend
// key passed and whose bucket's write was then refused fails with the
// refusal and takes the claim back: no resend key is left to hand a later
// Resend a grant that was never written. Each form of a call alone: the
// batch script's token bucket (a present bucket and a missing one) and
// quota (its general path), and a multi-limit call.
func TestBucketWriteRefusedAfterClaim(t *testing.T) {
	srv, _, owner := startReal(t)
	ctx := context.Background()
	tb := policy.Limit{Name: "split", Rate: 1, Period: time.Hour, Burst: 3}
	quota := policy.Quota("split-q", 3, policy.Day, time.UTC)
	present := owner.Key(tb, "present")
	seed := []*Acquisition{{Key: present, Limit: tb, Want: 1, Min: 1, Share: 1}}
	if owner.AcquireAll(ctx, seed); seed[0].Err != nil {
		t.Fatal(seed[0].Err)
	}
	seedClaim, _ := seed[0].Invocation()
	srv.Do(t, "DEL", seedClaim) // the seed's own, granted
	srv.Do(t, "ACL", "SETUSER", "split", "on", ">pw", "+@all", "-set", "~*", "(+set ~"+testPrefix+":batch:*)")
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: "split", Password: "pw"})
	t.Cleanup(func() { _ = c.Close() })
	r, err := New(c, testPrefix)
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]*Acquisition{
		"token bucket, present": {Key: present, Limit: tb, Want: 1, Min: 1, Share: 1},
		"token bucket, missing": {Key: r.Key(tb, "missing"), Limit: tb, Want: 1, Min: 1, Share: 1},
		"quota":                 {Key: r.Key(quota, "q"), Limit: quota, Want: 1, Min: 1, Share: 1},
		"multi-limit": {Key: r.Key(tb, "multi"), Limit: tb, Want: 1, Min: 1, Share: 1,
			With: []Member{{Key: r.Key(quota, "multi"), Limit: quota}}},
	}
	for name, a := range calls {
		before := srv.Do(t, "GET", a.Key)
		r.AcquireAll(ctx, []*Acquisition{a})
		if a.Err == nil || !strings.Contains(a.Err.Error(), "SET") || a.Grant.Granted != 0 {
			t.Errorf("%s: %+v, %v; want the bucket's refused SET and nothing granted", name, a.Grant, a.Err)
		}
		if after := srv.Do(t, "GET", a.Key); after != before {
			t.Errorf("%s: bucket %v became %v", name, before, after)
		}
	}
	if keys := srv.Do(t, "KEYS", testPrefix+":batch:*"); len(keys.([]any)) != 0 {
		t.Errorf("claims left behind: %v", keys)
	}
}
