package policy_test

import (
	"errors"
	"math"
	"math/big"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

const two53 = int64(1) << 53

// exactBound reports whether burst × period-µs + rate < 2^53, computed
// without overflow.
// exactBound reports whether l is in the documented exact range.
func exactBound(l policy.Limit) bool {
	return l.Rate <= policy.MaxRate && l.Burst <= policy.MaxRate && l.Period <= policy.MaxPeriod
}

func lim(name string, rate int64, period time.Duration, burst int64) policy.Limit {
	return policy.Limit{Name: name, Rate: rate, Period: period, Burst: burst}
}

func TestLimitValidate(t *testing.T) {
	const us = time.Microsecond
	tests := []struct {
		name    string
		l       policy.Limit
		ok      bool
		mention string // a word the error must contain
	}{
		{"per second", policy.PerSecond(100), true, ""},
		{"per minute", policy.PerMinute(1), true, ""},
		{"per hour", policy.PerHour(3600), true, ""},
		{"burst above rate", policy.PerSecond(10).WithBurst(1000), true, ""},
		{"burst below rate", policy.PerSecond(1000).WithBurst(1), true, ""},
		{"period 1µs", lim("a", 1, us, 1), true, ""},
		{"period 1500µs", lim("a", 1, 1500*us, 1), true, ""},

		{"rate 0", lim("a", 0, time.Second, 1), false, "rate"},
		{"rate -1", lim("a", -1, time.Second, 1), false, "rate"},
		{"rate MinInt64", lim("a", math.MinInt64, time.Second, 1), false, "rate"},
		{"burst 0", lim("a", 1, time.Second, 0), false, "burst"},
		{"burst -1", lim("a", 1, time.Second, -1), false, "burst"},
		{"burst MinInt64", lim("a", 1, time.Second, math.MinInt64), false, "burst"},
		{"period 0", lim("a", 1, 0, 1), false, "period"},
		{"period -1s", lim("a", 1, -time.Second, 1), false, "period"},
		{"period 1ns", lim("a", 1, time.Nanosecond, 1), false, "period"},
		{"period 999ns", lim("a", 1, 999*time.Nanosecond, 1), false, "period"},
		{"period 1.5µs", lim("a", 1, 1500*time.Nanosecond, 1), false, "period"},
		{"period 1s+1ns", lim("a", 1, time.Second+time.Nanosecond, 1), false, "period"},

		{"name empty", lim("", 1, time.Second, 1), false, "name"},
		{"zero Limit", policy.Limit{}, false, "zero Limit"},
		{"name 64 bytes", lim(strings.Repeat("n", 64), 1, time.Second, 1), true, ""},
		{"name 65 bytes", lim(strings.Repeat("n", 65), 1, time.Second, 1), false, "name"},
		{"name all allowed bytes", lim("azAZ09-_.", 1, time.Second, 1), true, ""},
		{"name colon", lim("a:b", 1, time.Second, 1), false, "name"},
		{"name open brace", lim("a{b", 1, time.Second, 1), false, "name"},
		{"name close brace", lim("a}b", 1, time.Second, 1), false, "name"},
		{"name space", lim("a b", 1, time.Second, 1), false, "name"},
		{"name newline", lim("a\nb", 1, time.Second, 1), false, "name"},
		{"name NUL", lim("a\x00b", 1, time.Second, 1), false, "name"},
		{"name slash", lim("a/b", 1, time.Second, 1), false, "name"},
		{"name non-ASCII", lim("café", 1, time.Second, 1), false, "name"},
		{"name invalid UTF-8", lim("a\xffb", 1, time.Second, 1), false, "name"},
		{"name checked first", lim("", 0, 0, 0), false, "name"},

		// The exact range: rate and burst up to MaxRate, period up to
		// MaxPeriod. Daily quotas the old rule (burst × period-µs + rate
		// < 2^53) refused are valid.
		{"104250 per day", policy.PerDay(104_250), true, ""},
		{"1e12 per day", policy.PerDay(1e12), true, ""},
		{"2.5e6 per hour", policy.PerHour(2_500_001), true, ""},
		{"MaxRate per MaxPeriod", lim("a", policy.MaxRate, policy.MaxPeriod, policy.MaxRate), true, ""},
		{"MaxRate per 1µs", lim("a", policy.MaxRate, us, policy.MaxRate), true, ""},
		{"rate above MaxRate", lim("a", policy.MaxRate+1, time.Second, 1), false, "at most"},
		{"burst above MaxRate", lim("a", 1, time.Second, policy.MaxRate+1), false, "at most"},
		{"rate MaxInt64", lim("a", math.MaxInt64, time.Second, 1), false, "at most"},
		{"burst MaxInt64", lim("a", 1, us, math.MaxInt64), false, "at most"},
		{"period above MaxPeriod", lim("a", 1, policy.MaxPeriod+us, 1), false, "at most"},
		{"period MaxInt64", lim("a", 1, time.Duration(math.MaxInt64/1000*1000), 1), false, "at most"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.l.Validate()
			if tc.ok {
				if err != nil {
					t.Fatalf("Validate(%+v) = %v, want nil", tc.l, err)
				}
				if !exactBound(tc.l) {
					t.Fatalf("test case %+v breaks the precision bound but is expected valid", tc.l)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate(%+v) = nil, want an error", tc.l)
			}
			if !errors.Is(err, policy.ErrInvalidLimit) {
				t.Errorf("Validate(%+v) = %v, does not wrap ErrInvalidLimit", tc.l, err)
			}
			if tc.mention != "" && !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("Validate(%+v) = %q, want it to mention %q", tc.l, err, tc.mention)
			}
		})
	}
}

