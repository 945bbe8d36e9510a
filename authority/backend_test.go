package authority

import (
	"context"
	"math/big"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// TestMain fails the package if a test leaves a goroutine behind (clients,
// miniredis servers and redis-server helpers must all be cleaned up).
func TestMain(m *testing.M) {
	redistest.VerifyTestMain(m)
}

// t0 is the server time at which every step table starts.
var t0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

// backend is one Redis the behavioural suite runs on: miniredis, whose TIME
// (the clock the scripts read) is set exactly with SetTime, or a real
// redis-server, whose clock cannot be set. On a real server setTime emulates
// the clock by shifting the stored timestamp ("t") of every bucket, so the
// scripts see the intended elapsed time plus the real time the test has
// taken so far; slack bounds that extra time.
type backend struct {
	name   string
	client redis.UniversalClient
	mini   *miniredis.Miniredis // nil on a real server
	rec    *recorder            // every command the client sent

	mu   sync.Mutex
	cur  time.Time // the emulated server time
	born time.Time // wall clock when the backend was set up
}

// exact reports whether scripts see exactly the time given to setTime.
func (b *backend) exact() bool { return b.mini != nil }

// slack bounds how much later than the time given to setTime the scripts'
// clock may be: zero on miniredis, the real time elapsed since the backend
// was set up (plus a little for clock granularity) on a real server.
func (b *backend) slack() time.Duration {
	if b.exact() {
		return 0
	}
	return time.Since(b.born) + time.Millisecond
}

// newMiniBackend returns a backend on a fresh miniredis with its clock at t0.
func newMiniBackend(t *testing.T) *backend {
	t.Helper()
	m := miniredis.RunT(t)
	m.SetTime(t0)
	rec := &recorder{}
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	c.AddHook(rec)
	t.Cleanup(func() { _ = c.Close() })
	return &backend{name: "miniredis", client: c, mini: m, rec: rec, cur: t0, born: time.Now()}
}

// newRealBackend returns a backend on a real Redis reached through client,
// after deleting every key in its current database. Any
// redis.UniversalClient on a single node works (the clock emulation lists
// keys with KEYS). It adds a recording hook to client when it is a
// *redis.Client.
func newRealBackend(t *testing.T, client redis.UniversalClient) *backend {
	t.Helper()
	ctx := context.Background()
	if err := client.FlushDB(ctx).Err(); err != nil {
		t.Fatalf("FLUSHDB: %v", err)
	}
	rec := &recorder{}
	client.AddHook(rec)
	return &backend{name: "redis", client: client, rec: rec, cur: t0, born: time.Now()}
}

// shiftSrc moves a bucket's timestamp back by ARGV[1] µs (forward when
// negative), which is what the scripts would see if the server clock had
// moved forward (back) by that much.
const shiftSrc = `local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local w, f, t, tail = string.match(v, '^(%d+) (%d+) (%d+)( .*)$')
if w then
  redis.call('SET', KEYS[1], w .. ' ' .. f .. ' ' .. string.format('%.0f', tonumber(t) - tonumber(ARGV[1])) .. tail, 'KEEPTTL')
end
return 0`

// setTime sets the clock the scripts see to at.
func (b *backend) setTime(t testing.TB, at time.Time) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.mini != nil {
		b.mini.SetTime(at)
		b.cur = at
		return
	}
	d := at.Sub(b.cur).Microseconds()
	b.cur = at
	if d == 0 {
		return
	}
	ctx := context.Background()
	keys, err := b.client.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatalf("KEYS: %v", err)
	}
	for _, k := range keys {
		if strings.Contains(k, ":batch:") {
			continue // a batch's reply, not a bucket
		}
		if err := b.client.Eval(ctx, shiftSrc, []string{k}, d).Err(); err != nil {
			t.Fatalf("shift clock of %q: %v", k, err)
		}
	}
}

