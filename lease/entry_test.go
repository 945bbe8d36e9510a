package lease

import (
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// step is one operation on an entry at a fixed timestamp.
type step struct {
	at   int64
	op   string // take, install, deny, expire, drain, tokens, denied
	n    int64  // take: cost; install: granted; deny: RetryAfter in ns
	ok   bool   // take, denied: the expected report
	want int64  // take: left; install: refund; expire, drain: returned; tokens: Tokens(); denied: the wait
}

func runSteps(t *testing.T, z sizer, e *entry, steps []step) {
	t.Helper()
	for i, st := range steps {
		switch st.op {
		case "take":
			ok, left := e.Take(st.n, st.at)
			if ok != st.ok || left != st.want {
				t.Fatalf("step %d at %v: Take(%d) = %v, %d; want %v, %d", i, time.Duration(st.at), st.n, ok, left, st.ok, st.want)
			}
		case "install":
			req := request{Want: st.n, Min: 1}
			if got, _ := z.Install(e, req, Outcome{Granted: st.n, Remaining: bigRemaining, Min: 1}, st.at); got != st.want {
				t.Fatalf("step %d at %v: Install(granted %d) refund = %d; want %d", i, time.Duration(st.at), st.n, got, st.want)
			}
		case "deny":
			req := request{Want: 1, Min: 1}
			if got, _ := z.Install(e, req, Outcome{Granted: 0, RetryAfter: time.Duration(st.n), Min: 1}, st.at); got != 0 {
				t.Fatalf("step %d at %v: Install(denied) refund = %d; want 0", i, time.Duration(st.at), got)
			}
		case "expire":
			if got := e.Expire(st.at); got != st.want {
				t.Fatalf("step %d at %v: Expire = %d; want %d", i, time.Duration(st.at), got, st.want)
			}
		case "drain":
			if got := e.Drain(); got != st.want {
				t.Fatalf("step %d: Drain = %d; want %d", i, got, st.want)
			}
		case "tokens":
			if got := e.Tokens(); got != st.want {
				t.Fatalf("step %d: Tokens = %d; want %d", i, got, st.want)
			}
		case "denied":
			d, wait := cached(e, st.at)
			if d != st.ok || int64(wait) != st.want {
				t.Fatalf("step %d at %v: Denied = %v, %v; want %v, %v", i, time.Duration(st.at), d, wait, st.ok, time.Duration(st.want))
			}
		default:
			t.Fatalf("step %d: unknown op %q", i, st.op)
		}
	}
}

func TestTakeSteps(t *testing.T) {
	z := newSizer(policy.PerSecond(1000), policy.Lease{TTL: time.Second})
	const (
		t0 = 1 * s
		t1 = t0 + 1*ms
		t2 = t0 + 2*ms
		t3 = t0 + 3*ms
		t4 = t0 + 500*ms
		t5 = t4 + 1*s - 1 // last instant of the lease installed at t4
		t6 = t0 + 1600*ms
		t7 = t6 + 1*s // the lease installed at t6 has expired
		t8 = t7 + 1*ms
		t9 = t8 + 1*s
	)
	runSteps(t, z, &entry{key: "k"}, []step{
		// A never-filled entry serves nothing, at any time.
		{at: 0, op: "take", n: 1, ok: false, want: 0},
		{at: t0, op: "take", n: 1, ok: false, want: 0},
		{at: math.MaxInt64, op: "take", n: 1, ok: false, want: 0},
		{op: "tokens", want: 0},
		{at: t0, op: "expire", want: 0},

		{at: t1, op: "install", n: 10, want: 0},
		{op: "tokens", want: 10},
		{at: t1, op: "take", n: 3, ok: true, want: 7},
		{at: t2, op: "take", n: 8, ok: false, want: 7}, // all or nothing
		{op: "tokens", want: 7},
		{at: t2, op: "take", n: 7, ok: true, want: 0}, // exactly the rest
		{at: t3, op: "take", n: 1, ok: false, want: 0},
		{at: t3, op: "expire", want: 0}, // not expired, and empty

		{at: t4, op: "install", n: 5, want: 0},
		{at: t5, op: "take", n: 2, ok: true, want: 3},
		{at: t5, op: "expire", want: 0}, // one ns before expiry
		{at: t4 + 1*s, op: "take", n: 1, ok: false, want: 0},

		// The 3 left expired at t4+1s: a grant never revives them (they go
		// back, stale; a calendar quota's could be of an ended window).
		{at: t6, op: "install", n: 4, want: 0},
		{op: "tokens", want: 4},
		{at: t6, op: "take", n: 1, ok: true, want: 3},
		{at: t7, op: "take", n: 1, ok: false, want: 0}, // now == expiry: expired
		{op: "tokens", want: 3},                        // still held until Expire
		{at: t7, op: "expire", want: 3},
		{at: t7, op: "expire", want: 0}, // only once
		{at: t8, op: "expire", want: 0},
		{op: "tokens", want: 0},

		{at: t8, op: "install", n: 9, want: 0},
		{at: t8, op: "take", n: 4, ok: true, want: 5},
		{op: "drain", want: 5}, // Drain takes a live lease
		{op: "drain", want: 0},
		{at: t8, op: "take", n: 1, ok: false, want: 0},
		{at: t9, op: "expire", want: 0},
	})
}

func TestTakeZeroCost(t *testing.T) {
	z := newSizer(policy.PerSecond(10), policy.Lease{})
	e := &entry{key: "k"}
	z.Install(e, request{Want: 2, Min: 1}, Outcome{Granted: 2}, 1*s)
	if ok, left := e.Take(0, 1*s); !ok || left != 2 {
		t.Errorf("Take(0) = %v, %d; want true, 2", ok, left)
	}
}

func TestExpireAndDrainSteps(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{TTL: 200 * time.Millisecond, IdleTTL: time.Second})
	const (
		t0 = 10 * s
		t1 = t0 + 100*ms
		t2 = t0 + 200*ms - 1
		t3 = t0 + 200*ms
		t4 = t0 + 300*ms
		t5 = t4 + 50*ms
	)
	runSteps(t, z, &entry{key: "k"}, []step{
		{at: t0, op: "install", n: 20, want: 0},
		{at: t1, op: "take", n: 5, ok: true, want: 15},
		{at: t0, op: "expire", want: 0},
		{at: t1, op: "expire", want: 0},
		{at: t2, op: "expire", want: 0},
		{op: "tokens", want: 15},
		{at: t3, op: "expire", want: 15},
		{at: t3, op: "expire", want: 0},
		{at: t4, op: "expire", want: 0},
		{op: "tokens", want: 0},
		// A new grant after expiry serves again, for a new TTL.
		{at: t4, op: "install", n: 3, want: 0},
		{at: t5, op: "take", n: 3, ok: true, want: 0},
		{at: t4 + 200*ms, op: "expire", want: 0}, // spent: nothing to return
		{op: "drain", want: 0},
	})
}

