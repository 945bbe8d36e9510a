package authority

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const maxMicros = int64(math.MaxInt64) / int64(time.Microsecond)

func TestDecodeRefGrant(t *testing.T) {
	good := []struct {
		in   any
		want Grant
	}{
		{[]any{int64(0), int64(0), int64(0), int64(0)}, Grant{}},
		{[]any{int64(3), int64(7), int64(0), int64(250000)}, grant(3, 7, 0, 250*ms)},
		{[]any{int64(0), int64(2), int64(100000), int64(300000)}, grant(0, 2, 100*ms, 300*ms)},
		{[]any{int64(0), int64(0), int64(1), int64(1)}, grant(0, 0, us, us)},
		{[]any{int64(1 << 53), int64(1 << 53), int64(0), int64(1 << 53)}, grant(1<<53, 1<<53, 0, (1<<53)*us)},
		{[]any{int64(0), int64(0), maxMicros, maxMicros}, grant(0, 0, time.Duration(maxMicros)*us, time.Duration(maxMicros)*us)},
	}
	for _, tc := range good {
		got, err := decodeRefGrant(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("decodeRefGrant(%#v) = %+v, %v; want %+v, nil", tc.in, got, err, tc.want)
		}
	}

	bad := []struct {
		name string
		in   any
	}{
		{"nil", nil},
		{"string", "OK"},
		{"int64", int64(1)},
		{"redis error value", redis.Nil},
		{"map", map[any]any{"granted": int64(1)}},
		{"empty array", []any{}},
		{"three elements", []any{int64(1), int64(2), int64(0)}},
		{"six elements", []any{int64(1), int64(2), int64(0), int64(0), int64(0), int64(0)}},
		{"a negative stamp", []any{int64(1), int64(2), int64(0), int64(0), int64(-1)}},
		{"string element", []any{"1", int64(2), int64(0), int64(0)}},
		{"string element last", []any{int64(1), int64(2), int64(0), "0"}},
		{"nil element", []any{int64(1), nil, int64(0), int64(0)}},
		{"int element", []any{1, int64(2), int64(0), int64(0)}},
		{"float element", []any{int64(1), int64(2), float64(0), int64(0)}},
		{"nested array", []any{int64(1), int64(2), []any{int64(0)}, int64(0)}},
		{"negative granted", []any{int64(-1), int64(2), int64(0), int64(0)}},
		{"negative retry", []any{int64(0), int64(2), int64(-1), int64(0)}},
		{"negative reset", []any{int64(0), int64(2), int64(0), math.MinInt64}},
		{"granted with retry", []any{int64(1), int64(0), int64(5), int64(0)}},
		{"granted with huge retry", []any{int64(1 << 40), int64(0), maxMicros, int64(0)}},
		{"retry out of range", []any{int64(0), int64(0), maxMicros + 1, int64(0)}},
		{"reset out of range", []any{int64(0), int64(0), int64(0), math.MaxInt64}},
		{"typed slice", []int64{1, 2, 0, 0}},
	}
	for _, tc := range bad {
		got, err := decodeRefGrant(tc.in)
		if !errors.Is(err, ErrReply) {
			t.Errorf("decodeRefGrant(%s: %#v) = %+v, %v; want an error wrapping ErrReply", tc.name, tc.in, got, err)
		}
		if got != (Grant{}) {
			t.Errorf("decodeRefGrant(%s) returned %+v with its error; want the zero Grant", tc.name, got)
		}
	}
}

// TestdecodeRefGrantDebt: a bucket in debt (negative remaining) decodes as
// holding none.
func TestDecodeRefGrantDebt(t *testing.T) {
	g, err := decodeRefGrant([]any{int64(0), int64(-2), int64(5), int64(9)})
	if err != nil || g.Remaining != 0 || g.RetryAfter != 5*time.Microsecond {
		t.Errorf("decodeRefGrant of a bucket in debt = %+v, %v; want Remaining 0", g, err)
	}
}

func TestDecodeRefund(t *testing.T) {
	rem, reset, err := decodeRefund([]any{int64(4), int64(100000)})
	if err != nil || rem != 4 || reset != 100*ms {
		t.Errorf("decodeRefund({4, 100000}) = %d, %v, %v", rem, reset, err)
	}
	if rem, _, err := decodeRefund([]any{int64(-3), int64(100000)}); err != nil || rem != -3 {
		t.Errorf("decodeRefund of a bucket in debt = %d, %v; want -3", rem, err)
	}
	for _, in := range []any{
		nil, "x", []any{}, []any{int64(1)}, []any{int64(1), int64(2), int64(3)},
		[]any{int64(1), int64(-1)}, []any{"1", int64(0)},
		[]any{int64(1), maxMicros + 1},
	} {
		if _, _, err := decodeRefund(in); !errors.Is(err, ErrReply) {
			t.Errorf("decodeRefund(%#v) err = %v; want ErrReply", in, err)
		}
	}
}

