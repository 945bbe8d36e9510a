package authority

import (
	"math/big"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// model is a reference token bucket written from the documented semantics
// (DESIGN.md "Semantics" and the contracts at the top of acquire.lua and
// refund.lua), in exact integer arithmetic (math/big where a product may
// leave int64). It shares no code with the Lua scripts.
//
// The bucket holds s units, a token being period units; one µs adds rate
// units; at most burst·period units. A missing bucket is full.
type model struct {
	rate, period, burst int64 // period in µs
	present             bool
	s, t                int64 // units, µs
}

func newModel(l policy.Limit) *model {
	return &model{rate: l.Rate, period: l.PeriodMicros(), burst: l.Burst}
}

func (m *model) cap() int64 { return m.burst * m.period }

// refilled returns the units and timestamp the bucket holds at now, without
// changing the model. A clock that went backwards refills nothing and keeps
// the later timestamp.
func (m *model) refilled(now int64) (s, t int64) {
	c := m.cap()
	if !m.present {
		return c, now
	}
	s, t = m.s, m.t
	if s > c {
		s = c
	}
	if now > t {
		// elapsed*rate may leave int64: compare in big.Int.
		add := new(big.Int).Mul(big.NewInt(now-t), big.NewInt(m.rate))
		if add.Cmp(big.NewInt(c-s)) >= 0 {
			s = c
		} else {
			s += add.Int64()
		}
		t = now
	}
	return s, t
}

func ceilDiv(a, b int64) int64 {
	if a <= 0 {
		return 0
	}
	return (a + b - 1) / b
}

// shareOf returns floor(avail*ppm/1e6) exactly.
func shareOf(avail, ppm int64) int64 {
	p := new(big.Int).Mul(big.NewInt(avail), big.NewInt(ppm))
	return p.Quo(p, big.NewInt(1_000_000)).Int64()
}

// acquire applies one acquire at server time now (µs since the epoch).
func (m *model) acquire(now, want, min, ppm int64) Grant {
	s, t := m.refilled(now)
	avail := s / m.period
	var granted int64
	if avail >= min {
		granted = shareOf(avail, ppm)
		if granted < min {
			granted = min
		}
		if granted > want {
			granted = want
		}
		s -= granted * m.period
		m.present, m.s, m.t = true, s, t
	}
	g := Grant{
		Granted:    granted,
		Remaining:  s / m.period,
		ResetAfter: time.Duration(ceilDiv(m.cap()-s, m.rate)) * time.Microsecond,
	}
	if granted == 0 {
		g.RetryAfter = time.Duration(ceilDiv(min*m.period-s, m.rate)) * time.Microsecond
	}
	return g
}

// refund applies one refund of n tokens at now and returns the whole tokens
// the bucket then holds.
func (m *model) refund(now, n int64) int64 {
	if !m.present {
		return m.burst
	}
	s, t := m.refilled(now)
	// s + n*period may exceed int64 only for absurd limits; the limits used
	// in tests keep burst*period < 2^53, so it fits.
	s += n * m.period
	if s >= m.cap() {
		m.present = false
		return m.burst
	}
	m.s, m.t = s, t
	return s / m.period
}

// ttl is the TTL the scripts give a bucket after a write: the time until it
// is full again, rounded up to a millisecond, plus one second.
func (m *model) ttl() time.Duration {
	reset := ceilDiv(m.cap()-m.s, m.rate) // µs
	return time.Duration(ceilDiv(reset, 1000)+1000) * time.Millisecond
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
