package authority

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

var keyRE = regexp.MustCompile(`^([!-~]+):([A-Za-z0-9._-]+):([0-9]+/[0-9]+(?:d|h|m|s|ms|us)/[0-9]+):\{([0-9a-f]{32})\}$`)

// hostileKeys are user keys that must never leak into Redis keys.
var hostileKeys = []string{
	"",
	"alice",
	"{tag}",
	"}{",
	"a{b}c",
	"{}",
	"user:{123}:x",
	"\x00\x01\r\n\t\x7f",
	"\xff\xfe\xfd", // invalid UTF-8
	"\xc3\x28",     // invalid 2-byte sequence
	"emoji 🦀 ключ", // valid non-ASCII
	"*",            // glob characters
	"leaselimit:default:{00000000000000000000000000000000}",
	strings.Repeat("k", 4096),
	strings.Repeat("{\x00}", 1500),
}

// testPrefix is the prefix the tests' authorities write under.
const testPrefix = "leaselimit"

func TestKeyFormat(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { _ = c.Close() })
	r, err := New(c, testPrefix)
	if err != nil {
		t.Fatal(err)
	}
	if r.prefix != testPrefix || r.client != c {
		t.Errorf("prefix %q, client %v; want %q and the client given to New", r.prefix, r.client, testPrefix)
	}
	l := policy.PerSecond(10)
	seen := map[string]string{}
	for _, uk := range hostileKeys {
		k := r.Key(l, uk)
		m := keyRE.FindStringSubmatch(k)
		if m == nil {
			t.Errorf("Key(%q) = %q; want <prefix>:<name>:<rate>/<period>/<burst>:{<32 lowercase hex>}", uk, k)
			continue
		}
		if m[1] != testPrefix || m[2] != l.Name || m[3] != ParamsTag(l) {
			t.Errorf("Key(%q) = %q; want prefix %q and name %q", uk, k, testPrefix, l.Name)
		}
		sum := sha256.Sum256([]byte(uk))
		if m[4] != hex.EncodeToString(sum[:16]) {
			t.Errorf("Key(%q) digest %s; want the first 128 bits of SHA-256, %x", uk, m[4], sum[:16])
		}
		if len(k) != len(testPrefix)+1+len(l.Name)+1+len("10/1s/10")+1+34 {
			t.Errorf("Key(%q) has length %d", uk, len(k))
		}
		// The Cluster hash tag is the digest: the text between the first
		// '{' and the next '}'.
		open := strings.IndexByte(k, '{')
		if tag := k[open+1 : open+1+strings.IndexByte(k[open+1:], '}')]; tag != m[4] {
			t.Errorf("Key(%q) hash tag %q; want the digest", uk, tag)
		}
		if len(uk) >= 3 && strings.Contains(k, uk) && !keyRE.MatchString(uk) {
			t.Errorf("Key(%q) = %q contains the user key", uk, k)
		}
		if again := r.Key(l, uk); again != k {
			t.Errorf("Key(%q) not deterministic: %q then %q", uk, k, again)
		}
		if prev, dup := seen[k]; dup {
			t.Errorf("Key(%q) = Key(%q) = %q", uk, prev, k)
		}
		seen[k] = uk
	}

	// Another prefix, another limit name: another key for the same user key.
	r2, err := New(c, "app-1.v2")
	if err != nil {
		t.Fatal(err)
	}
	k1, k2, k3 := r.Key(l, "u"), r2.Key(l, "u"), r.Key(l.WithName("other"), "u")
	if k1 == k2 || k1 == k3 || k2 == k3 {
		t.Errorf("keys collide across prefixes or names: %q %q %q", k1, k2, k3)
	}
	if !strings.HasPrefix(k2, "app-1.v2:default:10/1s/10:{") {
		t.Errorf("Key with prefix app-1.v2 = %q", k2)
	}
	// Rate, period and burst are part of the key: a limit with the same
	// name but other parameters never reads another's bucket (its state is
	// in units of them).
	for _, other := range []policy.Limit{
		policy.PerMinute(10), policy.PerSecond(11), l.WithBurst(20),
		{Name: l.Name, Rate: 10, Period: time.Second + time.Microsecond, Burst: 10},
	} {
		if r.Key(l, "u") == r.Key(other, "u") {
			t.Errorf("Key(%v) = Key(%v) = %q", l, other, r.Key(l, "u"))
		}
	}
}

func TestParamsTag(t *testing.T) {
	for _, c := range []struct {
		l    policy.Limit
		want string
	}{
		{policy.PerSecond(10), "10/1s/10"},
		{policy.PerMinute(100).WithBurst(200), "100/1m/200"},
		{policy.PerHour(5), "5/1h/5"},
		{policy.PerDay(1000), "1000/1d/1000"},
		{policy.Limit{Name: "x", Rate: 3, Period: 1500 * time.Millisecond, Burst: 3}, "3/1500ms/3"},
		{policy.Limit{Name: "x", Rate: 1, Period: 7 * 24 * time.Hour, Burst: 1}, "1/7d/1"},
		{policy.Limit{Name: "x", Rate: 1, Period: 1001 * time.Microsecond, Burst: 2}, "1/1001us/2"},
		{policy.Limit{Name: "x", Rate: 1, Period: 90 * time.Minute, Burst: 2}, "1/90m/2"},
		{policy.Quota("d", 1, policy.Month, nil), "1/30d/1@month:UTC"},
		{policy.Quota("d", 10, policy.Day, time.UTC), "10/1d/10@day:UTC"},
	} {
		if got := ParamsTag(c.l); got != c.want {
			t.Errorf("ParamsTag(%v) = %q; want %q", c.l, got, c.want)
		}
	}
}

