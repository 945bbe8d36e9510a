package lease

import (
	"math/rand/v2"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/leaselimit/leaselimit/policy"
)

func TestLocalSteps(t *testing.T) {
	// 2 tokens per second (one per 500ms), burst 3.
	l := policy.Limit{Name: "a", Rate: 2, Period: time.Second, Burst: 3}
	const t0 = 1 * s
	steps := []struct {
		at     int64
		n      int64
		ok     bool
		rem    int64
		retry  time.Duration
		reason string
	}{
		{t0, 1, true, 2, 0, "starts full"},
		{t0, 2, true, 0, 0, "spend the rest"},
		{t0, 1, false, 0, 500 * time.Millisecond, "empty: one token in 500ms"},
		{t0, 2, false, 0, time.Second, "two tokens in 1s"},
		{t0 + 499999*us, 1, false, 0, time.Microsecond, "1µs short"},
		{t0 + 500*ms, 1, true, 0, 0, "refilled exactly"},
		{t0 + 750*ms, 1, false, 0, 250 * time.Millisecond, "half a token"},
		{t0 + 750*ms + 999, 1, false, 0, 250 * time.Millisecond, "sub-µs times truncate"},
		{t0 + 2*s, 3, true, 0, 0, "full again after 1.5s; capacity 3"},
		{t0 + 10*s, 2, true, 1, 0, "capped at burst"},
		{t0 + 10*s, 2, false, 1, 500 * time.Millisecond, "a denial takes nothing"},
		{t0 + 10*s, 1, true, 0, 0, "the remaining token"},
		{t0 + 5*s, 1, false, 0, 500 * time.Millisecond, "time going backwards adds nothing"},
		{t0 + 10*s + 500*ms, 1, true, 0, 0, "and does not lose the refill"},
	}
	b := new(localBucket)
	for i, st := range steps {
		ok, rem, retry := b.Allow(l, st.n, st.at)
		if ok != st.ok || rem != st.rem || retry != st.retry {
			t.Errorf("step %d (%s) at %v: Allow(%d) = %v, %d, %v; want %v, %d, %v",
				i, st.reason, time.Duration(st.at), st.n, ok, rem, retry, st.ok, st.rem, st.retry)
		}
	}
}

func rateLimiter(l policy.Limit) *rate.Limiter {
	return rate.NewLimiter(rate.Limit(float64(l.Rate)/l.Period.Seconds()), int(l.Burst))
}

// TestLocalMatchesXTimeRate feeds localBucket and golang.org/x/time/rate the same
// requests at the same times and expects the same decisions. Times step by
// an amount incommensurate with the token interval, so no decision falls on
// an exact token boundary where float rounding in x/time/rate could differ.
func TestLocalMatchesXTimeRate(t *testing.T) {
	base := time.Unix(1_700_000_000, 0)
	limits := []policy.Limit{
		policy.PerSecond(10),
		policy.PerSecond(3).WithBurst(2),
		policy.PerSecond(1000).WithBurst(50),
		policy.PerMinute(100).WithBurst(5),
		policy.PerHour(7200).WithBurst(1),
		{Name: "a", Rate: 5, Period: 250 * time.Millisecond, Burst: 3},
	}
	steps := []int64{123457 * us, 98761 * us, 7919 * us, 1_000_003 * us}
	for _, l := range limits {
		for _, step := range steps {
			b := new(localBucket)
			ref := rateLimiter(l)
			r := rand.New(rand.NewPCG(uint64(l.Rate), uint64(step)))
			now := 3 * s
			admitted := 0
			for i := 0; i < 3000; i++ {
				// Bursts of several calls at the same instant, then a step.
				if r.IntN(3) == 0 {
					now += step
				}
				n := 1 + r.Int64N(l.Burst+1) // sometimes more than Burst
				ok, rem, _ := b.Allow(l, n, now)
				want := ref.AllowN(base.Add(time.Duration(now)), int(n))
				if ok != want {
					t.Fatalf("%v step %v: call %d at %v: localBucket.Allow(%d) = %v; x/time/rate AllowN = %v",
						l, time.Duration(step), i, time.Duration(now), n, ok, want)
				}
				if wantRem := int64(ref.TokensAt(base.Add(time.Duration(now)))); rem != wantRem {
					t.Fatalf("%v step %v: call %d at %v: remaining %d; x/time/rate has %d",
						l, time.Duration(step), i, time.Duration(now), rem, wantRem)
				}
				if ok {
					admitted++
				}
			}
			if admitted == 0 {
				t.Errorf("%v step %v: nothing admitted", l, time.Duration(step))
			}
		}
	}
}

