package authority

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// suiteBatchResend: the same batch invocation sent twice (as go-redis does
// when a connection breaks after the write) takes its tokens once and
// returns the same reply, stamp included; a fresh batch id takes again. The
// batch key lives batchLife at most; a batch of denials stores none.
func suiteBatchResend(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.Limit{Name: "idem", Rate: 1, Period: time.Hour, Burst: 10}
	key, other := r.Key(l, "k"), r.Key(l, "other")
	calls := func(want ...int64) []*Acquisition {
		t.Helper()
		var as []*Acquisition
		for i, w := range want {
			k := key
			if i%2 == 1 {
				k = other
			}
			a := &Acquisition{Key: k, Limit: l, Want: w, Min: w, Share: 1}
			if !r.check(a) {
				t.Fatal(a.Err)
			}
			as = append(as, a)
		}
		return as
	}
	send := func(bt *batch) string {
		t.Helper()
		v, err := b.client.EvalSha(ctx, batchScript.sha, bt.keys, bt.args...).Result()
		if isNoScript(err) {
			v, err = b.client.Eval(ctx, batchScript.src, bt.keys, bt.args...).Result()
		}
		if err != nil {
			t.Fatal(err)
		}
		return v.(string)
	}

	// Two keys, the first one's calls apart: the batch puts them together
	// (see grouped), and each call still gets its own outcome.
	as := calls(4, 3, 2)
	bt := r.newBatch(as)
	first := send(bt)
	state := b.value(t, key) + "|" + b.value(t, other)
	again := send(bt)
	if again != first {
		t.Fatalf("resent invocation replied %q; the first %q", again, first)
	}
	if got := b.value(t, key) + "|" + b.value(t, other); got != state {
		t.Fatalf("resent invocation changed the buckets from %s to %s", state, got)
	}
	g1, g2 := make([]Grant, 3), make([]Grant, 3)
	for i, reply := range []string{first, again} {
		if err := decodeBatch(reply, bt.calls, bt.oneBucket); err != nil {
			t.Fatal(err)
		}
		for j, a := range as {
			[][]Grant{g1, g2}[i][j] = a.Grant
		}
	}
	for j := range g1 {
		if g1[j] != g2[j] || g1[j].At == 0 {
			t.Errorf("call %d: first %+v, resent %+v; want the same, stamped", j, g1[j], g2[j])
		}
	}
	if g1[0].Granted != 4 || g1[0].Remaining != 6 || g1[1].Remaining != 7 || g1[2].Remaining != 4 {
		t.Errorf("grants %+v; want 4 (6 left), 3 (7 left), 2 (4 left)", g1)
	}
	batchKey := bt.keys[0]
	if !strings.HasPrefix(batchKey, testPrefix+":batch:{"+hashTag(key)+"}:") {
		t.Errorf("batch key %s; want it in the first key's slot", batchKey)
	}
	if ttl := b.pttl(t, batchKey); ttl <= 0 || ttl > batchLife {
		t.Errorf("batch key TTL %v; want (0, %v]", ttl, batchLife)
	}

	// decided sends bt and decodes its one call's grant.
	decided := func(bt *batch) (string, Grant) {
		t.Helper()
		reply := send(bt)
		if err := decodeBatch(reply, bt.calls, bt.oneBucket); err != nil {
			t.Fatal(err)
		}
		return reply, bt.calls[0].Grant
	}
	// A fresh batch id takes again.
	if reply, g := decided(r.newBatch(calls(4))); g.Granted != 4 || g.Remaining != 0 {
		t.Errorf("a fresh batch = %q (%+v); want 4 granted, 0 left", reply, g)
	}
	// A lone call, which claims its batch key at its end (batch.lua's
	// lone): sent again, it returns the first reply and takes nothing,
	// on a bucket it found present and on one it found missing (written
	// by SET NX GET). Should that bucket be gone by the resend (expired,
	// full again), the resend finds it missing too, writes it, and must
	// delete it again: missing, as before.
	loneBatchOf := func(k string, l policy.Limit, want int64) *batch {
		t.Helper()
		a := &Acquisition{Key: k, Limit: l, Want: want, Min: want, Share: 1}
		if !r.check(a) {
			t.Fatal(a.Err)
		}
		return r.newBatch([]*Acquisition{a})
	}
	loneBatch := func(k string, want int64) *batch { return loneBatchOf(k, l, want) }
	for _, user := range []string{"lone-present", "lone-missing", "lone-expired"} {
		k := r.Key(l, user)
		if user == "lone-present" {
			if _, g := decided(loneBatch(k, 2)); g.Granted != 2 {
				t.Fatalf("%s: the first grant %+v; want 2", user, g)
			}
		}
		lone := loneBatch(k, 1)
		first, g := decided(lone)
		if g.Granted != 1 {
			t.Fatalf("%s: %q (%+v); want 1 granted", user, first, g)
		}
		state := b.value(t, k)
		if user == "lone-expired" {
			if err := b.client.Del(ctx, k).Err(); err != nil {
				t.Fatal(err)
			}
			state = ""
		}
		if again := send(lone); again != first {
			t.Errorf("%s: resent lone call replied %q; the first %q", user, again, first)
		}
		if got := b.value(t, k); got != state {
			t.Errorf("%s: resent lone call left its bucket %q; want %q", user, got, state)
		}
		if ttl := b.pttl(t, lone.keys[0]); ttl <= 0 || ttl > batchLife {
			t.Errorf("%s: batch key TTL %v; want (0, %v]", user, ttl, batchLife)
		}
	}
	// A lone call on a calendar quota (the script's general path) claims
	// its batch key the same way.
	quota := policy.Quota("idem-q", 10, policy.Day, time.UTC)
	for _, user := range []string{"quota-missing", "quota-present"} {
		qa := &Acquisition{Key: r.Key(quota, user), Limit: quota, Want: 2, Min: 2, Share: 1}
		if !r.check(qa) {
			t.Fatal(qa.Err)
		}
		qb := r.newBatch([]*Acquisition{qa})
		first, g := decided(qb)
		if g.Granted != 2 {
			t.Fatalf("%s: %q (%+v); want 2 granted", user, first, g)
		}
		state := b.value(t, qa.Key)
		if again := send(qb); again != first {
			t.Errorf("%s: resent lone call replied %q; the first %q", user, again, first)
		}
		if got := b.value(t, qa.Key); got != state {
			t.Errorf("%s: resent lone call left its bucket %q; want %q", user, got, state)
		}
		if user == "quota-missing" { // the next user's bucket is present
			if _, g := decided(loneBatchOf(r.Key(quota, "quota-present"), quota, 1)); g.Granted != 1 {
				t.Fatalf("quota-present: the first grant %+v; want 1", g)
			}
		}
	}
	// Denials only: nothing stored, so a resend decides again.
	keysBefore := b.allKeys(t)
	if reply, g := decided(r.newBatch(calls(1))); g.Granted != 0 || g.Remaining != 0 || g.RetryAfter <= 0 {
		t.Errorf("over the limit = %q (%+v); want a denial with none left and a wait", reply, g)
	}
	if got := b.allKeys(t); strings.Join(got, ",") != strings.Join(keysBefore, ",") {
		t.Errorf("a batch of denials wrote keys: %v, before %v", got, keysBefore)
	}
}