func TestValidateName(t *testing.T) {
	for _, n := range []string{"a", "default", strings.Repeat("x", policy.MaxNameLen), "api.v1-login_attempts"} {
		if err := policy.ValidateName(n); err != nil {
			t.Errorf("ValidateName(%q) = %v, want nil", n, err)
		}
	}
	for _, n := range []string{"", strings.Repeat("x", policy.MaxNameLen+1), "a:b", "{a}", " ", "\n", "\t", "ü", "日本", "a*b", "a\x7fb"} {
		err := policy.ValidateName(n)
		if err == nil {
			t.Errorf("ValidateName(%q) = nil, want an error", n)
			continue
		}
		if !errors.Is(err, policy.ErrInvalidLimit) {
			t.Errorf("ValidateName(%q) = %v, does not wrap ErrInvalidLimit", n, err)
		}
	}
	// Every single byte: only the documented set is accepted.
	for c := 0; c < 256; c++ {
		want := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.'
		got := policy.ValidateName(string([]byte{byte(c)})) == nil
		if got != want {
			t.Errorf("ValidateName(%q) accepted = %v, want %v", byte(c), got, want)
		}
	}
}

func TestConstructors(t *testing.T) {
	tests := []struct {
		got  policy.Limit
		want policy.Limit
	}{
		{policy.PerSecond(100), policy.Limit{Name: "default", Rate: 100, Period: time.Second, Burst: 100}},
		{policy.PerMinute(7), policy.Limit{Name: "default", Rate: 7, Period: time.Minute, Burst: 7}},
		{policy.PerHour(1), policy.Limit{Name: "default", Rate: 1, Period: time.Hour, Burst: 1}},
		{policy.PerSecond(5).WithBurst(9), policy.Limit{Name: "default", Rate: 5, Period: time.Second, Burst: 9}},
		{policy.PerSecond(5).WithName("x"), policy.Limit{Name: "x", Rate: 5, Period: time.Second, Burst: 5}},
	}
	for _, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("got %+v, want %+v", tc.got, tc.want)
		}
		if err := tc.got.Validate(); err != nil {
			t.Errorf("Validate(%+v) = %v", tc.got, err)
		}
	}
	// WithBurst and WithName return copies.
	base := policy.PerSecond(5)
	_ = base.WithBurst(1).WithName("other")
	if base != policy.PerSecond(5) {
		t.Errorf("WithBurst/WithName modified the receiver: %+v", base)
	}
	// Zero and negative n make invalid limits, not panics.
	for _, l := range []policy.Limit{policy.PerSecond(0), policy.PerMinute(-1), policy.PerHour(0)} {
		if err := l.Validate(); !errors.Is(err, policy.ErrInvalidLimit) {
			t.Errorf("Validate(%+v) = %v, want ErrInvalidLimit", l, err)
		}
	}
}