// TestTakeConcurrent: many goroutines spending one lease never spend more
// than was installed, and every token is spent exactly once.
func TestTakeConcurrent(t *testing.T) {
	const installed = 20000
	z := newSizer(policy.PerSecond(installed), policy.Lease{})
	e := &entry{key: "k"}
	const now = 5 * s
	z.Install(e, request{Want: installed, Min: 1}, Outcome{Granted: installed}, now)

	const workers = 64
	var (
		spent     atomic.Int64
		successes atomic.Int64
		badLeft   atomic.Int64
		wg        sync.WaitGroup
	)
	start := make(chan struct{})
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			n := int64(w%3 + 1) // costs 1, 2 and 3
			for {
				ok, left := e.Take(n, now+int64(w))
				if left < 0 {
					badLeft.Add(1)
				}
				if !ok {
					if left >= n {
						badLeft.Add(1) // a denial with enough tokens left
					}
					// Spend what is left one by one, then stop.
					if ok1, _ := e.Take(1, now); ok1 {
						spent.Add(1)
						successes.Add(1)
						continue
					}
					return
				}
				spent.Add(n)
				successes.Add(1)
			}
		}()
	}
	close(start)
	wg.Wait()
	if badLeft.Load() != 0 {
		t.Errorf("%d Take results reported an impossible left", badLeft.Load())
	}
	if got := spent.Load(); got != installed {
		t.Errorf("spent %d tokens in %d successful Takes; want exactly %d installed", got, successes.Load(), installed)
	}
	if got := e.Tokens(); got != 0 {
		t.Errorf("Tokens() = %d after draining by Take, want 0", got)
	}
}

// TestTakeConcurrentWithExpireAndInstall: Takes racing Expire, Drain and
// Install never spend a token that was also returned for refunding.
func TestTakeConcurrentWithExpireAndInstall(t *testing.T) {
	z := newSizer(policy.PerSecond(1000), policy.Lease{TTL: time.Millisecond})
	e := &entry{key: "k"}
	const rounds = 200
	var spent, refunded, installed atomic.Int64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				// now 0 is always before the expiry of any install below.
				if ok, _ := e.Take(1, 0); ok {
					spent.Add(1)
				}
			}
		}()
	}
	for i := int64(1); i <= rounds; i++ {
		z.Install(e, request{Want: 50, Min: 1}, Outcome{Granted: 50}, i*s)
		installed.Add(50)
		if i%2 == 0 {
			refunded.Add(e.Expire(i*s + 2*ms))
		} else {
			refunded.Add(e.Drain())
		}
	}
	close(stop)
	wg.Wait()
	refunded.Add(e.Drain())
	if got := spent.Load() + refunded.Load(); got != installed.Load() {
		t.Errorf("spent %d + refunded %d = %d; want installed %d", spent.Load(), refunded.Load(), got, installed.Load())
	}
}

func TestPlanColdEntry(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{})
	e := &entry{key: "k"}
	req := plan(t, z, e, 1*s)
	if req != (request{Want: 1, Min: 1, At: 1 * s}) {
		t.Errorf("cold Plan with nothing pending = %+v; want {Want:1 Min:1}", req)
	}
}

// TestPlanColdEntryAsksForNeedOnly: a cold key uses leases of 1 token
// (DESIGN.md: "cold keys use leases of 1 (exact)"), so a refill for callers
// waiting on a never-used key asks for exactly the tokens they need.
func TestPlanColdEntryAsksForNeedOnly(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{})
	for _, tc := range []struct {
		pending []int64
		want    request
	}{
		{[]int64{1}, request{Want: 1, Min: 1, Need: 1, At: 1 * s}},
		{[]int64{3}, request{Want: 3, Min: 3, Need: 3, At: 1 * s}},
		{[]int64{5, 2, 9}, request{Want: 16, Min: 2, Need: 16, At: 1 * s}},
	} {
		e := &entry{key: "k"}
		for _, n := range tc.pending {
			e.AddPending(n)
		}
		if got := plan(t, z, e, 1*s); got != tc.want {
			t.Errorf("cold Plan with pending %v = %+v; want %+v", tc.pending, got, tc.want)
		}
	}
}