// TestLocalMatchesXTimeRateExact uses rates that are powers of two per
// second and times on a 1/64 s grid, where x/time/rate's float arithmetic
// is exact, so the decisions must agree even on token boundaries.
func TestLocalMatchesXTimeRateExact(t *testing.T) {
	base := time.Unix(1_700_000_000, 0)
	const grid = 15625 * us // 1/64 s
	for _, perSec := range []int64{1, 2, 4, 16, 64, 1024} {
		for _, burst := range []int64{1, 3, 64} {
			l := policy.PerSecond(perSec).WithBurst(burst)
			b := new(localBucket)
			ref := rateLimiter(l)
			r := rand.New(rand.NewPCG(uint64(perSec), uint64(burst)))
			now := 1 * s
			for i := 0; i < 5000; i++ {
				now += r.Int64N(5) * grid
				n := 1 + r.Int64N(burst+1)
				ok, rem, _ := b.Allow(l, n, now)
				at := base.Add(time.Duration(now))
				want := ref.AllowN(at, int(n))
				if ok != want {
					t.Fatalf("%v: call %d at %v: localBucket.Allow(%d) = %v; x/time/rate AllowN = %v", l, i, time.Duration(now), n, ok, want)
				}
				if wantRem := int64(ref.TokensAt(at)); rem != wantRem {
					t.Fatalf("%v: call %d at %v: remaining %d; x/time/rate has %d", l, i, time.Duration(now), rem, wantRem)
				}
			}
		}
	}
}

// TestLocalRetryIsExact: when localBucket denies n <= Burst tokens with retry r,
// the same request is admitted at now+r and still denied 1µs earlier.
func TestLocalRetryIsExact(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	limits := []policy.Limit{
		policy.PerSecond(3).WithBurst(2),
		policy.PerMinute(7).WithBurst(4),
		policy.PerSecond(1_000_000).WithBurst(10),
		{Name: "a", Rate: 13, Period: 1234567 * time.Microsecond, Burst: 9},
	}
	for _, l := range limits {
		b := new(localBucket)
		now := 1 * s
		denials := 0
		for i := 0; i < 2000; i++ {
			now += r.Int64N(int64(l.Interval(l.Burst))/2 + 1)
			n := 1 + r.Int64N(l.Burst)
			snap := localBucket{w: b.w, f: b.f, last: b.last, inited: b.inited}
			ok, _, retry := b.Allow(l, n, now)
			if ok {
				if retry != 0 {
					t.Fatalf("%v: admitted with retry %v", l, retry)
				}
				continue
			}
			denials++
			if retry <= 0 || retry%time.Microsecond != 0 {
				t.Fatalf("%v: denied with retry %v", l, retry)
			}
			late := snap.clone()
			if ok, _, _ := late.Allow(l, n, now+int64(retry)); !ok {
				t.Fatalf("%v: denied %d at %v with retry %v, still denied then", l, n, time.Duration(now), retry)
			}
			early := snap.clone()
			if ok, _, _ := early.Allow(l, n, now+int64(retry)-us); ok {
				t.Fatalf("%v: denied %d at %v with retry %v, but admitted 1µs earlier", l, n, time.Duration(now), retry)
			}
		}
		if denials == 0 {
			t.Errorf("%v: no denials exercised", l)
		}
	}
}

func (b *localBucket) clone() *localBucket {
	return &localBucket{w: b.w, f: b.f, last: b.last, inited: b.inited}
}

