package authority

import (
	"context"
	"errors"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// suiteAcquireAll: a batch decides each call as the same calls made one by
// one would, each with its own outcome: a call with bad arguments fails
// alone before anything is sent, a call on another program's key fails
// alone in Redis, and calls the server answers NOSCRIPT (after SCRIPT
// FLUSH) are sent again by EVAL. 150 calls span several invocations of the
// batch script.
func suiteAcquireAll(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.PerSecond(10) // burst 10
	k := func(i int) string { return r.Key(l, "batch-"+strconv.Itoa(i)) }
	foreign := r.Key(l, "foreign")
	if err := b.client.LPush(ctx, foreign, "x").Err(); err != nil {
		t.Fatal(err)
	}
	const n = 150
	var batch []*Acquisition
	for i := range n {
		batch = append(batch, &Acquisition{Key: k(i), Limit: l, Want: int64(1 + i%10), Min: int64(1 + i%10), Share: 1})
	}
	batch[7].Want = 11 // above the burst: our bug, not sent
	batch[100].Key = foreign
	b.flushScripts(t)
	r.AcquireAll(ctx, batch)
	for i, a := range batch {
		switch i {
		case 7:
			if !errors.Is(a.Err, ErrScript) {
				t.Errorf("call %d above the burst: err %v; want ErrScript", i, a.Err)
			}
		case 100:
			if a.Err == nil || !strings.Contains(a.Err.Error(), "WRONGTYPE") {
				t.Errorf("call %d on a list: err %v; want WRONGTYPE", i, a.Err)
			}
		default:
			want := int64(1 + i%10)
			if a.Err != nil || a.Grant.Granted != want || a.Grant.Remaining != l.Burst-want {
				t.Errorf("call %d: %+v, %v; want %d granted, %d left", i, a.Grant, a.Err, want, l.Burst-want)
			}
		}
	}
	// The same calls again: every bucket but the ones above holds 10-want;
	// those that asked for 6 or more are denied, with a RetryAfter.
	again := make([]*Acquisition, 0, n)
	for i := range n {
		if i != 7 && i != 100 {
			again = append(again, &Acquisition{Key: k(i), Limit: l, Want: int64(1 + i%10), Min: int64(1 + i%10), Share: 1})
		}
	}
	r.AcquireAll(ctx, again)
	for _, a := range again {
		w := a.Want
		switch {
		case a.Err != nil:
			t.Errorf("%s again: %v", a.Key, a.Err)
		case 2*w <= l.Burst && a.Grant.Granted != w:
			t.Errorf("%s again for %d: %+v; want granted", a.Key, w, a.Grant)
		case 2*w > l.Burst && (a.Grant.Granted != 0 || a.Grant.RetryAfter <= 0):
			t.Errorf("%s again for %d: %+v; want denied with a RetryAfter", a.Key, w, a.Grant)
		}
	}
}

func TestAcquireAll(t *testing.T) { forEachBackend(t, suiteAcquireAll) }

// TestBatchOfOneCall: a batch of one call (a lone caller's, most of the
// long tail's) is built in one allocation besides its resend key's name
// (and, for a call that is not exact, the numbers its arguments box), with
// its arguments and keys as any batch's; one of two calls in three (the
// batch, its arguments, its keys) besides that name.
func TestBatchOfOneCall(t *testing.T) {
	r := &Redis{prefix: "pfx", idBase: "0a1b-", life: batchLifeArg}
	for _, tc := range []struct {
		name         string
		limit        policy.Limit
		want, min    int64
		args, allocs int
	}{
		{"exact", policy.PerSecond(10), 1, 1, 2 + 3 + 1, 2},
		{"a range", policy.PerSecond(10), 5, 2, 2 + 3 + 3, 4},                       // -want and share_ppm boxed
		{"a quota", policy.Quota("q", 5, policy.Day, time.UTC), 2, 1, 2 + 3 + 4, 8}, // and its window's spec
	} {
		a := &Acquisition{Key: "pfx:n:{0123abcd}", Limit: tc.limit, Want: tc.want, Min: tc.min, Share: 0.5}
		if !r.check(a) {
			t.Fatalf("%s: %v", tc.name, a.Err)
		}
		calls := []*Acquisition{a}
		b := r.batchOf(calls, true)
		if len(b.args) != tc.args || len(b.keys) != 2 || b.keys[1] != a.Key || !strings.HasPrefix(b.keys[0], "pfx:batch:{0123abcd}:") {
			t.Errorf("%s: args %v, keys %q", tc.name, b.args, b.keys)
		}
		if n := testing.AllocsPerRun(100, func() { r.batchOf(calls, true) }); n != float64(tc.allocs) {
			t.Errorf("%s: %v allocations per batch of one call, want %d", tc.name, n, tc.allocs)
		}
	}
	two := []*Acquisition{{Key: "pfx:n:{1}", Limit: policy.PerSecond(10), Want: 1, Min: 1, Share: 1}, {Key: "pfx:n:{1}", Limit: policy.PerSecond(10), Want: 1, Min: 1, Share: 1}}
	for _, a := range two {
		r.check(a)
	}
	if n := testing.AllocsPerRun(100, func() { r.batchOf(two, true) }); n != 4 {
		t.Errorf("%v allocations per batch of two calls, want 4", n)
	}
}

// catchArgs is a go-redis hook that keeps a command's arguments instead
// of sending it.
type catchArgs struct{ args *[]any }

func (catchArgs) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h catchArgs) ProcessHook(redis.ProcessHook) redis.ProcessHook {
	return func(_ context.Context, cmd redis.Cmder) error { *h.args = cmd.Args(); return nil }
}
func (catchArgs) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestCommandLine: an invocation's command is what go-redis's EvalSha (or
// Eval) builds: the script's hash (or source), the key count, the keys,
// the arguments (a Cluster routes it by its first key: cluster_test.go);
// a batch of one call lays it out in its own
// room, so that it costs go-redis's command and the keys' boxes alone.
// An invocation whose arguments no longer sit in that room (replaced, as
// a resend that keeps a denial does) gets a line of its own.
func TestCommandLine(t *testing.T) {
	r := &Redis{prefix: "pfx", idBase: "0a1b-", life: batchLifeArg}
	a := &Acquisition{Key: "pfx:n:{0123abcd}", Limit: policy.PerSecond(10), Want: 1, Min: 1, Share: 1}
	if !r.check(a) {
		t.Fatal(a.Err)
	}
	b := r.batchOf([]*Acquisition{a}, true)
	// What go-redis's own EvalSha and Eval build, caught by a hook that
	// sends nothing.
	var caught []any
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer client.Close()
	client.AddHook(catchArgs{&caught})
	ctx := context.Background()
	want := func(in *invocation, name string, body any) []any {
		if name == "eval" {
			client.Eval(ctx, body.(string), in.keys, in.args...)
		} else {
			client.EvalSha(ctx, body.(string), in.keys, in.args...)
		}
		return caught
	}
	calls := []*Acquisition{a}
	// The first command in the batch's room: the batch (2 allocations, see
	// TestBatchOfOneCall), then go-redis's command and the two keys' boxes.
	if n := testing.AllocsPerRun(100, func() { r.batchOf(calls, true).command(ctx, "evalsha", batchScript.shaArg) }); n != 2+3 {
		t.Errorf("a batch of one call and its command: %v allocations, want 5", n)
	}
	first := b.command(ctx, "evalsha", batchScript.shaArg)
	firstArgs := slices.Clone(first.Args())
	if w := want(&b.invocation, "evalsha", batchScript.sha); !reflect.DeepEqual(firstArgs, w) {
		t.Errorf("command %v; want %v", firstArgs, w)
	}
	// Sent again (EVAL after NOSCRIPT, a resend): a line of its own, the
	// first command's arguments left as they were (a hook may keep it).
	for _, s := range []struct {
		name string
		body any
	}{{"evalsha", batchScript.sha}, {"eval", batchScript.src}} {
		cmd := b.command(ctx, s.name, s.body)
		if got, w := cmd.Args(), want(&b.invocation, s.name, s.body); !reflect.DeepEqual(got, w) {
			t.Errorf("sent again: command %v; want %v", got, w)
		}
	}
	if !reflect.DeepEqual(first.Args(), firstArgs) {
		t.Errorf("the first command's arguments changed to %v when it was sent again", first.Args())
	}
	if n := testing.AllocsPerRun(100, func() { b.command(ctx, "evalsha", batchScript.shaArg) }); n != 4 {
		t.Errorf("sent again: %v allocations, want 4 (a line of its own)", n)
	}
	// Arguments replaced (as a resend that keeps a denial does) before
	// the first command: a line of its own too.
	b = r.batchOf(calls, true)
	b.args = append([]any{int64(-1)}, b.args[1:]...)
	cmd := b.command(ctx, "evalsha", batchScript.shaArg)
	if got, w := cmd.Args(), want(&b.invocation, "evalsha", batchScript.sha); !reflect.DeepEqual(got, w) {
		t.Errorf("with its arguments replaced: command %v; want %v", got, w)
	}
}
