package authority

import (
	"context"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// TestQuotaPrecision runs quotas that the old exactness rule (burst ×
// period in µs + rate < 2^53) refused, 104,250 per day, 1M per day, 10^12
// per day, MaxRate per MaxPeriod and a second of 10^12, on miniredis and
// checks literal, independently computed results and the stored state
// against the big-integer model after every step.
func TestQuotaPrecision(t *testing.T) {
	ctx := context.Background()
	const day = 24 * time.Hour
	usd := func(n int64) time.Duration { return time.Duration(n) * time.Microsecond }
	type op struct {
		at        time.Duration
		want, min int64
		g         Grant
	}
	grant := func(granted, remaining int64, retry, reset time.Duration) Grant {
		return Grant{Granted: granted, Remaining: remaining, RetryAfter: retry, ResetAfter: reset}
	}
	dayUs := int64(day / time.Microsecond) // 86,400,000,000
	cases := []struct {
		name string
		l    policy.Limit
		ops  []op
	}{
		{"104250 per day", policy.PerDay(104_250), []op{
			// 104250 per 8.64e10 µs reduces by gcd 750: 139 per 115,200,000 µs.
			{0, 104_250, 104_250, grant(104_250, 0, 0, usd(dayUs))},
			// One token is due after ceil(115200000/139) = 828,777 µs.
			{828_776 * time.Microsecond, 1, 1, grant(0, 0, usd(1), usd(dayUs-828_776))},
			{828_777 * time.Microsecond, 1, 1, grant(1, 0, 0, usd(dayUs-828_777+828_777))},
		}},
		{"1e12 per day", policy.PerDay(1e12), []op{
			{0, 1e12, 1e12, grant(1e12, 0, 0, usd(dayUs))},
			// 1 µs adds 1e12/8.64e10 = 11.57 tokens: 11 whole ones.
			{time.Microsecond, 12, 12, grant(0, 11, usd(1), usd(dayUs-1))},
			{time.Microsecond, 11, 11, grant(11, 0, 0, usd(dayUs-1+1))},
		}},
		{"MaxRate per MaxPeriod", policy.Limit{Name: "max", Rate: policy.MaxRate, Period: policy.MaxPeriod, Burst: policy.MaxRate}, nil},
		{"1e12 per second, burst 1", policy.Limit{Name: "fast", Rate: 1e12, Period: time.Second, Burst: 1}, []op{
			{0, 1, 1, grant(1, 0, 0, usd(1))},
			{0, 1, 1, grant(0, 0, usd(1), usd(1))},
			{time.Microsecond, 1, 1, grant(1, 0, 0, usd(1))},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := c.l.Validate(); err != nil {
				t.Fatalf("%v: %v", c.l, err)
			}
			b := newMiniBackend(t)
			r := b.newAuthority(t, testPrefix)
			key := r.Key(c.l, "k")
			m := newModel(c.l)
			ops := c.ops
			if ops == nil {
				// No literal values: the whole range, against the model.
				ops = []op{{0, c.l.Burst, 1, Grant{}}, {time.Microsecond, 1, 1, Grant{}}, {time.Hour, c.l.Burst, 1, Grant{}}, {500 * day, 3, 3, Grant{}}}
			}
			for i, o := range ops {
				at := t0.Add(o.at)
				b.setTime(t, at)
				g, err := r.Acquire(ctx, key, c.l, o.want, o.min, 1)
				if err != nil {
					t.Fatalf("op %d: Acquire(want=%d,min=%d): %v", i, o.want, o.min, err)
				}
				mg := m.acquire(micros(at), o.want, o.min, 1e6)
				if g != mg {
					t.Errorf("op %d: Acquire(want=%d,min=%d) at %v = %+v; the model gives %+v", i, o.want, o.min, o.at, g, mg)
				}
				g.At = 0 // compared with the model above
				if c.ops != nil && g != o.g {
					t.Errorf("op %d: Acquire(want=%d,min=%d) at %v = %+v; want %+v", i, o.want, o.min, o.at, g, o.g)
				}
				compareState(t, b, key, c.l, m, i)
			}
		})
	}
}