func TestPeriodMicros(t *testing.T) {
	for _, tc := range []struct {
		p    time.Duration
		want int64
	}{
		{time.Second, 1_000_000},
		{time.Minute, 60_000_000},
		{time.Hour, 3_600_000_000},
		{time.Microsecond, 1},
		{1500 * time.Nanosecond, 1},
		{0, 0},
	} {
		if got := (policy.Limit{Period: tc.p}).PeriodMicros(); got != tc.want {
			t.Errorf("PeriodMicros(%v) = %d, want %d", tc.p, got, tc.want)
		}
	}
}

func TestLimitString(t *testing.T) {
	tests := []struct {
		l    policy.Limit
		want string
	}{
		{policy.PerSecond(100), "default: 100/1s burst=100"},
		{policy.PerMinute(5), "default: 5/1m0s burst=5"},
		{policy.PerHour(2).WithBurst(10).WithName("login"), "login: 2/1h0m0s burst=10"},
		{lim("x", 3, 1500*time.Microsecond, 4), "x: 3/1.5ms burst=4"},
		{policy.Limit{}, ": 0/0s burst=0"},
	}
	for _, tc := range tests {
		if got := tc.l.String(); got != tc.want {
			t.Errorf("String(%+v) = %q, want %q", tc.l, got, tc.want)
		}
	}
}

func TestInterval(t *testing.T) {
	const us = time.Microsecond
	tests := []struct {
		l    policy.Limit
		n    int64
		want time.Duration
	}{
		{policy.PerSecond(3), 1, 333334 * us}, // 333333.33… rounded up
		{policy.PerSecond(3), 2, 666667 * us}, // 666666.67… rounded up
		{policy.PerSecond(3), 3, time.Second},
		{policy.PerSecond(3), 4, 1333334 * us},
		{policy.PerSecond(3), 0, 0},
		{policy.PerSecond(3), -1, 0},
		{policy.PerSecond(3), math.MinInt64, 0},
		{policy.PerSecond(1), 1, time.Second},
		{policy.PerSecond(100), 1, 10 * time.Millisecond},
		{policy.PerSecond(100), 250, 2500 * time.Millisecond},
		{policy.PerSecond(7), 1, 142858 * us}, // 142857.14…
		{policy.PerMinute(1), 1, time.Minute},
		{policy.PerMinute(7), 1, 8571429 * us}, // 8571428.57…
		{policy.PerHour(1), 2, 2 * time.Hour},
		{policy.PerSecond(3_000_000), 1, 1 * us}, // 1/3 µs rounded up to 1µs
		{policy.PerSecond(3_000_000), 3, 1 * us},
		{policy.PerSecond(3_000_000), 4, 2 * us},
		{lim("a", 1, us, 1), 5, 5 * us},
		{lim("a", 0, time.Second, 1), 1, 0},
		{lim("a", -3, time.Second, 1), 1, 0},
		// Saturates instead of overflowing.
		{policy.PerHour(1), math.MaxInt64, time.Duration(math.MaxInt64)},
		{policy.PerHour(1), 1 << 40, time.Duration(math.MaxInt64)},
	}
	for _, tc := range tests {
		if got := tc.l.Interval(tc.n); got != tc.want {
			t.Errorf("%v: Interval(%d) = %v (%dns), want %v", tc.l, tc.n, got, int64(got), tc.want)
		}
	}
}

// TestIntervalExact checks Interval against ceil(n × period-µs / rate) µs,
// computed exactly, for random valid limits and 1 <= n <= Burst.
func TestIntervalExact(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	check := func(l policy.Limit, n int64) {
		t.Helper()
		num := new(big.Int).Mul(big.NewInt(n), big.NewInt(l.PeriodMicros()))
		den := big.NewInt(l.Rate)
		q, m := new(big.Int).QuoRem(num, den, new(big.Int))
		if m.Sign() > 0 {
			q.Add(q, big.NewInt(1))
		}
		want := time.Duration(math.MaxInt64)
		if q.Cmp(big.NewInt(math.MaxInt64/int64(time.Microsecond))) <= 0 {
			want = time.Duration(q.Int64()) * time.Microsecond
		}
		if got := l.Interval(n); got != want {
			t.Fatalf("%v: Interval(%d) = %v, want %v", l, n, got, want)
		}
		// It is the least whole-µs duration in which n tokens arrive.
		if got := l.Interval(n); got > 0 && got < time.Duration(math.MaxInt64) {
			prev := new(big.Int).Mul(big.NewInt(int64(got/time.Microsecond)-1), den)
			if prev.Cmp(num) >= 0 {
				t.Fatalf("%v: Interval(%d) = %v is not the least duration", l, n, got)
			}
		}
	}
	for i := 0; i < 20000; i++ {
		var l policy.Limit
		for {
			p := time.Duration(1+r.Int64N(1<<uint(r.IntN(49)))) * time.Microsecond
			l = lim("a", 1+r.Int64N(1<<uint(r.IntN(51))), p, 1+r.Int64N(1<<uint(r.IntN(51))))
			if l.Validate() == nil {
				break
			}
		}
		check(l, 1)
		check(l, l.Burst)
		check(l, 1+r.Int64N(l.Burst))
	}
	// Limits at the edge of the range.
	check(lim("a", 1, time.Microsecond, policy.MaxRate), policy.MaxRate)
	check(lim("a", 3, policy.MaxPeriod, policy.MaxRate), policy.MaxRate)
	check(lim("a", 999_999_937, time.Second, 9_007_198_254), 9_007_198_254)
}

