package authority

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/leaselimit/leaselimit/policy"
)

// BenchmarkAcquireAll: batches of 1 and of 32 single-limit exact calls on a
// real redis-server, on keys that cycle through 4096 user keys (a limit
// that never denies). allocs/call counts the client's allocations per call.
func BenchmarkAcquireAll(b *testing.B) {
	srv := redistest.Start(b)
	r, err := New(srv.Client(b), testPrefix)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	l := policy.Limit{Name: "bench", Rate: 1e9, Period: time.Second, Burst: 1e9}
	keys := make([]string, 4096)
	for i := range keys {
		keys[i] = r.Key(l, "user-"+strconv.Itoa(i))
	}
	for _, n := range []int{1, 32} {
		b.Run(fmt.Sprint("batch=", n), func(b *testing.B) {
			as := make([]*Acquisition, n)
			for i := range as {
				as[i] = new(Acquisition)
			}
			b.ReportAllocs()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			calls := 0
			for b.Loop() {
				for _, a := range as {
					*a = Acquisition{Key: keys[calls%len(keys)], Limit: l, Want: 1, Min: 1, Share: 1}
					calls++
				}
				r.AcquireAll(ctx, as)
				if as[0].Err != nil {
					b.Fatal(as[0].Err)
				}
			}
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(calls), "allocs/call")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(calls), "ns/call")
		})
	}
}

