package authority

import (
	"context"
	"fmt"
	"math"
	"math/rand"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
	"golang.org/x/time/rate"
)

// dyadicShares are shares whose ppm/1e6 is exact in a double, so the
// script's floating-point share computation is exact for them (see
// TestKnownBugShareFloor for the others).
var dyadicShares = []float64{1, 0.5, 0.25, 0.125, 0.0625}

// edgeLimit returns a limit at the edge of the range policy.Limit.Validate
// accepts for rate and period: the largest burst, MaxRate (far past where
// burst·period leaves 2^53 and int64: the scripts must keep whole tokens
// and the fraction of one apart, and the model counts in math/big).
func edgeLimit(name string, r int64, period time.Duration) policy.Limit {
	l := policy.Limit{Name: name, Rate: r, Period: period, Burst: policy.MaxRate}
	if err := l.Validate(); err != nil {
		panic(fmt.Sprintf("no valid burst for %d per %v: %v", r, period, err))
	}
	return l
}

// randomLimit returns a valid limit: mostly small everyday limits, often
// one at the edge of the exact range.
func randomLimit(rng *rand.Rand, i int) policy.Limit {
	periods := []time.Duration{time.Microsecond, 7 * time.Microsecond, time.Millisecond, 333 * time.Millisecond,
		time.Second, 3 * time.Second, time.Minute, time.Hour, 24 * time.Hour, 999983 * time.Microsecond,
		30 * 24 * time.Hour, 366 * 24 * time.Hour, policy.MaxPeriod}
	period := periods[rng.Intn(len(periods))]
	name := fmt.Sprintf("l%d", i)
	var l policy.Limit
	switch rng.Intn(4) {
	case 0: // edge of the exact range
		rates := []int64{1, 2, 3, 7, 10, 1000, 999_999_937, 1 << 40, 1e12, policy.MaxRate}
		l = edgeLimit(name, rates[rng.Intn(len(rates))], period)
	case 1: // large: quotas up to 10^12
		l = policy.Limit{Name: name, Rate: rng.Int63n(1e12) + 1, Period: period, Burst: rng.Int63n(1e12) + 1}
	default: // everyday
		l = policy.Limit{Name: name, Rate: rng.Int63n(20) + 1, Period: period, Burst: rng.Int63n(50) + 1}
	}
	if err := l.Validate(); err != nil {
		// A random large limit may leave the exact range: clamp the burst.
		l = edgeLimit(name, l.Rate, l.Period)
	}
	return l
}

// randomDuration picks a time step that exercises fractions of a token,
// whole tokens and full refills.
func randomDuration(rng *rand.Rand, l policy.Limit) time.Duration {
	perToken := float64(l.PeriodMicros()) / float64(l.Rate) // µs
	full := perToken * float64(l.Burst)
	var dt float64
	switch rng.Intn(8) {
	case 0:
		return 0
	case 1:
		dt = float64(rng.Intn(3) + 1)
	case 2:
		dt = perToken * float64(rng.Intn(4))
	case 3:
		dt = perToken*float64(rng.Intn(4)) + float64(rng.Intn(3)-1)
	case 4:
		dt = rng.Float64() * perToken
	case 5:
		dt = rng.Float64() * full * 1.5
	case 6:
		dt = -float64(rng.Intn(1_000_000)) // the clock goes back up to 1s
	default:
		dt = rng.Float64() * 10 * perToken
	}
	// Keep the server clock within a year of t0: TIME in µs must stay far
	// below 2^53 for the script's own clock arithmetic.
	const maxStep = 365 * 24 * 3600 * 1e6
	dt = math.Max(-maxStep, math.Min(maxStep, dt))
	return time.Duration(dt) * time.Microsecond
}