// TestIntervalNeverNegative: Interval is documented as a duration; beyond
// the range it can represent it must saturate, never wrap around.
func TestIntervalNeverNegative(t *testing.T) {
	// MaxInt64/1000 µs is not representable as a float64; the nearest double
	// is 9223372036854776, whose ×1000 overflows int64.
	for _, tc := range []struct {
		l policy.Limit
		n int64
	}{
		{lim("a", 1, time.Microsecond, 1), 9223372036854775},
		{lim("a", 1, time.Microsecond, 1), 9223372036854776},
		{lim("a", 1, time.Microsecond, 1), 9223372036854777},
		{lim("a", 1, time.Microsecond, 1), math.MaxInt64},
		{lim("a", 2, 2*time.Microsecond, 1), 9223372036854776},
	} {
		if got := tc.l.Interval(tc.n); got < 0 {
			t.Errorf("%v: Interval(%d) = %v (%dns), want >= 0 (saturated)", tc.l, tc.n, got, int64(got))
		}
	}
}

func TestFailureMode(t *testing.T) {
	tests := []struct {
		m    policy.FailureMode
		s    string
		okay bool
	}{
		{policy.FailOpen, "open", true},
		{policy.FailClosed, "closed", true},
		{policy.FailLocal, "local", true},
		{policy.FailureMode(3), "FailureMode(3)", false},
		{policy.FailureMode(-1), "FailureMode(-1)", false},
		{policy.FailureMode(math.MaxInt32), "FailureMode(2147483647)", false},
	}
	for _, tc := range tests {
		if got := tc.m.String(); got != tc.s {
			t.Errorf("FailureMode(%d).String() = %q, want %q", int(tc.m), got, tc.s)
		}
		err := tc.m.Validate()
		if tc.okay && err != nil {
			t.Errorf("FailureMode(%d).Validate() = %v, want nil", int(tc.m), err)
		}
		if !tc.okay && !errors.Is(err, policy.ErrInvalidLimit) {
			t.Errorf("FailureMode(%d).Validate() = %v, want ErrInvalidLimit", int(tc.m), err)
		}
		// Regression: it said "policy: invalid limit: unknown failure mode 7".
		if !tc.okay && err != nil && (strings.Contains(err.Error(), "invalid limit") || !strings.Contains(err.Error(), "FailClosed")) {
			t.Errorf("FailureMode(%d).Validate() = %q, want it to name the modes and no limit", int(tc.m), err)
		}
	}
	var zero policy.FailureMode
	if zero != policy.FailOpen {
		t.Errorf("zero FailureMode = %v, want FailOpen (the default)", zero)
	}
}

func TestDefaultLease(t *testing.T) {
	d := policy.DefaultLease()
	want := policy.Lease{
		MaxTokens: 100_000,
		Horizon:   250 * time.Millisecond,
		TTL:       2 * time.Second,
		MaxShare:  0.5,
		Prefetch:  0.25,
		DenyCap:   time.Second,
		IdleTTL:   30 * time.Second,
	}
	if d != want {
		t.Errorf("DefaultLease() = %+v, want %+v", d, want)
	}
	if err := d.Validate(); err != nil {
		t.Errorf("DefaultLease().Validate() = %v", err)
	}
	if got := (policy.Lease{}).WithDefaults(); got != want {
		t.Errorf("Lease{}.WithDefaults() = %+v, want %+v", got, want)
	}
}

