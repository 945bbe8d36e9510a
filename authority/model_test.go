package authority

import (
	"math/big"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// model is a reference token bucket written from the documented semantics
// (DESIGN.md "Semantics" and the contracts at the top of batch.lua and
// refund.lua), in exact big-integer arithmetic (math/big), so it holds for
// limits up to policy.MaxRate tokens per policy.MaxPeriod. It shares no code
// with the Lua scripts and no representation: it counts units, a token
// being period units (the period in µs, not reduced), one µs adding rate
// units, at most burst·period units. A missing bucket is full.
type model struct {
	rate, period, burst *big.Int // period in µs
	present             bool
	s                   *big.Int // units
	t                   int64    // µs
}

// maxDuration is where the scripts saturate the durations they report: 2^52 µs.
var maxDuration = big.NewInt(1 << 52)

func newModel(l policy.Limit) *model {
	return &model{rate: big.NewInt(l.Rate), period: big.NewInt(l.PeriodMicros()), burst: big.NewInt(l.Burst), s: new(big.Int)}
}

func (m *model) cap() *big.Int { return new(big.Int).Mul(m.burst, m.period) }

// refilled returns the units and timestamp the bucket holds at now, without
// changing the model. A clock that went backwards refills nothing and keeps
// the later timestamp.
func (m *model) refilled(now int64) (*big.Int, int64) {
	c := m.cap()
	if !m.present {
		return c, now
	}
	s, t := new(big.Int).Set(m.s), m.t
	if s.Cmp(c) > 0 {
		s.Set(c)
	}
	if now > t {
		s.Add(s, new(big.Int).Mul(big.NewInt(now-t), m.rate))
		if s.Cmp(c) > 0 {
			s.Set(c)
		}
		t = now
	}
	return s, t
}

// ceilDiv returns ceil(a/b) for a > 0, else 0, saturated at maxDuration.
func ceilDiv(a, b *big.Int) int64 {
	if a.Sign() <= 0 {
		return 0
	}
	q := new(big.Int).Add(a, b)
	q.Sub(q, big.NewInt(1))
	q.Quo(q, b)
	if q.Cmp(maxDuration) > 0 {
		return maxDuration.Int64()
	}
	return q.Int64()
}

// tokens returns the whole tokens in s units.
func (m *model) tokens(s *big.Int) int64 { return new(big.Int).Quo(s, m.period).Int64() }

// shareOf returns floor(avail*ppm/1e6) exactly.
func shareOf(avail, ppm int64) int64 {
	p := new(big.Int).Mul(big.NewInt(avail), big.NewInt(ppm))
	return p.Quo(p, big.NewInt(1_000_000)).Int64()
}

// acquire applies one acquire at server time now (µs since the epoch).
func (m *model) acquire(now, want, min, ppm int64) Grant {
	s, t := m.refilled(now)
	avail := m.tokens(s)
	var granted int64
	if avail >= min {
		granted = shareOf(avail, ppm)
		if granted < min {
			granted = min
		}
		if granted > want {
			granted = want
		}
		s.Sub(s, new(big.Int).Mul(big.NewInt(granted), m.period))
		m.present, m.s, m.t = true, s, t
	}
	g := Grant{
		Granted:    granted,
		At:         now,
		Remaining:  m.tokens(s),
		ResetAfter: time.Duration(ceilDiv(new(big.Int).Sub(m.cap(), s), m.rate)) * time.Microsecond,
	}
	if granted == 0 {
		need := new(big.Int).Mul(big.NewInt(min), m.period)
		g.RetryAfter = time.Duration(ceilDiv(need.Sub(need, s), m.rate)) * time.Microsecond
	}
	return g
}

// refund applies one refund of n tokens at now and returns the whole tokens
// the bucket then holds.
func (m *model) refund(now, n int64) int64 {
	if !m.present {
		return m.burst.Int64()
	}
	s, t := m.refilled(now)
	s.Add(s, new(big.Int).Mul(big.NewInt(n), m.period))
	if s.Cmp(m.cap()) >= 0 {
		m.present = false
		return m.burst.Int64()
	}
	m.s, m.t = s, t
	return m.tokens(s)
}

// ttl is the TTL the scripts give a bucket after a write: the time until it
// is full again, rounded up to a millisecond, plus one second.
func (m *model) ttl() time.Duration {
	reset := ceilDiv(new(big.Int).Sub(m.cap(), m.s), m.rate) // µs
	return time.Duration((reset+999)/1000+1000) * time.Millisecond
}

// micros returns t as µs since the epoch, as the scripts compute it from TIME.
func micros(t time.Time) int64 { return t.UnixMicro() }

// ppmOf mirrors the conversion Acquire documents for share in (0, 1].
func ppmOf(share float64) int64 {
	p := int64(share * 1e6)
	if p < 1 {
		p = 1
	}
	if p > 1e6 {
		p = 1e6
	}
	return p
}