func TestBatchResend(t *testing.T) { forEachBackend(t, suiteBatchResend) }

// suiteBatchUnkeyed: a batch without a batch key (the form sent for a
// Cluster slot in migration; see acquireMoving) decides as the usual form
// does, and writes nothing but its buckets; having no stored reply, a
// resent one takes again.
func suiteBatchUnkeyed(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	tb := policy.Limit{Name: "unkeyed", Rate: 1, Period: time.Hour, Burst: 10}
	quota := policy.Quota("unkeyed-q", 10, policy.Day, time.UTC)
	run := func(keyed bool, user string) []Grant {
		t.Helper()
		var as []*Acquisition
		for i, l := range []policy.Limit{tb, tb, quota, tb} {
			a := &Acquisition{Key: r.Key(l, user), Limit: l, Want: int64(4 + i), Min: 2, Share: 0.5}
			if i%2 == 0 {
				a.Min = a.Want
			}
			if !r.check(a) {
				t.Fatal(a.Err)
			}
			as = append(as, a)
		}
		bt := r.batchOf(grouped(as), keyed)
		r.runAll(ctx, batchScript, []*invocation{&bt.invocation})
		bt.decode()
		gs := make([]Grant, len(as))
		for i, a := range as {
			if a.Err != nil {
				t.Fatalf("keyed=%v call %d: %v", keyed, i, a.Err)
			}
			gs[i] = a.Grant
		}
		return gs
	}
	keyed, unkeyed := run(true, "a"), run(false, "b")
	for i := range keyed {
		k, u := keyed[i], unkeyed[i]
		k.At, u.At = 0, 0 // two script runs, two readings of the clock
		if k.Granted != u.Granted || k.Remaining != u.Remaining {
			t.Errorf("call %d: unkeyed %+v, keyed %+v; want the same grant", i, unkeyed[i], keyed[i])
		}
	}
	if unkeyed[0].Granted != 4 || unkeyed[1].Granted != 3 || unkeyed[2].Granted != 6 {
		t.Errorf("unkeyed grants %+v; want 4, 3 and 6", unkeyed)
	}
	for _, k := range b.allKeys(t) {
		if strings.Contains(k, ":batch:{"+hashTag(r.Key(tb, "b"))) {
			t.Errorf("an unkeyed batch wrote %s", k)
		}
	}
	// No stored reply: the same invocation sent again takes again.
	a := &Acquisition{Key: r.Key(tb, "c"), Limit: tb, Want: 6, Min: 6, Share: 1}
	if !r.check(a) {
		t.Fatal(a.Err)
	}
	bt := r.batchOf([]*Acquisition{a}, false)
	for i, want := range []int64{6, 0} {
		r.runAll(ctx, batchScript, []*invocation{&bt.invocation})
		if bt.decode(); a.Err != nil || a.Grant.Granted != want {
			t.Errorf("unkeyed send #%d = %+v, %v; want %d granted", i+1, a.Grant, a.Err, want)
		}
	}
}

