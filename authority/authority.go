// Package authority is internal machinery of leaselimit, for its own
// packages: it carries no compatibility promise, and its API changes
// whenever leaselimit needs it to. Users need nothing from it.
//
// It is the Redis side of leaselimit: the token bucket as
// embedded Lua scripts (batch, which decides a batch of single-limit
// acquire calls in one invocation, acquire_all for several limits at once,
// refund, which also charges, reset and peek) run atomically on Redis's own
// clock, EVALSHA with a fallback to EVAL on NOSCRIPT, the naming of Redis
// keys, and the decoding of script replies. It works with any
// redis.UniversalClient: a single node, Sentinel (FailoverClient) or
// Cluster.
//
// Every bucket lives in one key; the buckets of one user key share a hash
// slot whatever their limits, so every script call touches one slot. A
// batch invocation that granted keeps its reply for a few seconds in a
// batch key of the same slot, so that a resent invocation takes nothing
// twice (see batch.lua). The ledger (ledger.go: refunds, charges and Reset)
// keeps two kinds of short-lived keys in the same slot: an applied
// adjustment's id and a Reset's mark.
package authority

import (
	"context"
	"crypto/rand"
	"crypto/sha1"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/cowmap"
	"github.com/leaselimit/leaselimit/internal/keybytes"
	"github.com/leaselimit/leaselimit/internal/nilclient"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

//go:embed muldiv.lua
var muldivSrc string

//go:embed common.lua
var commonBody string

//go:embed batch.lua
var batchBody string

//go:embed refund.lua
var refundBody string

//go:embed refund_batch.lua
var refundBatchBody string

//go:embed reset.lua
var resetBody string

//go:embed acquire_all.lua
var acquireAllBody string

// The scripts as sent to Redis: the arithmetic prelude (muldiv.lua), then
// the shared helpers (common.lua) and the body; batch.lua needs only the
// arithmetic.
var (
	commonSrc      = muldivSrc + commonBody
	batchSrc       = muldivSrc + batchBody
	refundSrc      = commonSrc + refundBody
	refundBatchSrc = commonSrc + refundBatchBody
	resetSrc       = commonSrc + resetBody
	acquireAllSrc  = commonSrc + acquireAllBody
)

// MaxPrefixLen is the longest key prefix accepted.
const MaxPrefixLen = 64

// ErrReply is wrapped by errors for a script reply that does not have the
// expected shape: a Redis or proxy in front of it that misbehaves.
var ErrReply = errors.New("authority: unexpected script reply")

// ErrScript is wrapped by errors the scripts raise themselves (arguments they
// reject). Such an error is a bug in leaselimit, not an outage: callers should
// surface it loudly rather than count it as a Redis failure.
var ErrScript = errors.New("authority: script rejected its arguments")

// ErrRefused is wrapped by errors for a command Redis refused inside a
// script: an ACL without it, OOM, a read-only replica. The wrapped Redis
// error keeps Redis's own code (NOPERM, OOM, READONLY, ...) first.
var ErrRefused = errors.New("authority: Redis refused a command in the script")

// ErrRejected is wrapped by the error of a refund that a call of
// refund_batch.lua reports failed: its arguments, its bucket or its reset
// mark were not what the script can adjust (a value another program wrote,
// a key the ACL denies). It was not applied, and sent again it would fail
// the same way: a refund queue drops it, counted.
var ErrRejected = errors.New("authority: refund rejected")

// ErrNotSent is wrapped by the error of an adjustment RefundAll did not
// send because its ctx ended while an earlier pipeline of the same call
// ran: it never reached Redis.
var ErrNotSent = errors.New("authority: adjustment not sent")

// ErrPrefix is returned by New for an unusable key prefix.
var ErrPrefix = errors.New("authority: invalid key prefix")

// Grant is the outcome of one acquire call.
type Grant struct {
	Granted    int64         // tokens taken from the bucket; 0 on denial
	Remaining  int64         // whole tokens left in the bucket after the take
	RetryAfter time.Duration // 0 when granted; else until min tokens are available
	ResetAfter time.Duration // until the bucket is full again
	// Multi, for an Acquisition With more buckets, has each bucket's
	// state; Remaining is then the least of them and ResetAfter the
	// longest, RetryAfter until every bucket holds Min tokens.
	Multi *Multi
	// At is the server's clock (Unix µs) when the tokens left the bucket:
	// the generation they belong to (see Refund.Since); 0 when not known
	// (the stored reply of a call go-redis resent).
	At int64
}

// Multi is the outcome of a multi-limit acquisition, bucket by bucket.
type Multi struct {
	Denied int    // index (Key 0, then With) of the bucket that made the call wait longest; -1 when granted
	Parts  []Part // Key's bucket, then With's
}

// Part is one bucket's state after a multi-limit acquisition.
type Part struct {
	Remaining  int64
	ResetAfter time.Duration
}

// Redis runs the token-bucket scripts on a Redis deployment.
// It is safe for concurrent use.
type Redis struct {
	client redis.UniversalClient
	prefix string
	idBase string        // random per Redis value, so ids differ across instances
	seq    atomic.Uint64 // adjustment and batch ids
	life   any           // a batch's resend key's life in ms, boxed once (see WithResendWindow)

	limits  cowmap.Map[policy.Limit, *limitArgs] // see limitArgsOf
	nlimits atomic.Int32                         // entries in limits
}

type script struct {
	src, sha string
	// The two as command arguments, boxed once: go-redis's EvalSha boxed
	// the hash again for every call.
	srcArg, shaArg any
}

var (
	batchScript       = newScript(batchSrc)
	refundScript      = newScript(refundSrc)
	refundBatchScript = newScript(refundBatchSrc)
	resetScript       = newScript(resetSrc)
	acquireAllScript  = newScript(acquireAllSrc)
)

func newScript(src string) script {
	h := sha1.Sum([]byte(src))
	sha := hex.EncodeToString(h[:])
	return script{src: src, sha: sha, srcArg: src, shaArg: sha}
}

// Option configures a Redis (see New).
type Option func(*Redis)

// WithResendWindow keeps the reply of a batch that granted for at least d
// and a second more: d must be the longest the caller lets go-redis resend
// an acquire call after Redis first ran it, which is the longest context
// deadline it gives one (go-redis resends a pipeline whose connection
// broke, or whose read timed out, until that deadline). A resend after the
// reply is gone would take the batch's tokens twice. Without it, or with
// a shorter d, the reply is kept for batchLife (5s), which covers a
// deadline of 4s.
func WithResendWindow(d time.Duration) Option {
	return func(r *Redis) {
		if life := d + time.Second; life > batchLife {
			r.life = life.Milliseconds()
		}
	}
}

// New returns an authority on client with the given key prefix (see
// ValidatePrefix). It makes no Redis call.
func New(client redis.UniversalClient, prefix string, opts ...Option) (*Redis, error) {
	if nilclient.Is(client) {
		return nil, errors.New("authority: nil or zero redis client")
	}
	if err := ValidatePrefix(prefix); err != nil {
		return nil, err
	}
	var rnd [8]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, fmt.Errorf("authority: request id seed: %w", err)
	}
	r := &Redis{client: client, prefix: prefix, idBase: hex.EncodeToString(rnd[:]) + "-", life: batchLifeArg}
	for _, o := range opts {
		o(r)
	}
	return r, nil
}