func TestPlanPending(t *testing.T) {
	z := newSizer(policy.PerSecond(100).WithBurst(20), policy.Lease{})
	tests := []struct {
		pending []int64
		minWant int64 // Min
		need    int64 // Want must cover at least this (capped by Burst)
	}{
		{nil, 1, 1},
		{[]int64{1}, 1, 1},
		{[]int64{4}, 4, 4},
		{[]int64{5, 2, 9}, 2, 16},
		{[]int64{9, 5, 2}, 2, 16},
		{[]int64{3, 3, 3}, 3, 9},
		{[]int64{20}, 20, 20},
		{[]int64{15, 15}, 15, 20},     // the sum is capped by Burst
		{[]int64{20, 20, 20}, 20, 20}, // Min stays <= Want
	}
	for _, tc := range tests {
		e := &entry{key: "k"}
		for _, n := range tc.pending {
			e.AddPending(n)
		}
		req := plan(t, z, e, 1*s)
		if req.Min != tc.minWant {
			t.Errorf("pending %v: Plan = %+v; want Min %d", tc.pending, req, tc.minWant)
		}
		if req.Want < tc.need {
			t.Errorf("pending %v: Plan = %+v; want Want >= %d", tc.pending, req, tc.need)
		}
		// Plan took the pending wants: the next Plan sees none.
		if next := plan(t, z, e, 1*s); next.Min != 1 {
			t.Errorf("pending %v: second Plan = %+v; want Min 1 (pending consumed)", tc.pending, next)
		}
	}
}

func TestAddPendingConcurrent(t *testing.T) {
	z := newSizer(policy.PerSecond(1_000_000), policy.Lease{})
	e := &entry{key: "k"}
	var wg sync.WaitGroup
	for w := int64(0); w < 50; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.AddPending(w + 3)
		}()
	}
	wg.Wait()
	req := plan(t, z, e, 1*s)
	if req.Min != 3 {
		t.Errorf("Min = %d; want 3, the smallest pending want", req.Min)
	}
	// sum of 3..52 = 1375
	if req.Want < 1375 {
		t.Errorf("Want = %d; want >= 1375, the sum of pending wants", req.Want)
	}
}

// TestPlanGrowsWithDemand: under steady local demand the planned lease
// grows towards demand × Horizon, capped by MaxTokens and Burst. The
// authority reports an almost empty bucket, so slow start stays off.
func TestPlanGrowsWithDemand(t *testing.T) {
	tests := []struct {
		name     string
		limit    policy.Limit
		settings policy.Lease
		every    int64 // one request per this many ns
		want     int64 // lease size after convergence
		slack    int64
	}{
		// 2000/s × 250ms (the default Horizon) = 500 tokens.
		{"uncapped", policy.PerSecond(10000), policy.Lease{}, 500 * us, 500, 25},
		// 2000/s × 200ms = 400 tokens.
		{"longer horizon", policy.PerSecond(10000), policy.Lease{Horizon: 200 * time.Millisecond}, 500 * us, 400, 20},
		{"MaxTokens cap", policy.PerSecond(10000), policy.Lease{MaxTokens: 40}, 500 * us, 40, 0},
		{"Burst cap", policy.PerSecond(10000).WithBurst(30), policy.Lease{}, 500 * us, 30, 0},
		{"no prefetch", policy.PerSecond(10000), policy.Lease{Prefetch: -1}, 500 * us, 500, 25},
		// 2/s × 250ms = 0.5: cold-ish keys keep leases of 1.
		{"slow key", policy.PerSecond(10000), policy.Lease{}, 500 * ms, 1, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			z := newSizer(tc.limit, tc.settings)
			e := &entry{key: "k"}
			now := 1 * s
			var sizes []int64
			for sec := 0; sec < 6; sec++ {
				now = driveR(t, z, e, now, tc.every, int(s/tc.every), nearEmpty)
				sizes = append(sizes, e.size.Load())
			}
			for i := 1; i < len(sizes); i++ {
				if sizes[i] < sizes[i-1]-tc.slack {
					t.Errorf("lease size shrank under steady demand: %v", sizes)
				}
			}
			got := sizes[len(sizes)-1]
			if got < tc.want-tc.slack || got > tc.want+tc.slack {
				t.Errorf("lease size after 6s = %d (by second: %v); want %d ± %d", got, sizes, tc.want, tc.slack)
			}
			// What the next refill asks for respects the same caps.
			e.AddPending(1)
			req := plan(t, z, e, now)
			if req.Want > z.settings.MaxTokens+1 || req.Want > tc.limit.Burst {
				t.Errorf("Plan after warm-up = %+v; caps MaxTokens %d, Burst %d", req, z.settings.MaxTokens, tc.limit.Burst)
			}
		})
	}
}