func TestLeaseWithDefaults(t *testing.T) {
	d := policy.DefaultLease()
	// Each non-zero field is kept, each zero field defaulted.
	custom := policy.Lease{
		MaxTokens: 7,
		Horizon:   time.Millisecond,
		TTL:       2 * time.Second,
		MaxShare:  0.1,
		Prefetch:  -1,
		DenyCap:   5 * time.Second,
		IdleTTL:   time.Minute,
	}
	if got := custom.WithDefaults(); got != custom {
		t.Errorf("WithDefaults kept %+v as %+v", custom, got)
	}
	tests := []struct {
		in   policy.Lease
		want policy.Lease
	}{
		{policy.Lease{MaxTokens: 5}, func() policy.Lease { l := d; l.MaxTokens = 5; return l }()},
		{policy.Lease{Horizon: time.Second}, func() policy.Lease { l := d; l.Horizon = time.Second; return l }()},
		{policy.Lease{TTL: 3 * time.Second}, func() policy.Lease { l := d; l.TTL = 3 * time.Second; return l }()},
		{policy.Lease{MaxShare: 1}, func() policy.Lease { l := d; l.MaxShare = 1; return l }()},
		{policy.Lease{Prefetch: -0.5}, func() policy.Lease { l := d; l.Prefetch = -0.5; return l }()},
		{policy.Lease{DenyCap: time.Minute}, func() policy.Lease { l := d; l.DenyCap = time.Minute; return l }()},
		{policy.Lease{IdleTTL: time.Hour}, func() policy.Lease { l := d; l.IdleTTL = time.Hour; return l }()},
		// Negative values are kept (and rejected by Validate), not defaulted.
		{policy.Lease{MaxTokens: -1}, func() policy.Lease { l := d; l.MaxTokens = -1; return l }()},
		{policy.Lease{TTL: -1}, func() policy.Lease { l := d; l.TTL = -1; return l }()},
	}
	for _, tc := range tests {
		if got := tc.in.WithDefaults(); got != tc.want {
			t.Errorf("%+v.WithDefaults() = %+v, want %+v", tc.in, got, tc.want)
		}
		// Idempotent.
		if got := tc.in.WithDefaults().WithDefaults(); got != tc.want {
			t.Errorf("WithDefaults is not idempotent on %+v", tc.in)
		}
	}
}