// ValidatePrefix reports whether p can prefix Redis keys: 1 to MaxPrefixLen
// bytes of printable ASCII without spaces, '{' or '}' (a brace would form a
// Cluster hash tag and put every key on one slot).
func ValidatePrefix(p string) error {
	if p == "" || len(p) > MaxPrefixLen {
		return fmt.Errorf("%w: %q must be 1 to %d bytes", ErrPrefix, p, MaxPrefixLen)
	}
	if i := keybytes.FirstBad(p); i >= 0 {
		return fmt.Errorf("%w: %q holds %q; use printable ASCII without spaces or braces", ErrPrefix, p, p[i])
	}
	return nil
}

// Key returns the Redis key of userKey's bucket under limit l:
// "<prefix>:<limit name>:<rate>/<period>/<burst>:{<32 hex digits>}", the
// digits being the first 128 bits of SHA-256 of userKey, the period in the
// largest unit that divides it (see ParamsTag). User bytes never reach
// Redis, and the hash tag is the digest, so keys spread evenly over Cluster
// slots. The bucket's parameters are part of the key because the stored
// state is in units of them: two limits with one name but another rate,
// period or burst must never read each other's bucket. A deploy that
// changes a limit therefore starts every key on a fresh, full bucket of the
// new limit; the old buckets expire by their own TTL.
func (r *Redis) Key(l policy.Limit, userKey string) string {
	return r.namerOf(l).Key(userKey)
}