// keys returns every key in the database, sorted.
func (b *backend) keys(t testing.TB) []string {
	t.Helper()
	all, err := b.client.Keys(context.Background(), "*").Result()
	if err != nil {
		t.Fatalf("KEYS: %v", err)
	}
	var ks []string
	for _, k := range all {
		if strings.Contains(k, ":batch:") {
			// A batch invocation's reply, kept for a resend: it must
			// expire soon.
			if ttl := b.client.PTTL(context.Background(), k).Val(); ttl <= 0 || ttl > batchLife {
				t.Errorf("batch key %s has TTL %v; want (0, %v]", k, ttl, batchLife)
			}
			continue
		}
		if strings.Contains(k, ":adj:") || strings.Contains(k, ":refunds:") {
			// An adjustment's id, or a refund call's, kept so that a
			// resend is not applied twice: it must expire.
			if ttl := b.client.PTTL(context.Background(), k).Val(); ttl <= 0 || ttl > IDLife {
				t.Errorf("adjustment id %s has TTL %v; want (0, %v]", k, ttl, IDLife)
			}
			continue
		}
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// allKeys returns every key in the database, sorted, batch keys and
// adjustment ids included.
func (b *backend) allKeys(t testing.TB) []string {
	t.Helper()
	all, err := b.client.Keys(context.Background(), "*").Result()
	if err != nil {
		t.Fatalf("KEYS: %v", err)
	}
	sort.Strings(all)
	return all
}

// noKeys fails t if any key was written.
func (b *backend) noKeys(t testing.TB) {
	t.Helper()
	if ks := b.keys(t); len(ks) != 0 {
		t.Errorf("keys written: %v", ks)
	}
}

// untouched fails t if any command reached Redis since the recorder was last
// read, or any key was written.
func (b *backend) untouched(t testing.TB) {
	t.Helper()
	if cmds := b.rec.take(); len(cmds) != 0 {
		t.Errorf("invalid arguments reached Redis: %v", cmds)
	}
	b.noKeys(t)
}

// value returns the bucket string at key ("" when it is missing).
func (b *backend) value(t testing.TB, key string) string {
	t.Helper()
	v, err := b.client.Get(context.Background(), key).Result()
	if err == redis.Nil {
		return ""
	}
	if err != nil {
		t.Fatalf("GET %s: %v", key, err)
	}
	return v
}

// pttl returns PTTL key: negative when the key is missing (-2ms) or has no
// TTL (-1ms), as Redis reports it.
func (b *backend) pttl(t testing.TB, key string) time.Duration {
	t.Helper()
	v, err := b.client.Do(context.Background(), "PTTL", key).Int64()
	if err != nil {
		t.Fatalf("PTTL %s: %v", key, err)
	}
	return time.Duration(v) * time.Millisecond
}

// flushScripts empties the server's script cache (SCRIPT FLUSH).
func (b *backend) flushScripts(t testing.TB) {
	t.Helper()
	if err := b.client.ScriptFlush(context.Background()).Err(); err != nil {
		t.Fatalf("SCRIPT FLUSH: %v", err)
	}
}

// scriptCached reports SCRIPT EXISTS sha.
func (b *backend) scriptCached(t testing.TB, sha string) bool {
	t.Helper()
	v, err := b.client.ScriptExists(context.Background(), sha).Result()
	if err != nil {
		t.Fatalf("SCRIPT EXISTS: %v", err)
	}
	return len(v) == 1 && v[0]
}

// bucketRE is the bucket string: "<w> <f> <t> <last refund id or ->",
// optionally followed by the request id of the last grant and that grant's reply (granted,
// remaining, reset).
var bucketRE = regexp.MustCompile(`^([0-9]+) ([0-9]+) ([0-9]+) ([^ ]+)(?: ([^ ]+) ([0-9]+) ([0-9]+) ([0-9]+))?$`)

// bigState returns the bucket of key under l in units (a token being
// l's period in µs, as the model counts): w·period + f·gcd, where the script
// keeps w whole tokens and f/p of one over the reduced period p; and its
// time t; and whether the key exists.
func (b *backend) bigState(t testing.TB, key string, l policy.Limit) (s *big.Int, ts int64, ok bool) {
	t.Helper()
	v := b.value(t, key)
	if v == "" {
		return nil, 0, false
	}
	m := bucketRE.FindStringSubmatch(v)
	if m == nil {
		t.Fatalf("bucket %s = %q; want \"<w> <f> <t> <rid>[ <id> <granted> <remaining> <reset>]\"", key, v)
	}
	var n [3]int64
	for i := range n {
		var err error
		if n[i], err = strconv.ParseInt(m[i+1], 10, 64); err != nil {
			t.Fatalf("bucket %s = %q: %v", key, v, err)
		}
	}
	_, p := Reduced(l)
	if n[1] >= p {
		t.Fatalf("bucket %s = %q: fraction %d not below the reduced period %d", key, v, n[1], p)
	}
	g := l.PeriodMicros() / p
	s = new(big.Int).Mul(big.NewInt(n[0]), big.NewInt(l.PeriodMicros()))
	s.Add(s, new(big.Int).Mul(big.NewInt(n[1]), big.NewInt(g)))
	return s, n[2], true
}

// state is bigState for limits whose units fit an int64.
func (b *backend) state(t testing.TB, key string, l policy.Limit) (s, ts int64, ok bool) {
	t.Helper()
	bs, ts, ok := b.bigState(t, key, l)
	if !ok {
		return 0, 0, false
	}
	return bs.Int64(), ts, true
}

// newAuthority returns New(b.client, prefix) and fails the test on error.
func (b *backend) newAuthority(t testing.TB, prefix string) *Redis {
	t.Helper()
	r, err := New(b.client, prefix)
	if err != nil {
		t.Fatalf("New(client, %q): %v", prefix, err)
	}
	return r
}

// backendFactory makes a fresh, empty backend for one test case.
type backendFactory func(t *testing.T) *backend

// forEachBackend runs suite once on miniredis and once on a real
// redis-server started through internal/redistest (skipped when
// redis-server is not installed, unless LEASELIMIT_REQUIRE_REDIS=1).
func forEachBackend(t *testing.T, suite func(t *testing.T, nb backendFactory)) {
	t.Run("miniredis", func(t *testing.T) {
		suite(t, newMiniBackend)
	})
	t.Run("redis", func(t *testing.T) {
		srv := redistest.Start(t)
		suite(t, func(t *testing.T) *backend {
			return newRealBackend(t, srv.Client(t))
		})
	})
}

// startReal starts a redis-server for tb alone and returns it, a client
// of it and an authority on that client.
func startReal(tb testing.TB) (*redistest.Server, *redis.Client, *Redis) {
	tb.Helper()
	srv := redistest.Start(tb)
	c := srv.Client(tb)
	r, err := New(c, testPrefix)
	if err != nil {
		tb.Fatal(err)
	}
	return srv, c, r
}

// recorder is a go-redis hook that records the names of the commands sent,
// one entry per command, with pipelines as "[evalsha evalsha]".
type recorder struct {
	mu   sync.Mutex
	cmds []string
}

func (r *recorder) DialHook(next redis.DialHook) redis.DialHook { return next }

func (r *recorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		r.add(cmd.Name())
		return next(ctx, cmd)
	}
}

func (r *recorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		names := make([]string, len(cmds))
		for i, c := range cmds {
			names[i] = c.Name()
		}
		r.add("[" + strings.Join(names, " ") + "]")
		return next(ctx, cmds)
	}
}

func (r *recorder) add(name string) {
	r.mu.Lock()
	r.cmds = append(r.cmds, strings.ToLower(name))
	r.mu.Unlock()
}

// reset forgets the commands recorded so far.
func (r *recorder) reset() {
	r.mu.Lock()
	r.cmds = nil
	r.mu.Unlock()
}

// take returns the script commands (eval, evalsha) recorded since the last
// reset or take, and forgets everything recorded. Other commands (the
// tests' own checks, connection handshakes) are left out: the authority
// only ever sends scripts.
func (r *recorder) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	isScript := func(n string) bool { return n == "eval" || n == "evalsha" }
	var out []string
	for _, c := range r.cmds {
		if strings.HasPrefix(c, "[") {
			var keep []string
			for _, n := range strings.Fields(strings.Trim(c, "[]")) {
				if isScript(n) {
					keep = append(keep, n)
				}
			}
			if len(keep) > 0 {
				out = append(out, "["+strings.Join(keep, " ")+"]")
			}
		} else if isScript(c) {
			out = append(out, c)
		}
	}
	r.cmds = nil
	return out
}