func TestLeaseValidate(t *testing.T) {
	nan := math.NaN()
	inf := math.Inf(1)
	tests := []struct {
		name    string
		s       policy.Lease
		ok      bool
		mention string
	}{
		{"zero value", policy.Lease{}, true, ""},
		{"defaults", policy.DefaultLease(), true, ""},
		{"MaxTokens 1", policy.Lease{MaxTokens: 1}, true, ""},
		{"MaxTokens -1", policy.Lease{MaxTokens: -1}, false, "MaxTokens"},
		{"MaxTokens MinInt64", policy.Lease{MaxTokens: math.MinInt64}, false, "MaxTokens"},
		{"Horizon 1ns", policy.Lease{Horizon: 1}, true, ""},
		{"Horizon -1ns", policy.Lease{Horizon: -1}, false, "Horizon"},
		{"TTL 1ms", policy.Lease{TTL: time.Millisecond}, true, ""},
		{"TTL 999µs", policy.Lease{TTL: 999 * time.Microsecond}, false, "TTL"},
		{"TTL MaxLeaseTTL", policy.Lease{TTL: policy.MaxLeaseTTL, IdleTTL: policy.MaxLeaseTTL}, true, ""},
		{"TTL above MaxLeaseTTL", policy.Lease{TTL: policy.MaxLeaseTTL + 1, IdleTTL: math.MaxInt64}, false, "MaxLeaseTTL"},
		{"TTL MaxInt64", policy.Lease{TTL: math.MaxInt64, IdleTTL: math.MaxInt64}, false, "MaxLeaseTTL"},
		{"TTL -1s", policy.Lease{TTL: -time.Second}, false, "TTL"},
		{"TTL equals IdleTTL", policy.Lease{TTL: time.Minute, IdleTTL: time.Minute}, true, ""},
		{"TTL above default IdleTTL", policy.Lease{TTL: time.Minute}, false, "IdleTTL"},
		{"IdleTTL below TTL", policy.Lease{TTL: 2 * time.Second, IdleTTL: time.Second}, false, "IdleTTL"},
		{"IdleTTL negative", policy.Lease{IdleTTL: -1}, false, "IdleTTL"},
		{"MaxShare 1", policy.Lease{MaxShare: 1}, true, ""},
		{"MaxShare tiny", policy.Lease{MaxShare: 1e-9}, true, ""},
		{"MaxShare 1.0001", policy.Lease{MaxShare: 1.0001}, false, "MaxShare"},
		{"MaxShare -0.5", policy.Lease{MaxShare: -0.5}, false, "MaxShare"},
		{"MaxShare NaN", policy.Lease{MaxShare: nan}, false, "MaxShare"},
		{"MaxShare +Inf", policy.Lease{MaxShare: inf}, false, "MaxShare"},
		{"Prefetch 0.99", policy.Lease{Prefetch: 0.99}, true, ""},
		{"Prefetch negative disables", policy.Lease{Prefetch: -1}, true, ""},
		{"Prefetch -Inf", policy.Lease{Prefetch: math.Inf(-1)}, true, ""},
		{"Prefetch 1", policy.Lease{Prefetch: 1}, false, "Prefetch"},
		{"Prefetch 2", policy.Lease{Prefetch: 2}, false, "Prefetch"},
		{"Prefetch NaN", policy.Lease{Prefetch: nan}, false, "Prefetch"},
		{"Prefetch +Inf", policy.Lease{Prefetch: inf}, false, "Prefetch"},
		{"DenyCap 1ns", policy.Lease{DenyCap: 1}, true, ""},
		{"DenyCap -1ns", policy.Lease{DenyCap: -1}, false, "DenyCap"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.s.Validate()
			if tc.ok {
				if err != nil {
					t.Fatalf("Validate(%+v) = %v, want nil", tc.s, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate(%+v) = nil, want an error", tc.s)
			}
			if !errors.Is(err, policy.ErrInvalidLimit) {
				t.Errorf("Validate(%+v) = %v, does not wrap ErrInvalidLimit", tc.s, err)
			}
			if !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("Validate(%+v) = %q, want it to mention %q", tc.s, err, tc.mention)
			}
			// A lease setting is not a limit. Regression: the text said
			// "policy: invalid limit: lease TTL ...".
			if !strings.HasPrefix(err.Error(), "policy: invalid setting: lease ") {
				t.Errorf("Validate(%+v) = %q, want it to start \"policy: invalid setting: lease \"", tc.s, err)
			}
		})
	}
}

func FuzzLimitValidate(f *testing.F) {
	f.Add("default", int64(100), int64(time.Second), int64(100))
	f.Add("", int64(0), int64(0), int64(0))
	f.Add("a", int64(1), int64(time.Microsecond), two53-2)
	f.Add("a", two53-2, int64(time.Microsecond), int64(1))
	f.Add("a", int64(1), int64(time.Second), (two53-2)/1_000_000)
	f.Add("a", int64(1), int64(time.Second), (two53-2)/1_000_000+1)
	f.Add("a:b", int64(1), int64(time.Second), int64(1))
	f.Add("a", int64(-1), int64(-1), int64(-1))
	f.Add("a", int64(math.MaxInt64), int64(math.MaxInt64), int64(math.MaxInt64))
	f.Add("a", int64(1), int64(1500), int64(1))
	f.Fuzz(func(t *testing.T, name string, rate, period, burst int64) {
		l := policy.Limit{Name: name, Rate: rate, Period: time.Duration(period), Burst: burst}
		err := l.Validate()
		_ = l.String()
		_ = l.Interval(burst)
		if err != nil {
			if !errors.Is(err, policy.ErrInvalidLimit) {
				t.Fatalf("Validate(%+v) = %v, does not wrap ErrInvalidLimit", l, err)
			}
			return
		}
		if l.Rate <= 0 || l.Burst <= 0 || l.Period <= 0 {
			t.Fatalf("Validate(%+v) = nil with a non-positive field", l)
		}
		if l.Period%time.Microsecond != 0 {
			t.Fatalf("Validate(%+v) = nil with a period that is not whole µs", l)
		}
		if policy.ValidateName(l.Name) != nil {
			t.Fatalf("Validate(%+v) = nil with an invalid name", l)
		}
		if !exactBound(l) {
			t.Fatalf("Validate(%+v) = nil outside the documented range", l)
		}
		// A valid limit's intervals are non-negative and exact for n <= Burst.
		if iv := l.Interval(l.Burst); iv < 0 {
			t.Fatalf("%v: Interval(Burst) = %v < 0", l, iv)
		}
	})
}