// namerOf is Namer(l), from l's cached arguments when the cache holds them
// or has room for them (see limitArgsOf), so that a refund queue's flush
// does not build the limit's part of the name again for every refund.
func (r *Redis) namerOf(l policy.Limit) Namer {
	if la, ok := r.limits.Load(l); ok {
		return la.namer
	}
	if r.nlimits.Load() >= maxCachedLimits {
		return r.Namer(l)
	}
	return r.limitArgsOf(l).namer
}

// Namer names the buckets of one limit: Namer(l).Key(userKey) is
// Key(l, userKey), without working out the limit's part of the name again
// for every key. Its zero value is not usable.
type Namer struct {
	head string // "<prefix>:<limit name>:<params>:{"
}

// Namer returns the namer of l's buckets.
func (r *Redis) Namer(l policy.Limit) Namer {
	return Namer{head: r.prefix + ":" + l.Name + ":" + ParamsTag(l) + ":{"}
}

// Key returns the Redis key of userKey's bucket (see (*Redis).Key), in one
// allocation: the key itself.
func (n Namer) Key(userKey string) string {
	// The digest reads the string's bytes in place: a []byte copy would be
	// a second allocation for keys longer than a few dozen bytes.
	sum := sha256.Sum256(unsafe.Slice(unsafe.StringData(userKey), len(userKey)))
	var hx [32]byte
	hex.Encode(hx[:], sum[:16])
	var b strings.Builder
	b.Grow(len(n.head) + len(hx) + 1)
	b.WriteString(n.head)
	b.Write(hx[:])
	b.WriteByte('}')
	return b.String()
}

// ParamsTag returns "<rate>/<period>/<burst>" for l, the period written in
// the largest of d, h, m, s, ms and us that divides it: "100/1m/200",
// "1000000/1d/1000000", "3/1500ms/3"; a calendar quota's adds
// "@<unit>:<location>": "1000/30d/1000@month:UTC".
func ParamsTag(l policy.Limit) string {
	p := l.Period
	units := []struct {
		d    time.Duration
		name string
	}{{24 * time.Hour, "d"}, {time.Hour, "h"}, {time.Minute, "m"}, {time.Second, "s"}, {time.Millisecond, "ms"}}
	period := strconv.FormatInt(l.PeriodMicros(), 10) + "us"
	for _, u := range units {
		if p%u.d == 0 {
			period = strconv.FormatInt(int64(p/u.d), 10) + u.name
			break
		}
	}
	return strconv.FormatInt(l.Rate, 10) + "/" + period + "/" + strconv.FormatInt(l.Burst, 10) + calendarTag(l)
}

// calendarTag is what l's Redis key says of its calendar: "" for a token
// bucket, else "@<unit>:<location>" (UTC for a nil Location).
func calendarTag(l policy.Limit) string {
	if !l.IsQuota() {
		return ""
	}
	c := l.Calendar
	loc := c.Location
	if loc == nil {
		loc = time.UTC
	}
	return "@" + c.Every.String() + ":" + loc.String()
}

// Reduced returns l's rate and period in µs divided by their greatest
// common divisor: the bucket gains rate tokens every period µs. The
// scripts keep the fraction of a token in units of 1/period, so the smaller
// period keeps every number small.
func Reduced(l policy.Limit) (rate, period int64) {
	a, b := l.Rate, l.PeriodMicros()
	for b != 0 {
		a, b = b, a%b
	}
	return l.Rate / a, l.PeriodMicros() / a
}

// spec returns the two script arguments that say what kind of bucket l is
// (see spec in common.lua): its rate and period reduced, or, for a
// calendar quota, "w<end>:<start>" of the window that holds now on this
// process's clock (µs), then the end of the window after it. Redis's clock
// picks the window: the one before, that one or the next, so clocks that
// differ from Redis's by less than a window, ahead or behind, agree.
func spec(l policy.Limit) (any, any) {
	if !l.IsQuota() {
		return Reduced(l)
	}
	return quotaSpec(l.Calendar)
}