// TestSlowStart: far from its limit, a key whose leases last under half
// their TTL doubles them, so steady demand settles on leases lasting between
// TTL/2 and TTL; the size never exceeds 1/16 of what the bucket reports, a
// denial resets it, and expiry halves it.
func TestSlowStart(t *testing.T) {
	// 2000/s, TTL 1s, prefetch at 25% left: a lease of S is replanned after
	// 0.75·S/2000 s, so doubling stops at S >= 1333 and never passes 2667.
	for _, tc := range []struct {
		name      string
		settings  policy.Lease
		remaining int64
		lo, hi    int64
	}{
		{"prefetch", policy.Lease{TTL: time.Second}, bigRemaining, 1333, 2667},
		{"no prefetch", policy.Lease{TTL: time.Second, Prefetch: -1}, bigRemaining, 1000, 2000},
		{"MaxTokens", policy.Lease{TTL: time.Second, MaxTokens: 700}, bigRemaining, 700, 700},
		// 16 × 40 = 640 < 2000 × 250ms: the demand estimate wins.
		{"headroom", policy.Lease{TTL: time.Second}, 640, 475, 525},
		{"headroom caps slow start", policy.Lease{TTL: time.Second}, 16 * 900, 900, 900},
	} {
		t.Run(tc.name, func(t *testing.T) {
			z := newSizer(policy.PerSecond(100000), tc.settings)
			e := &entry{key: "k"}
			driveR(t, z, e, 1*s, 500*us, 8000, tc.remaining)
			if got := e.size.Load(); got < tc.lo || got > tc.hi {
				t.Errorf("lease size after 4s of 2000/s = %d; want [%d, %d]", got, tc.lo, tc.hi)
			}
		})
	}

	z := newSizer(policy.PerSecond(100000), policy.Lease{TTL: time.Second})
	e := &entry{key: "k"}
	drive(t, z, e, 1*s, 500*us, 8000)
	if e.grow < 1333 {
		t.Fatalf("slow-start size after warm-up = %d", e.grow)
	}
	// A lease that expired halves the size once per TTL that passed.
	before, exp := e.grow, e.expires.Load()
	e.AddPending(1)
	now := exp + 2500*ms
	z.Install(e, plan(t, z, e, now), Outcome{Granted: 1, Remaining: bigRemaining, Min: 1}, now)
	if want := before >> 3; e.grow != want {
		t.Errorf("2.5 TTLs after the lease expired: slow-start size %d; want %d (from %d)", e.grow, want, before)
	}
	// A denial means the key is at its limit: slow start starts over.
	e.AddPending(1)
	req := plan(t, z, e, now+ms)
	z.Install(e, req, Outcome{Granted: 0, Remaining: bigRemaining, RetryAfter: time.Millisecond, Min: req.Min}, now+ms)
	e.AddPending(1)
	plan(t, z, e, now+10*ms)
	if e.grow != 0 {
		t.Errorf("slow-start size after a denial = %d; want 0", e.grow)
	}
}

// TestSlowStartNeedsSpending: a refill asked for again soon after a grant
// doubles the slow-start size only if most of that grant was spent.
func TestSlowStartNeedsSpending(t *testing.T) {
	z := newSizer(policy.PerSecond(100000), policy.Lease{TTL: time.Second})
	for _, tc := range []struct {
		spend int64
		grows bool
	}{{0, false}, {10, false}, {49, false}, {50, true}, {100, true}} {
		e := &entry{key: "k"}
		now := 1 * s
		e.AddPending(1)
		plan(t, z, e, now) // cold: exact
		z.Install(e, request{Want: 101, Min: 1, Need: 1}, Outcome{Granted: 101, Remaining: bigRemaining, Min: 1}, now)
		if !e.TakeReserved(1) {
			t.Fatal("no reservation for the waiting caller")
		}
		if tc.spend > 0 {
			if ok, _ := e.Take(tc.spend, now); !ok {
				t.Fatalf("take %d", tc.spend)
			}
		}
		before := e.grow
		e.AddPending(1)
		plan(t, z, e, now+100*ms)
		if grew := e.grow > before; grew != tc.grows {
			t.Errorf("%d of a 101-token grant spent (1 reserved + %d) in 100ms: slow-start size %d -> %d; want growth %v",
				tc.spend+1, tc.spend, before, e.grow, tc.grows)
		}
	}
}

// TestSlowStartEscapesClosedLoop models many keys whose callers wait for
// each refill, with Redis capacity shared: every refill costs 350µs of the
// callers' time and a hit 1µs. A lease then lasts at least 1000 × 350µs =
// 350ms whatever its size (each key waits its turn for Redis), longer than
// the Horizon, so leases sized from served demand stay a few tokens; slow
// start doubles them (350ms is under TTL/2) until refills are rare.
func TestSlowStartEscapesClosedLoop(t *testing.T) {
	run := func(remaining int64) float64 {
		z := newSizer(policy.PerSecond(1_000_000_000), policy.Lease{})
		entries := make([]*entry, 1000)
		for i := range entries {
			entries[i] = &entry{key: "k" + strconv.Itoa(i)}
		}
		now := 1 * s
		refill := func(e *entry) {
			req := plan(t, z, e, now)
			z.Install(e, req, grantAll(req, remaining), now)
			now += 350 * us
		}
		var decisions, refills int
		for now < 11*s {
			measure := now >= 6*s
			for _, e := range entries {
				now += us
				if measure {
					decisions++
				}
				ok, left := e.Take(1, now)
				if !ok {
					e.AddPending(1)
					refill(e)
					if !e.TakeReserved(1) {
						t.Fatalf("refill of %s did not serve its caller", e.key)
					}
				} else if e.NeedsPrefetch(left) {
					refill(e)
					e.PrefetchDone()
				} else {
					continue
				}
				if measure {
					refills++
				}
			}
		}
		return float64(refills) / float64(decisions)
	}
	trapped, grown := run(nearEmpty), run(bigRemaining)
	t.Logf("refills per decision: %.4f demand-sized, %.4f with slow start", trapped, grown)
	if got := trapped; got < 0.2 {
		t.Errorf("demand-sized leases: %.4f refills per decision; the model should show the closed-loop trap (>= 0.2)", got)
	}
	if got := grown; got > 0.01 {
		t.Errorf("with slow start: %.4f refills per decision; want <= 0.01", got)
	}
}