// TestAcquireMatchesModel runs random sequences of Acquire and refundOne
// over random valid limits (many at the edge of the exact range) and server
// times (also going backwards) on miniredis, and compares every reply, the
// stored bucket and its TTL with the integer reference model.
func TestAcquireMatchesModel(t *testing.T) {
	ctx := context.Background()
	seeds := 60
	if testing.Short() {
		seeds = 10
	}
	for seed := int64(1); seed <= int64(seeds); seed++ {
		rng := rand.New(rand.NewSource(seed))
		l := randomLimit(rng, int(seed))
		t.Run(fmt.Sprintf("seed%d/%v", seed, l), func(t *testing.T) {
			b := newMiniBackend(t)
			r := b.newAuthority(t, testPrefix)
			key := r.Key(l, "k")
			m := newModel(l)
			now := t0
			for i := 0; i < 60; i++ {
				if dt := randomDuration(rng, l); now.Add(dt).After(t0.Add(-24 * time.Hour)) {
					now = now.Add(dt)
				}
				b.setTime(t, now)
				if rng.Intn(4) == 0 {
					n := rng.Int63n(l.Burst) + 1
					got, err := r.refundOne(ctx, key, l, n)
					if err != nil {
						t.Fatalf("op %d: refundOne(%d): %v", i, n, err)
					}
					if want := m.refund(micros(now), n); got != want {
						t.Fatalf("op %d at %v: refundOne(%d) = %d; want %d", i, now.Sub(t0), n, got, want)
					}
				} else {
					want := rng.Int63n(l.Burst) + 1
					if rng.Intn(3) == 0 {
						want = rng.Int63n(min(l.Burst, 4)) + 1
					}
					mn := rng.Int63n(want) + 1
					if rng.Intn(2) == 0 {
						mn = want
					}
					share := dyadicShares[rng.Intn(len(dyadicShares))]
					got, err := r.Acquire(ctx, key, l, want, mn, share)
					if err != nil {
						t.Fatalf("op %d: Acquire(want=%d,min=%d,share=%v): %v", i, want, mn, share, err)
					}
					if exp := m.acquire(micros(now), want, mn, ppmOf(share)); got != exp {
						t.Fatalf("op %d at %v: Acquire(want=%d,min=%d,share=%v) = %+v; want %+v", i, now.Sub(t0), want, mn, share, got, exp)
					}
				}
				compareState(t, b, key, l, m, i)
				if t.Failed() {
					return
				}
			}
		})
	}
}

// TestAcquireMatchesXTimeRate checks the documented equivalence: with
// want = min = n, the decisions for one key are those of
// golang.org/x/time/rate fed the same (monotonic) times. The rate is 8
// tokens/s and the times are multiples of 1/64 s so that x/time/rate's
// float64 arithmetic is exact too.
func TestAcquireMatchesXTimeRate(t *testing.T) {
	ctx := context.Background()
	const tick = time.Second / 64
	for _, l := range []policy.Limit{
		{Name: "a", Rate: 8, Period: time.Second, Burst: 1},
		{Name: "b", Rate: 8, Period: time.Second, Burst: 3},
		{Name: "c", Rate: 1, Period: 125 * time.Millisecond, Burst: 8},
		{Name: "d", Rate: 16, Period: 2 * time.Second, Burst: 20},
	} {
		t.Run(l.String(), func(t *testing.T) {
			rng := rand.New(rand.NewSource(l.Burst))
			b := newMiniBackend(t)
			r := b.newAuthority(t, testPrefix)
			key := r.Key(l, "k")
			lim := rate.NewLimiter(rate.Limit(float64(l.Rate)/l.Period.Seconds()), int(l.Burst))
			now := t0
			allowed := 0
			for i := 0; i < 400; i++ {
				now = now.Add(time.Duration(rng.Intn(24)) * tick)
				b.setTime(t, now)
				n := rng.Int63n(l.Burst) + 1
				if rng.Intn(2) == 0 {
					n = 1
				}
				g, err := r.exact(ctx, key, l, n)
				if err != nil {
					t.Fatal(err)
				}
				want := lim.AllowN(now, int(n))
				if (g.Granted == n) != want || (g.Granted != 0 && g.Granted != n) {
					t.Fatalf("step %d at %v: Exact(%d) = %+v; x/time/rate AllowN = %v", i, now.Sub(t0), n, g, want)
				}
				if tokens := int64(math.Floor(lim.TokensAt(now))); tokens != g.Remaining {
					t.Fatalf("step %d at %v: Remaining = %d; x/time/rate holds %d", i, now.Sub(t0), g.Remaining, tokens)
				}
				if want {
					allowed++
				}
			}
			if allowed == 0 || allowed == 400 {
				t.Errorf("%d of 400 allowed: the test does not exercise denials and grants", allowed)
			}
		})
	}
}