// quotaSpec is a calendar quota's two script arguments now (see spec).
func quotaSpec(c policy.Calendar) (string, int64) {
	start, end, next := c.Bounds(wallClock())
	return "w" + strconv.FormatInt(end.UnixMicro(), 10) + ":" + strconv.FormatInt(start.UnixMicro(), 10), next.UnixMicro()
}

// wallClock is this process's clock, which picks a calendar quota's windows
// (see spec); a variable so that tests can hold it still.
var wallClock = time.Now

// NewID returns a new adjustment id (see Refund.ID), for a caller that
// must know it before the adjustment is sent.
func (r *Redis) NewID() string { return r.nextID("r") }

// nextID returns an id unique to this process and call (an adjustment's,
// a batch invocation's): the random base, then kind, then a sequence
// number.
func (r *Redis) nextID(kind string) string {
	var b strings.Builder
	b.Grow(len(r.idBase) + len(kind) + maxSeqLen)
	r.writeID(&b, kind)
	return b.String()
}

// maxSeqLen is the length of the longest uint64 in base 36.
const maxSeqLen = 13

// writeID writes a new id of kind to b (see nextID).
func (r *Redis) writeID(b *strings.Builder, kind string) {
	var seq [maxSeqLen]byte
	b.WriteString(r.idBase)
	b.WriteString(kind)
	b.Write(strconv.AppendUint(seq[:0], r.seq.Add(1), 36))
}

// resendKey returns a new resend key for an invocation whose first bucket
// is key (see batch.lua and acquire_all.lua): the prefix, ":batch:", key's
// hash tag in braces, so that a Cluster keeps the two on one node, then a
// batch id (an id of kind "b"). Every keyed invocation makes one, a lone
// call included, so it is built in one allocation (joining its parts took
// one more per call).
func (r *Redis) resendKey(key string) string { return r.callKey(":batch:{", key, "b") }

// refundCallKey returns a new id key for a call of refund_batch.lua whose
// buckets are in key's hash slot: as resendKey, under ":refunds:" and of
// kind "c".
func (r *Redis) refundCallKey(key string) string { return r.callKey(":refunds:{", key, "c") }

// callKey returns the prefix, mid, key's hash tag and "}:", then a new id
// of kind, in one allocation.
func (r *Redis) callKey(mid, key, kind string) string {
	const tail = "}:"
	tag := hashTag(key)
	var b strings.Builder
	b.Grow(len(r.prefix) + len(mid) + len(tag) + len(tail) + len(r.idBase) + len(kind) + maxSeqLen)
	b.WriteString(r.prefix)
	b.WriteString(mid)
	b.WriteString(tag)
	b.WriteString(tail)
	r.writeID(&b, kind)
	return b.String()
}

// Acquire takes between min and want tokens from key's bucket under l, at
// most max(min, available×share) of them, where share is in (0, 1]; or none
// when fewer than min are available. It needs 1 <= min <= want <= l.Burst.
func (r *Redis) Acquire(ctx context.Context, key string, l policy.Limit, want, min int64, share float64) (Grant, error) {
	a := Acquisition{Key: key, Limit: l, Want: want, Min: min, Share: share}
	r.AcquireAll(ctx, []*Acquisition{&a})
	return a.Grant, a.Err
}

// Acquisition is one acquire call of a batch (see AcquireAll): its
// arguments, then its outcome.
type Acquisition struct {
	Key       string
	Limit     policy.Limit
	Want, Min int64
	Share     float64
	// With, if set, are more buckets the same tokens are taken from, all
	// or none, in one script call (acquire_all.lua): a request under
	// several limits. On a Cluster they must share Key's hash slot (keys of
	// one user key do: see Key).
	With []Member

	Grant Grant
	Err   error

	args []any      // a multi-limit call's script arguments
	lim  *limitArgs // a single-limit call's limit
	// sentAs is the resend key of the invocation the call went in, ""
	// if it had none; sentIn the number of calls in it (see Resend).
	sentAs string
	sentIn int
}

// Member is one more bucket of a multi-limit Acquisition.
type Member struct {
	Key   string
	Limit policy.Limit
}

