package authority

import (
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// bigCeilDiv returns ceil(a/b) for a >= 0, b > 0, computed in math/big.
func bigCeilDiv(a, b int64) int64 {
	q, m := new(big.Int).QuoRem(big.NewInt(a), big.NewInt(b), new(big.Int))
	if m.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	return q.Int64()
}

// TestPrecisionAtTheEdge runs limits at the edge of what policy.Limit.Validate
// accepts (burst·period + rate = 2^53 or just below) on miniredis and checks
// literal, independently computed results: the script's doubles must stay
// exact integers all the way.
func TestPrecisionAtTheEdge(t *testing.T) {
	const two53 = int64(1) << 53
	ctx := context.Background()

	type op struct {
		at        time.Duration
		want, min int64
		share     float64
		g         Grant
		s         int64 // stored units after the op (checked when >= 0 and the op granted)
	}
	type tc struct {
		name string
		l    policy.Limit
		ops  []op
	}
	usd := func(n int64) time.Duration { return time.Duration(n) * time.Microsecond }

	// 1 token per µs, the largest burst (2^53-1 or 2^53-2 depending on
	// where Validate draws the line): cap = B units.
	l1 := edgeLimit("l1", 1, time.Microsecond)
	B := l1.Burst
	if B < two53-2 {
		t.Fatalf("largest valid burst at 1/µs is %d; want 2^53-2 or 2^53-1", B)
	}
	// rate 7 per second, the largest burst: 9007199254 tokens.
	l2 := edgeLimit("l2", 7, time.Second)
	cap2 := l2.Burst * 1_000_000
	// a huge rate: 2^53-3 per µs, burst 2.
	l3 := policy.Limit{Name: "l3", Rate: two53 - 3, Period: time.Microsecond, Burst: 2}
	// a huge period: 3e15 µs (95 years), 1 per period, burst 3.
	l4 := policy.Limit{Name: "l4", Rate: 1, Period: 3_000_000_000_000_000 * time.Microsecond, Burst: 3}
	// odd rate and period: 999999937 per 999983 µs.
	l5 := edgeLimit("l5", 999_999_937, 999_983*time.Microsecond)
	cap5 := l5.Burst * 999_983

	cases := []tc{
		{"l1", l1, []op{
			{0, B, B, 1, grant(B, 0, 0, usd(B)), 0},
			{1 * us, 2, 1, 1, grant(1, 0, 0, usd(B)), 0},
			{1 * us, 1, 1, 1, grant(0, 0, us, usd(B)), -1},
			{101 * us, B, 1, 0.5, grant(50, 50, 0, usd(B-50)), 50},
			{101 * us, 60, 60, 1, grant(0, 50, 10*us, usd(B-50)), -1},
		}},
		{"l1 half of a full bucket", l1, []op{
			// floor(B/2) granted, B - floor(B/2) remain.
			{0, B, 1, 0.5, grant(B/2, B-B/2, 0, usd(B/2)), B - B/2},
			{0, B, 1, 0.5, grant((B-B/2)/2, B-B/2-(B-B/2)/2, 0, usd(B/2+(B-B/2)/2)), B - B/2 - (B-B/2)/2},
		}},
		{"l2", l2, []op{
			{0, l2.Burst, l2.Burst, 1, grant(l2.Burst, 0, 0, usd(bigCeilDiv(cap2, 7))), 0},
			{1 * us, 1, 1, 1, grant(0, 0, usd(bigCeilDiv(1_000_000-7, 7)), usd(bigCeilDiv(cap2-7, 7))), -1},
			// 142857µs after the last write (the denial wrote nothing) add
			// 999999 units: still no whole token.
			{142857 * us, 1, 1, 1, grant(0, 0, us, usd(bigCeilDiv(cap2-999_999, 7))), -1},
			{142858 * us, 1, 1, 1, grant(1, 0, 0, usd(bigCeilDiv(cap2-6, 7))), 6},
			// An hour later: 6 + 7·(3600000000-142858) = 25199000000 units,
			// 25199 tokens; half of them rounded down is granted.
			{time.Hour, l2.Burst, 1, 0.5, grant(12599, 12600, 0, usd(bigCeilDiv(cap2-12_600_000_000, 7))), 12_600_000_000},
		}},
		{"l3", l3, []op{
			{0, 2, 2, 1, grant(2, 0, 0, us), 0},
			{0, 1, 1, 1, grant(0, 0, us, us), -1},
			{1 * us, 2, 2, 1, grant(2, 0, 0, us), 0}, // (2^53-3)·1µs refills everything
		}},
		{"l4", l4, []op{
			{0, 1, 1, 1, grant(1, 2, 0, usd(3e15)), 6e15},
			{1 * us, 3, 3, 1, grant(0, 2, usd(3e15-1), usd(3e15-1)), -1},
			{1 * us, 2, 2, 1, grant(2, 0, 0, usd(9e15-1)), 1},
		}},
		{"l5", l5, []op{
			{0, l5.Burst, l5.Burst, 1, grant(l5.Burst, 0, 0, usd(bigCeilDiv(cap5, 999_999_937))), 0},
			{1 * us, 1000, 1, 1, grant(1000, 0, 0, usd(bigCeilDiv(cap5-(999_999_937-1000*999_983), 999_999_937))), 999_999_937 - 1000*999_983},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := c.l.Validate(); err != nil {
				t.Fatalf("%v: %v", c.l, err)
			}
			b := newMiniBackend(t)
			r := b.newAuthority(t, "")
			key := r.Key(c.l, "k")
			m := newModel(c.l)
			for i, o := range c.ops {
				at := t0.Add(o.at)
				b.setTime(t, at)
				g, err := r.Acquire(ctx, key, c.l, o.want, o.min, o.share)
				if err != nil {
					t.Fatalf("op %d: Acquire(want=%d,min=%d): %v", i, o.want, o.min, err)
				}
				if g != o.g {
					t.Errorf("op %d: Acquire(want=%d,min=%d,share=%v) at %v = %+v; want %+v", i, o.want, o.min, o.share, o.at, g, o.g)
				}
				if mg := m.acquire(micros(at), o.want, o.min, ppmOf(o.share)); mg != o.g {
					t.Errorf("op %d: the model gives %+v; the table says %+v", i, mg, o.g)
				}
				if o.s >= 0 && g.Granted > 0 {
					if s, _, _ := b.state(t, key); s != o.s {
						t.Errorf("op %d: stored s = %d; want %d", i, s, o.s)
					}
				}
				compareState(t, b, key, m, i)
			}
		})
	}
}