// TestRedisCPUPerDecision (LEASELIMIT_MEASURE=1) compares the Redis CPU a
// decision costs in the batch script and in the replaced acquire_many
// script: rounds of invocations of 32 exact calls on distinct cold keys,
// the two interleaved, each read from INFO commandstats (evalsha usec /
// calls / 32). It logs the median and range of each.
func TestRedisCPUPerDecision(t *testing.T) {
	if os.Getenv("LEASELIMIT_MEASURE") != "1" {
		t.Skip("a measurement: set LEASELIMIT_MEASURE=1")
	}
	const perCall, invocations, rounds = 32, 2000, 9
	_, c, r := startReal(t)
	ctx := context.Background()
	oldSHA, err := c.ScriptLoad(ctx, refAcquireManySrc).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ScriptLoad(ctx, batchScript.src).Err(); err != nil {
		t.Fatal(err)
	}
	l := policy.PerSecond(100)
	rate, period := spec(l)
	fresh := 0
	key := func() string { fresh++; return r.Key(l, "cold-"+strconv.Itoa(fresh)) }
	usecPerDecision := func() float64 {
		stats := c.Info(ctx, "commandstats").Val()
		var calls, usec float64
		for _, line := range strings.Split(stats, "\r\n") {
			if rest, ok := strings.CutPrefix(line, "cmdstat_evalsha:"); ok {
				_, err := fmt.Sscanf(rest, "calls=%g,usec=%g,", &calls, &usec)
				if err != nil {
					t.Fatal(err)
				}
			}
		}
		return usec / calls / perCall
	}
	var olds, news []float64
	for range rounds {
		// The old script: 7 arguments per call, a request id each.
		c.ConfigResetStat(ctx)
		pipe := c.Pipeline()
		for range invocations {
			keys := make([]string, perCall)
			var args []any
			for i := range keys {
				keys[i] = key()
				args = append(args, rate, period, l.Burst, 1, 1, 1_000_000, r.nextID(""))
			}
			pipe.EvalSha(ctx, oldSHA, keys, args...)
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
		olds = append(olds, usecPerDecision())

		c.ConfigResetStat(ctx)
		pipe = c.Pipeline()
		for range invocations {
			as := make([]*Acquisition, perCall)
			for i := range as {
				as[i] = &Acquisition{Key: key(), Limit: l, Want: 1, Min: 1, Share: 1}
				if !r.check(as[i]) {
					t.Fatal(as[i].Err)
				}
			}
			bt := r.newBatch(as)
			pipe.EvalSha(ctx, batchScript.sha, bt.keys, bt.args...)
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
		news = append(news, usecPerDecision())
	}
	summary := func(v []float64) string {
		slices.Sort(v)
		return fmt.Sprintf("median %.2f µs, range %.2f–%.2f µs (%d rounds)", v[len(v)/2], v[0], v[len(v)-1], len(v))
	}
	t.Logf("Redis CPU per decision, %d calls per invocation, cold keys:", perCall)
	t.Logf("  acquire_many (before): %s", summary(olds))
	t.Logf("  batch (after):         %s", summary(news))
}

// TestRedisCPUExactOnlyForm (LEASELIMIT_MEASURE=1) compares the Redis CPU a
// decision costs in the batch script's two forms for exact calls on one
// limit: the general one (a limit index and a cost per call in, three
// values per call back) and the exact-only one newBatch sends (a cost in,
// two values back). Two goroutines each send one invocation of 20 calls at
// a time, as a lane's two pipelines do, on keys cycling through 10,000
// user keys; rounds alternate the two forms, in turn first, and each is
// read from INFO cpu (the server's user + system CPU, its I/O included).
func TestRedisCPUExactOnlyForm(t *testing.T) {
	if os.Getenv("LEASELIMIT_MEASURE") != "1" {
		t.Skip("a measurement: set LEASELIMIT_MEASURE=1")
	}
	const perCall, invocations, rounds, userKeys = 20, 4000, 11, 10_000
	_, c, r := startReal(t)
	ctx := context.Background()
	if err := c.ScriptLoad(ctx, batchScript.src).Err(); err != nil {
		t.Fatal(err)
	}
	l := policy.PerSecond(100)
	var next atomic.Int64
	key := func() string { return r.Key(l, "k-"+strconv.FormatInt(next.Add(1)%userKeys, 10)) }
	serverCPU := func() float64 {
		var total float64
		for _, line := range strings.Split(c.Info(ctx, "cpu").Val(), "\r\n") {
			for _, name := range []string{"used_cpu_sys:", "used_cpu_user:"} {
				if v, ok := strings.CutPrefix(line, name); ok {
					f, err := strconv.ParseFloat(v, 64)
					if err != nil {
						t.Fatal(err)
					}
					total += f
				}
			}
		}
		return total
	}
	// measure runs the invocations, built by form from a batch of exact
	// calls, and returns the server's µs per decision.
	measure := func(form func(bt *batch) []any) float64 {
		before := serverCPU()
		var wg sync.WaitGroup
		errs := make(chan error, 2)
		for range 2 {
			wg.Go(func() {
				for range invocations / 2 {
					as := make([]*Acquisition, perCall)
					for i := range as {
						as[i] = &Acquisition{Key: key(), Limit: l, Want: 1, Min: 1, Share: 1}
						if !r.check(as[i]) {
							errs <- as[i].Err
							return
						}
					}
					bt := r.newBatch(as)
					if err := c.EvalSha(ctx, batchScript.sha, bt.keys, form(bt)...).Err(); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		return (serverCPU() - before) * 1e6 / (invocations * perCall)
	}
	exactOnly := func(bt *batch) []any {
		if !bt.oneBucket {
			t.Fatal("a batch of exact calls on one limit is not in the exact-only form")
		}
		return bt.args
	}
	general := func(bt *batch) []any {
		args := append([]any{bt.args[0], int64(1)}, bt.args[2:5]...) // L = 1, its header
		for _, a := range bt.calls {
			args = append(args, int64(1), a.Want) // limit 1, the cost
		}
		return args
	}
	var generals, exacts []float64
	for round := range rounds {
		if round%2 == 0 {
			generals = append(generals, measure(general))
			exacts = append(exacts, measure(exactOnly))
		} else {
			exacts = append(exacts, measure(exactOnly))
			generals = append(generals, measure(general))
		}
	}
	summary := func(v []float64) string {
		slices.Sort(v)
		return fmt.Sprintf("median %.2f µs, range %.2f–%.2f µs (%d rounds)", v[len(v)/2], v[0], v[len(v)-1], len(v))
	}
	t.Logf("Redis CPU per decision, %d exact calls per invocation, two at a time, %d keys:", perCall, userKeys)
	t.Logf("  general form:    %s", summary(generals))
	t.Logf("  exact-only form: %s", summary(exacts))
}