// ppm returns share in parts per million, as the scripts take it: NaN and
// values above 1 mean "no cap", values at or below 0 the smallest share.
func ppm(share float64) int64 {
	if share < 1 {
		return max(int64(share*1e6), 1)
	}
	return 1e6
}

// prepare checks a multi-limit call's arguments and builds the script's.
// It reports false, with a.Err set, for arguments the script would reject.
func (r *Redis) prepare(a *Acquisition) bool {
	l := a.Limit
	if a.Min < 1 || a.Min > a.Want || a.Want > l.Burst {
		a.Err = fmt.Errorf("%w: acquire want=%d min=%d burst=%d", ErrScript, a.Want, a.Min, l.Burst)
		return false
	}
	rate, period := spec(l)
	a.args = append(make([]any, 0, 4+3*(1+len(a.With))), r.life, a.Want, a.Min, ppm(a.Share), rate, period, l.Burst)
	for _, m := range a.With {
		if a.Want > m.Limit.Burst {
			a.Err = fmt.Errorf("%w: acquire want=%d burst=%d", ErrScript, a.Want, m.Limit.Burst)
			return false
		}
		rate, period := spec(m.Limit)
		a.args = append(a.args, rate, period, m.Limit.Burst)
	}
	return true
}

// multiInvocation is the acquire_all call of a multi-limit call a (its
// arguments prepared): a fresh resend key (see acquire_all.lua), then the
// buckets a takes from, Key then With's. Without keyed it has no resend
// key (window_ms 0): the form for a Cluster slot in migration, not safe to
// resend.
func (r *Redis) multiInvocation(a *Acquisition, keyed bool) *invocation {
	ks := make([]string, 0, 2+len(a.With))
	args := a.args
	if keyed {
		ks = append(ks, r.resendKey(a.Key))
	} else {
		args = append([]any{unkeyedArg}, args[1:]...)
	}
	ks = append(ks, a.Key)
	for _, m := range a.With {
		ks = append(ks, m.Key)
	}
	return &invocation{keys: ks, args: args, resendable: keyed}
}

// maxPerScript bounds the calls one batch invocation decides: Redis runs a
// script to its end before serving anything else.
const maxPerScript = 64

// batchLife is how long a batch invocation that granted keeps its reply
// (its batch key's TTL; see batch.lua) at least. go-redis resends a
// pipeline only within the call's context deadline; WithResendWindow
// lengthens the life for a caller whose deadlines are longer. A short life
// keeps the number of live batch keys small (one per invocation that
// granted).
const batchLife = 5 * time.Second

// batchLifeArg is batchLife as the script's argument, boxed once;
// unkeyedArg is the argument of an invocation without a batch key.
var batchLifeArg, unkeyedArg any = batchLife.Milliseconds(), int64(0)

// AcquireAll makes several acquire calls at once, each with its own outcome
// in its Grant and Err. Multi-limit calls (With set) are acquire_all calls,
// one pipeline of them. The others go to the batch script (batch.lua): on a
// single node (or Sentinel) in invocations of up to maxPerScript calls,
// which share the script call's fixed cost; on a Cluster or Ring, whose keys
// live on several nodes and slots, grouped by the key's hash tag (the calls
// on one user key share an invocation; go-redis splits the pipeline by
// node). A key may appear several times: its calls are decided in the order
// of as. Calls whose arguments the script would reject fail alone, with
// ErrScript, before anything is sent. Invocations the server answers
// NOSCRIPT are sent again by EVAL in a second pipeline. Each invocation
// carries a fresh batch id, so that one go-redis resends after a broken
// connection, or this package after the client's own timeout (see runAll),
// returns its first reply instead of taking tokens twice.
func (r *Redis) AcquireAll(ctx context.Context, as []*Acquisition) {
	as = r.acquireWith(ctx, as)
	// The calls that pass check: as itself until one fails (no copy, as
	// in nearly every batch), a copy of those before it then.
	ready, copied := as, false
	var prev *limitArgs // the last checked call's
	for i, a := range as {
		a.sentAs, a.sentIn = "", 0
		ok := r.checkAfter(a, prev)
		if ok {
			prev = a.lim
		}
		switch {
		case !ok && !copied:
			ready, copied = append(make([]*Acquisition, 0, len(as)), as[:i]...), true
		case ok && copied:
			ready = append(ready, a)
		}
	}
	if len(ready) == 0 {
		return
	}
	var batches []*batch
	if r.multiKey() {
		batches = make([]*batch, 0, (len(ready)+maxPerScript-1)/maxPerScript)
		for i := 0; i < len(ready); i += maxPerScript {
			batches = append(batches, r.newBatch(ready[i:min(i+maxPerScript, len(ready))]))
		}
	} else {
		batches = r.byHashTag(ready)
	}
	invs := make([]*invocation, len(batches))
	for i, b := range batches {
		invs[i] = &b.invocation
	}
	r.runAll(ctx, batchScript, invs)
	for _, b := range batches {
		b.decode()
		for _, a := range b.calls {
			a.sentAs, a.sentIn = b.keys[0], len(b.calls) // keyed: newBatch's
		}
	}
	r.acquireMoving(ctx, batches)
}