// TestLocalLongIdle: a bucket idle for a long time (or at the far end of the
// time range) refills to exactly Burst without overflowing.
func TestLocalLongIdle(t *testing.T) {
	l := policy.Limit{Name: "a", Rate: 1 << 40, Period: time.Microsecond, Burst: 1000}
	b := new(localBucket)
	b.Allow(l, 1000, 0)
	ok, rem, _ := b.Allow(l, 1, 1<<62)
	if !ok || rem != 999 {
		t.Errorf("after a long idle: Allow(1) = %v, %d; want true, 999", ok, rem)
	}
	big := policy.Limit{Name: "a", Rate: 1, Period: time.Hour, Burst: 2_000_000}
	if err := big.Validate(); err != nil {
		t.Fatal(err)
	}
	b = new(localBucket)
	b.Allow(big, big.Burst, 1*s)
	if ok, rem, _ := b.Allow(big, 1, 1*s+int64(time.Hour)); !ok || rem != 0 {
		t.Errorf("one token after an hour: %v, %d; want true, 0", ok, rem)
	}
}

func TestShare(t *testing.T) {
	l := policy.Limit{Name: "api", Rate: 10, Period: time.Minute, Burst: 7}
	tests := []struct {
		fleet       int
		rate, burst int64
	}{
		{-1, 10, 7},
		{0, 10, 7},
		{1, 10, 7},
		{2, 5, 4},
		{3, 4, 3},
		{4, 3, 2},
		{7, 2, 1},
		{10, 1, 1},
		{11, 1, 1},
		{1 << 20, 1, 1},
	}
	for _, tc := range tests {
		got := Share(l, tc.fleet)
		want := policy.Limit{Name: "api", Rate: tc.rate, Period: time.Minute, Burst: tc.burst}
		if got != want {
			t.Errorf("Share(%v, %d) = %v; want %v", l, tc.fleet, got, want)
		}
		if err := got.Validate(); err != nil {
			t.Errorf("Share(%v, %d) = %v: %v", l, tc.fleet, got, err)
		}
		// Rounded up: the fleet together gets at least the limit.
		if tc.fleet > 1 && (got.Rate*int64(tc.fleet) < l.Rate || got.Burst*int64(tc.fleet) < l.Burst) {
			t.Errorf("Share(%v, %d) = %v rounds down", l, tc.fleet, got)
		}
	}
	if got := Share(policy.PerSecond(1000), 8); got.Rate != 125 || got.Burst != 125 {
		t.Errorf("Share(PerSecond(1000), 8) = %v", got)
	}
}

// TestLocalHugeQuota: FailLocal shares of quotas far past where burst ×
// period leaves int64 (10^12 a day, MaxRate per MaxPeriod) stay exact.
func TestLocalHugeQuota(t *testing.T) {
	day := policy.PerDay(1e12)
	b := new(localBucket)
	if ok, rem, _ := b.Allow(day, 1e12, s); !ok || rem != 0 {
		t.Fatalf("Allow(1e12) on a full bucket = %v, %d", ok, rem)
	}
	// 1 µs adds 1e12/8.64e10 = 11.57 tokens.
	if ok, rem, retry := b.Allow(day, 12, s+int64(time.Microsecond)); ok || rem != 11 || retry != time.Microsecond {
		t.Errorf("Allow(12) 1µs later = %v, %d, %v; want denied, 11 left, 1µs", ok, rem, retry)
	}
	max := policy.Limit{Name: "max", Rate: policy.MaxRate, Period: policy.MaxPeriod, Burst: policy.MaxRate}
	b = new(localBucket)
	if ok, _, _ := b.Allow(max, policy.MaxRate, s); !ok {
		t.Fatal("Allow(MaxRate) on a full bucket denied")
	}
	if ok, _, retry := b.Allow(max, policy.MaxRate, s); ok || retry != max.Interval(policy.MaxRate) {
		t.Errorf("Allow(MaxRate) on an empty bucket = %v, retry %v; want denied, %v", ok, retry, max.Interval(policy.MaxRate))
	}
	if !b.Full(max, s+int64(policy.MaxPeriod)) || b.Full(max, s+int64(policy.MaxPeriod)-int64(time.Second)) {
		t.Error("Full wrong around the refill time of MaxRate per MaxPeriod")
	}
}