// suiteKeys checks that the keys Acquire writes are the keys Key returns,
// and that user bytes never reach Redis.
func suiteKeys(t *testing.T, nb backendFactory) {
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.PerSecond(10)
	var want []string
	for _, uk := range hostileKeys {
		k := r.Key(l, uk)
		if _, err := r.Acquire(context.Background(), k, l, 1, 1, 1); err != nil {
			t.Fatalf("Acquire for user key %q: %v", uk, err)
		}
		want = append(want, k)
	}
	got := b.keys(t)
	sort.Strings(want)
	if !reflect.DeepEqual(got, want) {
		t.Errorf("keys in Redis:\n%q\nwant:\n%q", got, want)
	}
	for _, k := range got {
		if !keyRE.MatchString(k) {
			t.Errorf("Redis holds key %q outside the key format", k)
		}
		if ttl := b.pttl(t, k); ttl <= 0 {
			t.Errorf("key %q has PTTL %v; every key must have a TTL", k, ttl)
		}
	}
}

func TestKeysInRedis(t *testing.T) { forEachBackend(t, suiteKeys) }

func TestValidatePrefix(t *testing.T) {
	good := []string{"a", "leaselimit", "app:rl", "A-Z_0.9~!#$%&*+/=?@[]^|", strings.Repeat("p", MaxPrefixLen)}
	bad := []string{"", " ", "a b", " a", "a ", "{", "}", "a{b", "a}b", "{a}", "a\tb", "a\nb", "\x00",
		"a\x7f", "é", "\xff", strings.Repeat("p", MaxPrefixLen+1), strings.Repeat("p", 1000)}
	for _, p := range good {
		if err := ValidatePrefix(p); err != nil {
			t.Errorf("ValidatePrefix(%q) = %v; want nil", p, err)
		}
	}
	for _, p := range bad {
		err := ValidatePrefix(p)
		if !errors.Is(err, ErrPrefix) {
			t.Errorf("ValidatePrefix(%q) = %v; want an error wrapping ErrPrefix", p, err)
		}
	}
}

func TestNew(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { _ = c.Close() })
	if r, err := New(nil, testPrefix); err == nil || r != nil {
		t.Errorf("New(nil) = %v, %v; want an error", r, err)
	}
	var unset *redis.Client // a non-nil interface holding a nil pointer
	if r, err := New(unset, testPrefix); err == nil || r != nil {
		t.Errorf("New((*redis.Client)(nil)) = %v, %v; want an error", r, err)
	}
	for _, p := range []string{"", "a b", "{x}", strings.Repeat("p", MaxPrefixLen+1)} {
		if r, err := New(c, p); !errors.Is(err, ErrPrefix) || r != nil {
			t.Errorf("New(c, %q) = %v, %v; want ErrPrefix", p, r, err)
		}
	}
	r, err := New(c, "x")
	if err != nil || r.prefix != "x" {
		t.Fatalf("New(c, %q) = %v, %v", "x", r, err)
	}
}

// TestNamer: Namer(l).Key is Key, in one allocation whatever the user
// key's length.
func TestNamer(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { _ = c.Close() })
	r, err := New(c, testPrefix)
	if err != nil {
		t.Fatal(err)
	}
	l := policy.Quota("q", 100, policy.Day, nil)
	n := r.Namer(l)
	for _, uk := range hostileKeys {
		if got, want := n.Key(uk), r.Key(l, uk); got != want {
			t.Errorf("Namer.Key(%q) = %q; Key gives %q", uk, got, want)
		}
	}
	long := strings.Repeat("k", 4096)
	if allocs := testing.AllocsPerRun(100, func() { _ = n.Key(long) }); allocs != 1 {
		t.Errorf("Namer.Key allocates %v times; want 1", allocs)
	}
}

// TestResendKey: a resend key is the prefix, ":batch:", the bucket key's
// hash tag in braces, then an id of kind "b" (nextID's form), new on
// every call, whatever the sequence number's length.
func TestResendKey(t *testing.T) {
	r := &Redis{prefix: "pfx", idBase: "0a1b-"}
	for _, tc := range []struct {
		key, tag string
		seq      uint64
	}{
		{"pfx:n:1/1s/1:{0123abcd}", "0123abcd", 0},
		{"plain", "plain", 35},
		{"a{}b{c}", "a{}b{c}", 1 << 40},
		{"x{tag}y", "tag", ^uint64(0) - 1}, // the next id is the longest in base 36
	} {
		r.seq.Store(tc.seq)
		got := r.resendKey(tc.key)
		want := "pfx:batch:{" + tc.tag + "}:0a1b-b" + strconv.FormatUint(tc.seq+1, 36)
		if got != want {
			t.Errorf("resendKey(%q) at %d = %q, want %q", tc.key, tc.seq, got, want)
		}
		if again := r.resendKey(tc.key); again == got {
			t.Errorf("resendKey(%q) repeated %q", tc.key, got)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _ = r.resendKey("k{t}") }); n != 1 {
		t.Errorf("resendKey allocates %v times, want 1", n)
	}
}