// TestPlanWantNeverExceedsBurst hammers Plan with large pending sums and a
// hot demand estimate on small-burst limits.
func TestPlanWantNeverExceedsBurst(t *testing.T) {
	for _, burst := range []int64{1, 2, 3, 10, 100} {
		z := newSizer(policy.PerSecond(100000).WithBurst(burst), policy.Lease{})
		e := &entry{key: "k"}
		now := 1 * s
		for i := 0; i < 2000; i++ {
			n := int64(i%int(burst)) + 1
			serve(t, z, e, n, now) // plan() checks Want <= Burst and Min <= Want
			if i%7 == 0 {
				for j := 0; j < 5; j++ {
					e.AddPending(burst)
				}
				req := plan(t, z, e, now)
				if req.Want != burst || req.Min != burst {
					t.Fatalf("burst %d: Plan with 5 pending wants of %d = %+v; want {Want:%d Min:%d}", burst, burst, req, burst, burst)
				}
			}
			now += 10 * us
		}
	}
}

func TestPlanClockBackwards(t *testing.T) {
	z := newSizer(policy.PerSecond(10000), policy.Lease{})
	e := &entry{key: "k"}
	now := drive(t, z, e, 1*s, 500*us, 4000)
	before := e.size.Load()
	// A Plan at an earlier now leaves the estimate alone and plans sanely.
	req := plan(t, z, e, now-500*ms)
	if e.size.Load() != before {
		t.Errorf("size changed from %d to %d on a Plan in the past", before, e.size.Load())
	}
	if req.Want < 1 {
		t.Errorf("Plan in the past = %+v", req)
	}
}

// TestNegativeCacheCold: a denial of a cold key denies it locally for
// exactly RetryAfter.
func TestNegativeCacheCold(t *testing.T) {
	z := newSizer(policy.PerSecond(10), policy.Lease{DenyCap: time.Second})
	const (
		t0 = 3 * s
		t1 = t0 + 1
		t2 = t0 + 300*ms - 1
		t3 = t0 + 300*ms
		t4 = t3 + 1*s
	)
	e := &entry{key: "k"}
	req := plan(t, z, e, t0)
	if back, _ := z.Install(e, req, Outcome{Granted: 0, RetryAfter: 300 * time.Millisecond, Min: req.Min}, t0); back != 0 {
		t.Fatalf("Install(denied) refund = %d", back)
	}
	runSteps(t, z, e, []step{
		{at: t0, op: "denied", ok: true, want: 300 * ms},
		{at: t1, op: "denied", ok: true, want: 300*ms - 1},
		{at: t2, op: "denied", ok: true, want: 1},
		{at: t3, op: "denied", ok: false, want: 0},
		{at: t4, op: "denied", ok: false, want: 0},
		{at: t2, op: "take", n: 1, ok: false, want: 0},
	})
}

func TestNegativeCacheCapAndClear(t *testing.T) {
	z := newSizer(policy.PerSecond(10), policy.Lease{DenyCap: 200 * time.Millisecond})
	const (
		t0 = 3 * s
		t1 = t0 + 200*ms - 1
		t2 = t0 + 200*ms
		t3 = t2 + 10*ms
		t4 = t3 + 5*ms
		t5 = t4 + 1*ms
	)
	e := &entry{key: "k"}
	runSteps(t, z, e, []step{
		{at: t0, op: "deny", n: int64(5 * time.Second)}, // capped at 200ms
		{at: t0, op: "denied", ok: true, want: 200 * ms},
		{at: t1, op: "denied", ok: true, want: 1},
		{at: t2, op: "denied", ok: false},
		{at: t3, op: "deny", n: int64(time.Second)},
		{at: t4, op: "denied", ok: true, want: 195 * ms},
		{at: t4, op: "install", n: 2, want: 0}, // a grant clears the cache
		{at: t4, op: "denied", ok: false},
		{at: t5, op: "denied", ok: false},
		{at: t5, op: "take", n: 1, ok: true, want: 1},
		{at: t5, op: "deny", n: 0}, // RetryAfter 0 on a size-1 key: nothing to cache
		{at: t5, op: "denied", ok: false},
		{at: t5, op: "take", n: 1, ok: true, want: 0}, // a denial leaves the lease alone
	})
}

// TestNegativeCacheLeaseExtension: a key whose lease size is S is denied
// until RetryAfter plus the refill time of S - Min tokens, capped by DenyCap.
func TestNegativeCacheLeaseExtension(t *testing.T) {
	l := policy.PerSecond(10000)
	for _, tc := range []struct {
		name    string
		denyCap time.Duration
		retry   time.Duration
		pending int64
	}{
		{"Min 1", 5 * time.Second, time.Millisecond, 1},
		{"Min 40", 5 * time.Second, 3 * time.Millisecond, 40},
		{"capped", 5 * time.Millisecond, 3 * time.Millisecond, 1},
		{"Min above size", 5 * time.Second, 2 * time.Millisecond, 500},
	} {
		t.Run(tc.name, func(t *testing.T) {
			z := newSizer(l, policy.Lease{DenyCap: tc.denyCap})
			e := &entry{key: "k"}
			// 2000/s near the limit: size about 500.
			now := driveR(t, z, e, 1*s, 500*us, 6000, nearEmpty)
			e.Drain()
			size := e.size.Load()
			if size < 50 {
				t.Fatalf("warm-up left lease size %d", size)
			}
			e.AddPending(tc.pending)
			req := plan(t, z, e, now)
			size = e.size.Load()
			z.Install(e, req, Outcome{Granted: 0, RetryAfter: tc.retry, Min: req.Min}, now)

			want := tc.retry
			if extra := z.batchFor(size) - req.Min; extra > 0 {
				want += l.Interval(extra) // 100µs per token
			}
			want = min(want, tc.denyCap)
			if d, wait := cached(e, now); !d || wait != want {
				t.Errorf("size %d, Min %d, RetryAfter %v: Denied = %v, %v; want true, %v", size, req.Min, tc.retry, d, wait, want)
			}
			if d, _ := cached(e, now+int64(want)-1); !d {
				t.Errorf("not denied 1ns before %v", want)
			}
			if d, _ := cached(e, now+int64(want)); d {
				t.Errorf("still denied at %v", want)
			}
			if tc.name == "Min 1" && want <= tc.retry {
				t.Errorf("no extension for a lease of %d tokens", size)
			}
		})
	}
}