// fuzzReply builds a script reply of many shapes from fuzzed values.
func fuzzReply(kind uint8, a, b, c, d int64, s string) any {
	switch kind % 16 {
	case 0, 1, 2, 3: // the common shape, more often
		return []any{a, b, c, d}
	case 4:
		return []any{a, b, c}
	case 5:
		return []any{a, b, c, d, a, b}
	case 6:
		return s
	case 7:
		return a
	case 8:
		return nil
	case 9:
		return []any{a, s, c, d}
	case 10:
		return []any{a, b, c, float64(d)}
	case 11:
		return []any{a, b, []any{c}, d}
	case 12:
		return []any{}
	case 13:
		return []any{int(a), b, c, d}
	case 14:
		return []any{a, b, nil, d}
	default:
		return []any{a & 0xffff, b & 0xffff, c & 0xffff, d & 0xffff}
	}
}

func FuzzDecodeRefGrant(f *testing.F) {
	f.Add(uint8(0), int64(1), int64(2), int64(0), int64(3), "")
	f.Add(uint8(0), int64(0), int64(0), int64(5), int64(5), "")
	f.Add(uint8(0), int64(1), int64(0), int64(5), int64(0), "")
	f.Add(uint8(0), int64(-1), int64(0), int64(0), int64(0), "")
	f.Add(uint8(0), int64(0), int64(0), maxMicros, maxMicros+1, "")
	f.Add(uint8(6), int64(0), int64(0), int64(0), int64(0), "ERR")
	f.Add(uint8(9), int64(0), int64(0), int64(0), int64(0), "7")
	f.Fuzz(func(t *testing.T, kind uint8, a, b, c, d int64, s string) {
		in := fuzzReply(kind, a, b, c, d, s)
		g, err := decodeRefGrant(in)
		if err != nil {
			if !errors.Is(err, ErrReply) {
				t.Fatalf("decodeRefGrant(%#v) error %v does not wrap ErrReply", in, err)
			}
			if g != (Grant{}) {
				t.Fatalf("decodeRefGrant(%#v) returned %+v with its error", in, g)
			}
			return
		}
		if g.Granted < 0 || g.Remaining < 0 || g.RetryAfter < 0 || g.ResetAfter < 0 {
			t.Fatalf("decodeRefGrant(%#v) = %+v: negative field", in, g)
		}
		if g.Granted > 0 && g.RetryAfter != 0 {
			t.Fatalf("decodeRefGrant(%#v) = %+v: granted with a retry-after", in, g)
		}
		if g.RetryAfter%time.Microsecond != 0 || g.ResetAfter%time.Microsecond != 0 {
			t.Fatalf("decodeRefGrant(%#v) = %+v: durations not whole µs", in, g)
		}
		arr, ok := in.([]any)
		if !ok || len(arr) < 4 || len(arr) > 5 {
			t.Fatalf("decodeRefGrant accepted %#v", in)
		}
		var n [5]int64
		for i, e := range arr {
			x, ok := e.(int64)
			if !ok {
				t.Fatalf("decodeRefGrant accepted element %d of type %T in %#v", i, e, in)
			}
			n[i] = x
		}
		want := grant(n[0], n[1], time.Duration(n[2])*us, time.Duration(n[3])*us)
		want.At = n[4]
		if g != want {
			t.Fatalf("decodeRefGrant(%#v) = %+v; want %+v", in, g, want)
		}
	})
}

// TestdecodeRefGrantAcceptsEveryValidReply checks the converse of the fuzz
// target on a grid: every well-formed reply decodes.
func TestDecodeRefGrantAcceptsEveryValidReply(t *testing.T) {
	vals := []int64{0, 1, 2, 1000, 1 << 53, maxMicros}
	for _, a := range vals {
		for _, b := range vals {
			for _, c := range vals {
				for _, d := range vals {
					_, err := decodeRefGrant([]any{a, b, c, d})
					valid := !(a > 0 && c != 0)
					if (err == nil) != valid {
						t.Errorf("decodeRefGrant({%d %d %d %d}) err = %v; valid = %v", a, b, c, d, err, valid)
					}
				}
			}
		}
	}
}

// The head of a batch reply is the server's clock as TIME gave it, "<s>
// <us>"; a head that is not that, or past 2^53 µs, is a bad reply.
func TestDecodeBatchClock(t *testing.T) {
	good := []struct {
		in   string
		want int64
	}{
		{"0 0", 0},
		{"1733400000 5", 1733400000_000005},
		{"1733400000 999999 7 3", 1733400000_999999},
		{"9007199254 740991", 1<<53 - 1},
	}
	for _, tc := range good {
		if got, _, ok := clockOf(tc.in); !ok || got != tc.want {
			t.Errorf("clockOf(%q) = %d, %v; want %d, true", tc.in, got, ok, tc.want)
		}
	}
	for _, in := range []string{"", "1733400000", "1733400000 ", "1733400000123456", "x 5", "5 x",
		"-1 5", "5 -1", "5 1000000", "9007199254 740992", "9007199255 0", "1.5 3"} {
		if _, _, ok := clockOf(in); ok {
			t.Errorf("clockOf(%q) accepted", in)
		}
		if err := decodeBatch(in, nil, true); !errors.Is(err, ErrReply) {
			t.Errorf("decodeBatch(%q) = %v, want ErrReply", in, err)
		}
	}
}