// Resend sends the calls of one invocation again (all of them: the calls
// of as that share a resend key, see Invocation), after AcquireAll gave
// them an error that leaves their outcome unknown (a reply cut by a
// deadline: Redis may have run it), and sets their Grant and Err as
// AcquireAll does. It goes under the resend key of the first sending, so
// that Redis answers with the first's reply if that one granted, taking
// nothing again, and decides them now otherwise (the first denied them
// all, or has not run yet). Its reply is kept under the key even for a
// denial, so that a first sending still on its way, should it run later,
// returns that reply and takes nothing. It must come within ResendLife of
// the first: a
// resend key lives that long. It reports false, sending nothing, for calls
// that are not one whole invocation with a resend key (a Cluster slot in
// migration sends its calls without one).
func (r *Redis) Resend(ctx context.Context, as []*Acquisition) bool {
	if len(as) == 0 || as[0].sentAs == "" || as[0].sentIn != len(as) {
		return false
	}
	for _, a := range as[1:] {
		if a.sentAs != as[0].sentAs || len(a.With) > 0 {
			return false
		}
	}
	if a := as[0]; len(a.With) > 0 {
		if len(as) != 1 {
			return false
		}
		inv := r.multiInvocation(a, true)
		inv.keys[0] = a.sentAs
		inv.args = append([]any{-r.life.(int64)}, inv.args[1:]...) // keep even a denial: a.args is shared
		r.runAll(ctx, acquireAllScript, []*invocation{inv})
		a.decodeAll(inv)
		return true
	}
	// The calls in the order given, grouped as newBatch grouped them:
	// the same arguments under the same key.
	b := r.newBatch(as)
	b.keys[0] = as[0].sentAs
	b.args[0] = -r.life.(int64) // keep even a denial (see batch.lua's always)
	r.runAll(ctx, batchScript, []*invocation{&b.invocation})
	b.decode()
	return true
}

// Invocation returns the resend key of the invocation a's call went in
// ("" if it had none, or was not sent) and the number of calls in it.
func (a *Acquisition) Invocation() (key string, calls int) { return a.sentAs, a.sentIn }

// ResendLife is how long the resend key of an invocation that granted
// keeps its reply (batchLife, or as WithResendWindow set it): Resend must
// come within it.
func (r *Redis) ResendLife() time.Duration {
	return time.Duration(r.life.(int64)) * time.Millisecond
}

// acquireMoving makes again the calls of the batches a Redis Cluster
// refused because their slot is migrating (circuit.Moving: a script on a
// key that does not exist yet, as a batch key never does, is refused on
// both nodes while the slot moves): one invocation per bucket and without
// a batch key, which the node that holds the bucket serves (go-redis
// follows its ASK), so that these calls stay exact while Redis answers
// rather than go to the failure policy. Such an invocation is not safe to
// resend: should go-redis resend it, it takes twice (under-admission).
func (r *Redis) acquireMoving(ctx context.Context, batches []*batch) {
	var again []*invocation
	var redo []*batch
	for _, b := range batches {
		if !circuit.Moving(b.cmd.Err()) {
			continue
		}
		calls := b.calls // grouped: the calls on one key are together
		for len(calls) > 0 {
			n := 1
			for n < len(calls) && calls[n].Key == calls[0].Key {
				n++
			}
			for _, a := range calls[:n] {
				a.sentAs, a.sentIn = "", 0 // its invocation has no resend key
			}
			nb := r.batchOf(calls[:n], false)
			redo = append(redo, nb)
			again = append(again, &nb.invocation)
			calls = calls[n:]
		}
	}
	if len(redo) == 0 {
		return
	}
	r.runAll(ctx, batchScript, again)
	for _, b := range redo {
		b.decode()
	}
}