// TestBatchesAtLimit: a key at its limit is refilled in whole batches: the
// refill after a denial asks for the batch its negative cache waited for and
// takes all of it (Whole), while Min stays what the callers need; a grant
// that leaves the bucket short of a batch sets the cache again, to deny once
// the lease is spent until the next batch accrues (with no prefetch before
// then); a grant that leaves a batch or more ends batching.
func TestBatchesAtLimit(t *testing.T) {
	l := policy.PerSecond(1000) // 1ms per token, burst 1000
	z := newSizer(l, policy.Lease{DenyCap: 5 * time.Second})
	e := &entry{key: "k"}
	now := driveR(t, z, e, 1*s, ms/4, 4000, nearEmpty) // 4000/s: size about 1000
	e.Drain()
	size := e.size.Load()
	batch := z.batchFor(size)
	if want := min(size, l.Burst/batchDiv, 250); batch != want {
		t.Fatalf("batchFor(%d) = %d; want %d (size, Burst/%d, 250ms of refill)", size, batch, want, batchDiv)
	}

	// Denied for one token with 2ms to wait: the cache waits for the batch.
	e.AddPending(1)
	req := plan(t, z, e, now)
	z.Install(e, req, Outcome{Granted: 0, RetryAfter: 2 * time.Millisecond, Min: req.Min}, now)
	wait := 2*time.Millisecond + l.Interval(batch-1)
	if d, got := z.Denied(e, 1, now); !d || got != wait {
		t.Fatalf("after the denial: Denied = %v, %v; want true, %v", d, got, wait)
	}
	// The next refill, when the cache ends, asks for the batch, whole.
	now += int64(wait)
	e.AddPending(1)
	req = plan(t, z, e, now)
	if req.Want != batch || req.Min != 1 || !req.Whole {
		t.Fatalf("refill after the cache = %+v; want {Want:%d Min:1 Whole:true}", req, batch)
	}

	// A grant that leaves the bucket 30 tokens: short of a batch, so the
	// cache is set to when the rest accrues, and denies once the lease is
	// spent.
	z.Install(e, req, Outcome{Granted: batch, Remaining: 30, Min: req.Min}, now)
	if d, _ := z.Denied(e, 1, now); !d {
		t.Fatalf("batch grant leaving 30 tokens: not denied once spent")
	}
	if e.NeedsPrefetch(0) {
		t.Errorf("batch grant leaving 30 tokens: prefetch wanted before the next batch is due")
	}
	next := now + int64(l.Interval(batch-30))
	if d, _ := z.Denied(e, 1, next-1); !d {
		t.Errorf("not denied 1ns before the next batch accrues")
	}
	if d, _ := z.Denied(e, 1, next); d {
		t.Errorf("still denied when the next batch has accrued")
	}
	if ok, _ := e.Take(1, now); !ok {
		t.Fatalf("the batch is not in the lease")
	}
	e.Drain()

	// Asking 10ms before the cache ends: 10 tokens less, still whole; asking
	// before any of it accrued: an ordinary refill.
	e.AddPending(1)
	if req = plan(t, z, e, next-10*ms); req.Want != batch-10 || !req.Whole {
		t.Errorf("refill 10ms early = %+v; want {Want:%d Whole:true}", req, batch-10)
	}
	e.AddPending(1)
	if req = plan(t, z, e, next-int64(l.Interval(batch))); req.Whole {
		t.Errorf("refill before any of the batch accrued = %+v; want Whole false", req)
	}
	// A grant leaving a batch or more ends batching.
	z.Install(e, req, Outcome{Granted: req.Want, Remaining: batch, Min: req.Min}, next)
	e.Drain()
	if d, _ := z.Denied(e, 1, next); d {
		t.Errorf("denied after a grant that left a whole batch")
	}
	e.AddPending(1)
	if req = plan(t, z, e, next+ms); req.Whole || req.Min != 1 {
		t.Errorf("refill after batching ended = %+v; want Min 1, Whole false", req)
	}
}

// TestQuotaDenialNotBatched: a busy key of a calendar quota, denied 600ms
// before its boundary, is denied by the cache for exactly those 600ms: its
// tokens all come back at the boundary, so there is no batch to wait for
// past it. Regression (an adversarial review): the cache added a token
// bucket's refill time of a batch, computed from the quota's Period/Rate,
// and a Wait was admitted up to 247ms after the boundary.
func TestQuotaDenialNotBatched(t *testing.T) {
	l := policy.Quota("q", 1_000_000, policy.Hour, time.UTC)
	z := newSizer(l, policy.Lease{DenyCap: 5 * time.Second})
	e := &entry{key: "k"}
	now := driveR(t, z, e, 1*s, ms/4, 4000, nearEmpty)
	e.Drain()
	e.AddPending(1)
	req := plan(t, z, e, now)
	const retry = 600 * time.Millisecond
	z.Install(e, req, Outcome{Granted: 0, RetryAfter: retry, Min: req.Min}, now)
	if d, got := z.Denied(e, 1, now); !d || got != retry {
		t.Fatalf("after the denial: Denied = %v, %v; want true, %v (the boundary)", d, got, retry)
	}
	if d, got := z.Denied(e, 1, now+int64(retry)); d {
		t.Errorf("still denied at the boundary, for %v more", got)
	}
	e.AddPending(1)
	if req := plan(t, z, e, now+int64(retry)); req.Whole {
		t.Errorf("refill at the boundary = %+v; want no batch (Whole false)", req)
	}
}

