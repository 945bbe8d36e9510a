package fields

import (
	"math/big"
	"math/bits"
	"strconv"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// paramBurst is the RateLimit-Policy parameter that carries the bucket's
// capacity when it differs from q. draft-ietf-httpapi-ratelimit-headers-10,
// Section 3.1: "Other parameters are allowed and can be regarded as
// comments. Implementation- or service-specific parameters SHOULD be
// prefixed parameters with a vendor identifier, e.g. acme-policy,
// acme-burst."
const paramBurst = "leaselimit-burst"

// policyMember returns the RateLimit-Policy member of l:
//
//	"<name>";q=<tokens>;w=<seconds>[;leaselimit-burst=<Burst>]
//
// q/w is l's sustained rate (see sustained), so a client that paces itself
// to q requests per w seconds once its burst is spent is not refused.
// leaselimit-burst is the most the bucket holds, present only when that is
// not q (a client may spend q at once when it is absent).
func policyMember(l policy.Limit) string {
	q, w := sustained(l)
	b := AppendString(make([]byte, 0, 96), l.Name)
	b = append(b, ";q="...)
	b = strconv.AppendInt(b, q, 10)
	b = append(b, ";w="...)
	b = strconv.AppendInt(b, w, 10)
	if burst := min(max(l.Burst, 0), MaxInt); burst != q {
		b = append(b, ';')
		b = append(b, paramBurst...)
		b = append(b, '=')
		b = strconv.AppendInt(b, burst, 10)
	}
	return string(b)
}

// microsPerSecond is a second in the microseconds of policy.Limit.Period.
const microsPerSecond = int64(time.Second / time.Microsecond)

// sustained returns q tokens per w seconds, both Structured Field Integers
// (w >= 1), with q/w equal to l's sustained rate, Rate per Period: w is the
// shortest whole number of seconds that is a whole number of Periods, and
// q the tokens those Periods add (PerMinute(100): q=100, w=60; 5 per
// 100 ms: q=50, w=1; 7 per 1.5 s: q=14, w=3). A calendar quota's Period is
// its window's usual length, so it gets its tokens per window (a month
// counts 30 days). Only when q would not fit in 15 digits is q/w rounded
// down, never up: a client that paces to it never outruns the bucket.
// Invalid limits get q=0.
func sustained(l policy.Limit) (q, w int64) {
	period := l.PeriodMicros()
	if l.Rate <= 0 || period <= 0 {
		return 0, max(CeilSeconds(l.Period), 1)
	}
	g := gcd(period, microsPerSecond)
	w = period / g // whole seconds: lcm(Period, 1 s) / 1 s
	if hi, lo := bits.Mul64(uint64(l.Rate), uint64(microsPerSecond/g)); hi == 0 && lo <= MaxInt {
		return int64(lo), w
	}
	// More than 15 digits of tokens in that window. The rate per second,
	// num/den, is at least 3 (q exceeded MaxInt in at most MaxPeriod); take
	// the longest window whose tokens fit, and round them down.
	num := new(big.Int).Mul(big.NewInt(l.Rate), big.NewInt(microsPerSecond))
	den := big.NewInt(period)
	perSecond := new(big.Int).Add(num, new(big.Int).Sub(den, big.NewInt(1)))
	perSecond.Quo(perSecond, den) // rounded up
	max15 := big.NewInt(MaxInt)
	if perSecond.Cmp(max15) >= 0 {
		return MaxInt, 1
	}
	w = MaxInt / perSecond.Int64()
	tokens := new(big.Int).Mul(num, big.NewInt(w))
	tokens.Quo(tokens, den) // rounded down
	return min(tokens.Int64(), MaxInt), w
}

func gcd(a, b int64) int64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}