// byHashTag returns the batches of as on a Cluster or Ring: one per hash
// tag (split at maxPerScript), each keeping the order of as.
func (r *Redis) byHashTag(as []*Acquisition) []*batch {
	var batches []*batch
	for _, g := range tagGroups(as, func(a *Acquisition) string { return a.Key }) {
		batches = append(batches, r.newBatch(g))
	}
	return batches
}

// tagGroups splits items into the groups one script call each takes on a
// Cluster or Ring, whose keys live on several nodes and slots: the items
// of one hash tag (of keyOf's key), in their order, split at maxPerScript.
func tagGroups[T any](items []T, keyOf func(T) string) [][]T {
	return groupsBy(items, func(it T) string { return hashTag(keyOf(it)) })
}

// groupsBy splits items into the groups one script call each takes: the
// items of one group key (groupOf's), in their order, split at
// maxPerScript.
func groupsBy[T any, K comparable](items []T, groupOf func(T) K) [][]T {
	index := make(map[K]int, len(items))
	var byKey [][]T
	for _, it := range items {
		k := groupOf(it)
		i, ok := index[k]
		if !ok {
			i = len(byKey)
			index[k] = i
			byKey = append(byKey, nil)
		}
		byKey[i] = append(byKey[i], it)
	}
	var groups [][]T
	for _, g := range byKey {
		for i := 0; i < len(g); i += maxPerScript {
			groups = append(groups, g[i:min(i+maxPerScript, len(g))])
		}
	}
	return groups
}

// hashTag returns the part of key that Redis Cluster hashes: the text
// between the first '{' and the next '}' when it is not empty, else the
// whole key. Every bucket key ends with its tag (see Key).
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

// acquireWith makes the multi-limit calls of as (those with With), in one
// pipeline of acquire_all calls, and returns the others.
func (r *Redis) acquireWith(ctx context.Context, as []*Acquisition) []*Acquisition {
	if !slices.ContainsFunc(as, func(a *Acquisition) bool { return len(a.With) > 0 }) {
		return as // the usual case, without a copy
	}
	var invs []*invocation
	var multi []*Acquisition
	rest := as[:0:0]
	for _, a := range as {
		if len(a.With) == 0 {
			rest = append(rest, a)
			continue
		}
		if r.prepare(a) {
			multi = append(multi, a)
			invs = append(invs, r.multiInvocation(a, true))
		}
	}
	if len(multi) == 0 {
		return rest
	}
	r.runAll(ctx, acquireAllScript, invs)
	// A Cluster slot in migration refuses the script while its resend key
	// does not exist (see acquireMoving): such calls go again without it,
	// and the node serves them when it holds every bucket.
	var again []*invocation
	for i, a := range multi {
		a.sentAs, a.sentIn = invs[i].keys[0], 1
		if circuit.Moving(invs[i].cmd.Err()) {
			a.sentAs, a.sentIn = "", 0 // sent again without a resend key
			invs[i] = r.multiInvocation(a, false)
			again = append(again, invs[i])
		}
	}
	if len(again) > 0 {
		r.runAll(ctx, acquireAllScript, again)
	}
	for i, a := range multi {
		a.decodeAll(invs[i])
	}
	return rest
}

// decodeAll gives a, a multi-limit call, the outcome of its acquire_all
// invocation inv, as batch.decode gives a batch's calls theirs.
func (a *Acquisition) decodeAll(inv *invocation) {
	v, err := inv.cmd.Result()
	if err != nil {
		a.Grant, a.Err = Grant{}, classify(err)
		return
	}
	a.Grant, a.Err = decodeAll(v, 1+len(a.With))
}