func TestBatchUnkeyed(t *testing.T) { forEachBackend(t, suiteBatchUnkeyed) }

// suiteMultiResend: a multi-limit call sent twice (as go-redis does when a
// connection breaks after the write) takes its tokens once and returns the
// same reply, stamp included; a denial stores nothing, and the form without
// a resend key (a Cluster slot in migration) takes again.
func suiteMultiResend(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	perMin := policy.Limit{Name: "m-min", Rate: 1, Period: time.Hour, Burst: 10}
	daily := policy.Quota("m-day", 7, policy.Day, time.UTC)
	call := func(user string, want int64) *Acquisition {
		t.Helper()
		a := &Acquisition{Key: r.Key(perMin, user), Limit: perMin, Want: want, Min: want, Share: 1,
			With: []Member{{Key: r.Key(daily, user), Limit: daily}}}
		if !r.prepare(a) {
			t.Fatal(a.Err)
		}
		return a
	}
	send := func(in *invocation) Grant {
		t.Helper()
		r.runAll(ctx, acquireAllScript, []*invocation{in})
		v, err := in.cmd.Result()
		if err != nil {
			t.Fatal(err)
		}
		g, err := decodeAll(v, 2)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	a := call("u", 4)
	in := r.multiInvocation(a, true)
	first := send(in)
	state := b.value(t, a.Key) + "|" + b.value(t, a.With[0].Key)
	again := send(in)
	if first.Granted != 4 || first.Remaining != 3 || first.At == 0 {
		t.Fatalf("first send = %+v; want 4 granted, 3 left (the quota's), stamped", first)
	}
	if again.Granted != first.Granted || again.Remaining != first.Remaining || again.At != first.At ||
		again.ResetAfter != first.ResetAfter {
		t.Errorf("resent call = %+v; the first %+v: want the same", again, first)
	}
	if got := b.value(t, a.Key) + "|" + b.value(t, a.With[0].Key); got != state {
		t.Errorf("resent call changed the buckets from %s to %s", state, got)
	}
	if ttl := b.pttl(t, in.keys[0]); ttl <= 0 || ttl > batchLife {
		t.Errorf("resend key TTL %v; want (0, %v]", ttl, batchLife)
	}
	// A bucket that became another program's key after the call was
	// decided: a resend still gets the first reply (the call reads its
	// buckets before its resend key), then the bucket is put back.
	qkey := a.With[0].Key
	qval, qttl := b.value(t, qkey), b.pttl(t, qkey)
	if err := b.client.Del(ctx, qkey).Err(); err != nil {
		t.Fatal(err)
	}
	if err := b.client.RPush(ctx, qkey, "another program's").Err(); err != nil {
		t.Fatal(err)
	}
	if g := send(in); g.Granted != first.Granted || g.At != first.At {
		t.Errorf("resent over a foreign bucket = %+v; the first %+v: want the same", g, first)
	}
	if err := b.client.Del(ctx, qkey).Err(); err != nil {
		t.Fatal(err)
	}
	if err := b.client.Set(ctx, qkey, qval, qttl).Err(); err != nil {
		t.Fatal(err)
	}
	// A denial (the quota has 3 left) stores nothing.
	keysBefore := b.allKeys(t)
	if g := send(r.multiInvocation(call("u", 5), true)); g.Granted != 0 || g.Multi.Denied != 1 {
		t.Errorf("over the quota = %+v; want a denial by the quota", g)
	}
	if got := b.allKeys(t); strings.Join(got, ",") != strings.Join(keysBefore, ",") {
		t.Errorf("a denial wrote keys: %v, before %v", got, keysBefore)
	}
	// Without a resend key: nothing stored, and a resend takes again.
	u := r.multiInvocation(call("v", 3), false)
	if len(u.keys) != 2 {
		t.Fatalf("unkeyed invocation keys %v; want the two buckets", u.keys)
	}
	for i, want := range []int64{3, 3, 0} {
		if g := send(u); g.Granted != want {
			t.Errorf("unkeyed send #%d = %+v; want %d granted", i+1, g, want)
		}
	}
	for _, k := range b.allKeys(t) {
		if strings.Contains(k, ":batch:{"+hashTag(r.Key(perMin, "v"))) {
			t.Errorf("an unkeyed call wrote %s", k)
		}
	}
}

func TestMultiResend(t *testing.T) { forEachBackend(t, suiteMultiResend) }

// suiteResendWindow: a batch's reply, and a multi-limit call's, outlives
// the resend window it was given (WithResendWindow) by a second, and lives
// batchLife when the window is shorter. Regression: with a budget of 1.5s
// go-redis resent a batch 5s after its first run, when its reply (kept 5s
// whatever the window) was gone, and it took its tokens twice.
func suiteResendWindow(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	perMin := policy.Limit{Name: "w-min", Rate: 1, Period: time.Hour, Burst: 10}
	daily := policy.Quota("w-day", 7, policy.Day, time.UTC)
	for i, c := range []struct {
		window   time.Duration
		min, max time.Duration // of the resend keys' TTL
	}{
		{0, batchLife - time.Second, batchLife},
		{time.Second, batchLife - time.Second, batchLife},
		{9 * time.Second, 9*time.Second + 1, 10 * time.Second},
	} {
		prefix := testPrefix + strconv.Itoa(i)
		r, err := New(b.client, prefix, WithResendWindow(c.window))
		if err != nil {
			t.Fatal(err)
		}
		single := &Acquisition{Key: r.Key(perMin, "s"), Limit: perMin, Want: 1, Min: 1, Share: 1}
		multi := &Acquisition{Key: r.Key(perMin, "m"), Limit: perMin, Want: 1, Min: 1, Share: 1,
			With: []Member{{Key: r.Key(daily, "m"), Limit: daily}}}
		r.AcquireAll(ctx, []*Acquisition{single, multi})
		for _, a := range []*Acquisition{single, multi} {
			if a.Err != nil || a.Grant.Granted != 1 {
				t.Fatalf("window %v: %+v, %v; want 1 granted", c.window, a.Grant, a.Err)
			}
		}
		seen := 0
		for _, k := range b.allKeys(t) {
			if !strings.HasPrefix(k, prefix+":batch:") {
				continue
			}
			seen++
			if ttl := b.pttl(t, k); ttl < c.min || ttl > c.max {
				t.Errorf("window %v: resend key %s lives %v; want %v to %v", c.window, k, ttl, c.min, c.max)
			}
		}
		if seen != 2 {
			t.Errorf("window %v: %d resend keys; want 2 (the batch's, the multi-limit call's)", c.window, seen)
		}
	}
}

func TestResendWindow(t *testing.T) { forEachBackend(t, suiteResendWindow) }