// TestBatchAfterLargeDenial: a denied large request does not make later
// small ones ask for as much. After AllowN(100) is denied on a bucket
// holding 50, Allow(1) is not held back and plans Min 1, whether it comes
// at once or after the cache ended.
func TestBatchAfterLargeDenial(t *testing.T) {
	for _, warm := range []bool{false, true} {
		l := policy.PerSecond(100) // 10ms per token, burst 100
		z := newSizer(l, policy.Lease{DenyCap: time.Minute})
		e := &entry{key: "a"}
		now := 1 * s
		if warm { // a busy key: its batch is more than one token
			now = driveR(t, z, e, now, 10*ms, 300, nearEmpty)
			e.Drain()
			if z.batchFor(e.size.Load()) < 2 {
				t.Fatalf("warm-up left size %d", e.size.Load())
			}
		}
		e.AddPending(100)
		req := plan(t, z, e, now)
		z.Install(e, req, Outcome{Granted: 0, Remaining: 50, RetryAfter: 500 * time.Millisecond, Min: req.Min}, now)
		if d, _ := z.Denied(e, 100, now); !d {
			t.Fatalf("warm %v: the denied request is not cached", warm)
		}
		for _, at := range []int64{now + ms, now + 600*ms} {
			if d, wait := z.Denied(e, 1, at); d {
				t.Errorf("warm %v: Allow(1) at +%v denied for %v by the cache of a denied AllowN(100)", warm, time.Duration(at-now), wait)
			}
			e.AddPending(1)
			// Min 1, and at most a batch (Burst/4) more for the lease.
			if req := plan(t, z, e, at); req.Min != 1 || req.Want > l.Burst/batchDiv {
				t.Errorf("warm %v: Plan for 1 token at +%v after a denial of 100 = %+v; want Min 1, Want <= %d", warm, time.Duration(at-now), req, l.Burst/batchDiv)
			}
		}
	}
}

// TestBatchCappedByBurst: on a small burst the batch a denied key waits for
// and then asks for is at most a quarter of the burst, however large its
// lease had grown.
func TestBatchCappedByBurst(t *testing.T) {
	for _, burst := range []int64{8, 40, 100} {
		l := policy.PerSecond(100000).WithBurst(burst)
		z := newSizer(l, policy.Lease{})
		e := &entry{key: "k"}
		now := driveR(t, z, e, 1*s, 10*us, 20000, nearEmpty)
		e.Drain()
		if e.size.Load() != burst {
			t.Fatalf("burst %d: warm-up left size %d", burst, e.size.Load())
		}
		e.AddPending(1)
		req := plan(t, z, e, now)
		z.Install(e, req, Outcome{Granted: 0, RetryAfter: 10 * time.Microsecond, Min: req.Min}, now)
		_, wait := z.Denied(e, 1, now)
		e.AddPending(1)
		req = plan(t, z, e, now+int64(wait))
		if q := burst / batchDiv; req.Want != q || !req.Whole {
			t.Errorf("burst %d: refill after the cache = %+v; want {Want:%d Whole:true}", burst, req, q)
		}
	}
}

// TestInstallAfterEviction: tokens granted to an entry evicted while its
// refill ran are returned for refunding, not installed.
func TestInstallAfterEviction(t *testing.T) {
	z := newSizer(policy.PerSecond(100), policy.Lease{})
	tab := newTable(1) // one entry per shard
	const (
		t0 = 1 * s
		t1 = t0 + 20*ms
		t2 = t0 + 40*ms
	)
	a, _ := tab.GetOrCreate(nil, "a", t0)
	a.AddPending(1)
	req := plan(t, z, a, t0)

	b := keyInShardOf(t, tab, "a", "b")
	if _, ev := tab.GetOrCreate(nil, b, t1); ev != a {
		t.Fatalf("GetOrCreate(%q) evicted %v; want entry a", b, ev)
	}
	if !a.removed.Load() {
		t.Fatalf("evicted entry has removed unset")
	}
	if back, _ := z.Install(a, req, Outcome{Granted: 7, Remaining: 50, Min: req.Min}, t2); back != 7 {
		t.Errorf("Install on an evicted entry refund = %d; want 7", back)
	}
	if got := a.Tokens(); got != 0 {
		t.Errorf("evicted entry holds %d tokens", got)
	}
	if ok, _ := a.Take(1, t2); ok {
		t.Errorf("Take succeeded on an evicted entry")
	}
	if got := a.Drain(); got != 0 {
		t.Errorf("Drain after refunded install = %d; want 0", got)
	}
	// A denial on an evicted entry refunds nothing.
	if back, _ := z.Install(a, req, Outcome{Granted: 0, RetryAfter: time.Millisecond, Min: 1}, t2); back != 0 {
		t.Errorf("Install(denied) on evicted entry refund = %d; want 0", back)
	}
}