// multiKey reports whether one script may take several keys: every key
// lives on the one node. Only a *redis.Client (a single node, or Sentinel's
// failover client) says so: a Cluster or Ring does not, nor does a client
// of the user's own type (a wrapper around a ClusterClient would otherwise
// send keys of many slots in one script: CROSSSLOT), which pays one
// script per user key's hash tag instead.
func (r *Redis) multiKey() bool {
	_, single := r.client.(*redis.Client)
	return single
}

// exact takes exactly n tokens or none: Acquire(ctx, key, l, n, n, 1).
func (r *Redis) exact(ctx context.Context, key string, l policy.Limit, n int64) (Grant, error) {
	return r.Acquire(ctx, key, l, n, n, 1)
}

// refusedMark is what the scripts append to an error reply of a command
// Redis refused inside them (see call in common.lua).
const refusedMark = "(leaselimit: Redis refused "

// classify marks the error replies our own scripts make: ErrScript for
// arguments they reject (our bug), ErrRefused for a command Redis refused
// inside them. Only error replies are looked at, and only in the forms
// the scripts write.
func classify(err error) error {
	var re redis.Error
	if !errors.As(err, &re) {
		return err
	}
	switch {
	case redis.HasErrorPrefix(re, "leaselimit: invalid"):
		return fmt.Errorf("%w: %w", ErrScript, err)
	case strings.Contains(re.Error(), refusedMark):
		return fmt.Errorf("%w: %w", ErrRefused, err)
	}
	return err
}

// decodeAll decodes an acquire_all reply for k buckets:
// {granted, denied, retry_after_us, then remaining and reset_after_us of
// each bucket, then the server's clock (Grant.At)}. The Grant's Remaining is the least of the buckets', its
// ResetAfter the longest.
func decodeAll(v any, k int) (Grant, error) {
	n := make([]int64, 4+2*k)
	if err := decodeInts(v, n, -1); err != nil {
		return Grant{}, err
	}
	const maxMicros = int64(1<<63-1) / int64(time.Microsecond)
	if n[1] > int64(k) || n[2] > maxMicros || (n[0] > 0) == (n[1] > 0) || (n[0] > 0) != (n[2] == 0) {
		return Grant{}, fmt.Errorf("%w: acquire_all reply %v", ErrReply, v)
	}
	m := &Multi{Denied: int(n[1]) - 1, Parts: make([]Part, k)}
	g := Grant{Granted: n[0], RetryAfter: time.Duration(n[2]) * time.Microsecond, Multi: m, At: n[3+2*k]}
	for i := range m.Parts {
		rem, reset := n[3+2*i], n[4+2*i]
		if reset > maxMicros {
			return Grant{}, fmt.Errorf("%w: duration out of range in %v", ErrReply, v)
		}
		m.Parts[i] = Part{Remaining: rem, ResetAfter: time.Duration(reset) * time.Microsecond}
		if i == 0 || rem < g.Remaining {
			g.Remaining = rem
		}
		g.ResetAfter = max(g.ResetAfter, m.Parts[i].ResetAfter)
	}
	return g, nil
}

func decodeRefund(v any) (remaining int64, reset time.Duration, err error) {
	var n [2]int64
	if err := decodeInts(v, n[:], 0); err != nil {
		return 0, 0, err
	}
	if n[1] > int64(1<<63-1)/int64(time.Microsecond) {
		return 0, 0, fmt.Errorf("%w: duration out of range in %v", ErrReply, v)
	}
	return n[0], time.Duration(n[1]) * time.Microsecond, nil
}

// decodeInts fills dst from a reply that must be an array of exactly
// len(dst) integers, non-negative but for dst[signed] (-1: none).
func decodeInts(v any, dst []int64, signed int) error {
	arr, ok := v.([]any)
	if !ok {
		return fmt.Errorf("%w: %T, want an array", ErrReply, v)
	}
	if len(arr) != len(dst) {
		return fmt.Errorf("%w: %d elements, want %d", ErrReply, len(arr), len(dst))
	}
	for i, e := range arr {
		x, ok := e.(int64)
		if !ok {
			return fmt.Errorf("%w: element %d is %T, want an integer", ErrReply, i, e)
		}
		if x < 0 && i != signed {
			return fmt.Errorf("%w: element %d is negative (%s)", ErrReply, i, strconv.FormatInt(x, 10))
		}
		dst[i] = x
	}
	return nil
}