func TestNeedsPrefetch(t *testing.T) {
	z := newSizer(policy.PerSecond(10000), policy.Lease{Prefetch: 0.25})
	e := &entry{key: "k"}
	// Cold: the low-water mark is 0 and nothing prefetches.
	plan(t, z, e, 1*s)
	for _, left := range []int64{0, 1, 5} {
		if e.NeedsPrefetch(left) {
			t.Fatalf("cold entry: NeedsPrefetch(%d) = true", left)
		}
	}
	e.PrefetchDone()

	drive(t, z, e, 1*s, 500*us, 6000)
	size := e.size.Load()
	low := int64(float64(size) * 0.25)
	if low < 2 {
		t.Fatalf("warm-up left size %d, low-water %d", size, low)
	}
	if e.NeedsPrefetch(low) {
		t.Errorf("NeedsPrefetch(%d) at the low-water mark = true; want false", low)
	}
	if e.NeedsPrefetch(size) {
		t.Errorf("NeedsPrefetch(%d) = true", size)
	}
	if !e.NeedsPrefetch(low - 1) {
		t.Fatalf("NeedsPrefetch(%d) below the low-water mark %d = false", low-1, low)
	}
	// Claimed: no second claim until PrefetchDone.
	for _, left := range []int64{low - 1, 0} {
		if e.NeedsPrefetch(left) {
			t.Errorf("NeedsPrefetch(%d) claimed twice", left)
		}
	}
	e.PrefetchDone()
	if !e.NeedsPrefetch(0) {
		t.Errorf("NeedsPrefetch(0) after PrefetchDone = false")
	}
	e.PrefetchDone()

	// Many goroutines below the mark: exactly one claim.
	var claims atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < 64; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if e.NeedsPrefetch(0) {
				claims.Add(1)
			}
		}()
	}
	wg.Wait()
	if got := claims.Load(); got != 1 {
		t.Errorf("%d concurrent claims; want exactly 1", got)
	}
	e.PrefetchDone()
}

func TestNeedsPrefetchDisabled(t *testing.T) {
	z := newSizer(policy.PerSecond(10000), policy.Lease{Prefetch: -1})
	e := &entry{key: "k"}
	drive(t, z, e, 1*s, 500*us, 6000)
	if e.size.Load() < 50 {
		t.Fatalf("warm-up left size %d", e.size.Load())
	}
	if e.NeedsPrefetch(0) {
		t.Errorf("NeedsPrefetch(0) with prefetch disabled = true")
	}
}

// TestSteadyDemandRarelyMisses: with prefetch, a hot key's requests are
// served from the lease; refills with a waiting caller are rare.
func TestSteadyDemandRarelyMisses(t *testing.T) {
	z := newSizer(policy.PerSecond(10000), policy.Lease{})
	e := &entry{key: "k"}
	now := drive(t, z, e, 1*s, 500*us, 4000) // warm-up
	misses := 0
	for i := 0; i < 4000; i++ {
		if _, hit := serve(t, z, e, 1, now); !hit {
			misses++
		}
		now += 500 * us
	}
	if misses > 10 {
		t.Errorf("%d of 4000 requests missed the lease after warm-up", misses)
	}
}

func TestEntryAccessors(t *testing.T) {
	z := newSizer(policy.PerSecond(10), policy.Lease{})
	e := &entry{key: "user:42"}
	if e.Key() != "user:42" {
		t.Errorf("Key() = %q", e.Key())
	}
	if e.Remote() != 0 || e.Tokens() != 0 {
		t.Errorf("fresh entry: Remote %d, Tokens %d", e.Remote(), e.Tokens())
	}
	z.Install(e, request{Want: 2, Min: 1}, Outcome{Granted: 2, Remaining: 6}, 1*s)
	if e.Remote() != 6 {
		t.Errorf("Remote() = %d after a grant reporting 6", e.Remote())
	}
	z.Install(e, request{Want: 2, Min: 1}, Outcome{Granted: 0, Remaining: 0, RetryAfter: time.Millisecond}, 2*s)
	if e.Remote() != 0 {
		t.Errorf("Remote() = %d after a denial reporting 0", e.Remote())
	}
	b := e.fallbackBucket(newFull)
	if b == nil || e.fallbackBucket(newFull) != b {
		t.Errorf("localBucket() is not stable")
	}
	if got := z.settings; got != (policy.Lease{}).WithDefaults() {
		t.Errorf("Settings() = %+v; want defaults", got)
	}
}

func TestLocalCreatedOnce(t *testing.T) {
	e := &entry{key: "k"}
	var wg sync.WaitGroup
	got := make([]*localBucket, 32)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i] = e.fallbackBucket(newFull)
		}()
	}
	wg.Wait()
	for i := range got {
		if got[i] != got[0] {
			t.Fatalf("localBucket() returned different buckets")
		}
	}
}

func TestEntryNoAllocs(t *testing.T) {
	z := newSizer(policy.PerSecond(10), policy.Lease{})
	e := &entry{key: "k"}
	z.Install(e, request{Want: 1, Min: 1}, Outcome{Granted: math.MaxInt64 / 2}, 1*s)
	now := 1 * s
	if a := testing.AllocsPerRun(1000, func() {
		now++
		if ok, _ := e.Take(1, now); !ok {
			panic("Take failed")
		}
	}); a != 0 {
		t.Errorf("entry.Take allocates %v times per call", a)
	}
	if a := testing.AllocsPerRun(1000, func() {
		cached(e, now)
		e.NeedsPrefetch(1 << 40)
		e.Touch(now)
	}); a != 0 {
		t.Errorf("Denied/NeedsPrefetch/Touch allocate %v times per call", a)
	}
}

// newFull makes a full FailLocal bucket, as a key's first one is.
func newFull() *localBucket { return new(localBucket) }
