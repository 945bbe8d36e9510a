package authority

import (
	"fmt"
	"math/bits"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

// The batch script's Go side: its arguments (see batch.lua) and the
// decoding of its reply, which is where a call's RetryAfter and ResetAfter
// are worked out, with the script's exact arithmetic.

// maxExact is 2^53: the scripts' numbers are integers below it.
const maxExact = 1 << 53

// huge is where durations saturate: 2^52 µs (about 142 years).
const huge = 1 << 52

// maxCachedLimits bounds the limits whose arguments are kept (see
// limitArgsOf): a service has a few; one that makes limits on the fly gets
// the arguments worked out for every call past this many.
const maxCachedLimits = 1024

// limitArgs is what the batch script and the decoding of its reply need of
// a limit, worked out once.
type limitArgs struct {
	limit        policy.Limit
	err          error // the script would reject the limit (ErrScript)
	quota        bool
	cal          policy.Calendar
	rate, period uint64 // a token bucket's, reduced (see Reduced)
	burst        int64
	head         [3]any // a token bucket's header r, p, burst, boxed once; a quota's burst
	namer        Namer  // the names of l's buckets: a refund names its bucket again, and a limit's part of the name is three strings built
}

// limitArgsOf returns l's arguments, from the cache when it has them.
func (r *Redis) limitArgsOf(l policy.Limit) *limitArgs {
	if la, ok := r.limits.Load(l); ok {
		return la
	}
	if r.nlimits.Load() >= maxCachedLimits {
		return r.newLimitArgs(l)
	}
	return r.limits.LoadOrMake(l, func() *limitArgs {
		r.nlimits.Add(1)
		return r.newLimitArgs(l)
	})
}

// newLimitArgs works out l's arguments, and rejects in err the limits the
// script would reject: a burst outside [1, 2^52], a rate or period (reduced)
// outside [1, 2^53), a calendar without windows.
func (r *Redis) newLimitArgs(l policy.Limit) *limitArgs {
	la := &limitArgs{limit: l, quota: l.IsQuota(), cal: l.Calendar, burst: l.Burst, namer: r.Namer(l)}
	bad := l.Burst < 1 || l.Burst > huge
	if la.quota {
		start, end, next := l.Calendar.Bounds(wallClock())
		bad = bad || start.UnixMicro() < 1 || !end.After(start) || !next.After(end)
		la.head[2] = l.Burst
	} else if bad = bad || l.Rate < 1 || l.PeriodMicros() < 1; !bad {
		rate, period := Reduced(l)
		bad = rate >= maxExact || period >= maxExact
		la.rate, la.period = uint64(rate), uint64(period)
		la.head = [3]any{rate, period, l.Burst}
	}
	if bad {
		la.err = fmt.Errorf("%w: limit %v", ErrScript, l)
	}
	return la
}

// header appends the limit's header to args: the cached one of a token
// bucket; a quota's window ends, which depend on the time (see spec).
func (la *limitArgs) header(args []any) []any {
	if !la.quota {
		return append(args, la.head[:]...)
	}
	w, next := quotaSpec(la.cal)
	return append(args, w, next, la.head[2])
}

// check checks a single-limit call's arguments and finds its limit's. It
// reports false, with a.Err set, for arguments the script would reject, so
// that they fail alone and never reach it.
func (r *Redis) check(a *Acquisition) bool { return r.checkAfter(a, nil) }

// checkAfter is check given prev, the limit's arguments of the call before
// a in its batch (nil: none). A batch's calls nearly always share a limit,
// which is then compared with prev's rather than hashed for the cache
// (about 0.07 µs a call on the hot key).
func (r *Redis) checkAfter(a *Acquisition, prev *limitArgs) bool {
	la := prev
	if la == nil || la.limit != a.Limit {
		la = r.limitArgsOf(a.Limit)
	}
	if la.err != nil {
		a.Err = la.err
		return false
	}
	if a.Min < 1 || a.Min > a.Want || a.Want > a.Limit.Burst {
		a.Err = fmt.Errorf("%w: acquire want=%d min=%d burst=%d", ErrScript, a.Want, a.Min, a.Limit.Burst)
		return false
	}
	a.lim = la
	return true
}

// batch is one batch invocation: its calls, then its script call.
type batch struct {
	calls []*Acquisition
	// oneBucket: one token bucket, on the script's own path for it (see
	// batch.lua, L = -1), where an exact call has one value each way.
	oneBucket bool
	invocation
}

// newBatch builds the invocation of calls with the calls on each key
// together (see grouped and batchOf).
func (r *Redis) newBatch(calls []*Acquisition) *batch { return r.batchOf(grouped(calls), true) }

// batchOf builds the invocation of calls (at most maxPerScript, checked):
// the batch key, then the calls' keys; the limits' headers, each once,
// then each call's limit index and cost (and min and share_ppm when it is
// not exact); or, when the batch has one token bucket, as most have, an
// exact call's cost alone, and any other's cost negated, min and
// share_ppm (a lease's refill among exact calls no longer sends the whole
// batch to the general path, which costs Redis about 0.5 µs more per
// call). Without keyed, the invocation has no batch
// key (batch.lua's window_ms 0): it is not safe to resend.
func (r *Redis) batchOf(calls []*Acquisition, keyed bool) *batch {
	// The batch's limits, each once. Nearly every batch has one: room for
	// a few on the stack (zeroing a table for maxPerScript of them, and
	// one of each call's index, was a tenth of building a lone call's
	// batch); the index is looked up again below.
	var few [4]*limitArgs
	lims := few[:0]
	ranged := 0 // calls with a min below their want
	for _, a := range calls {
		if limitIndex(lims, a.lim) < 0 {
			lims = append(lims, a.lim)
		}
		if a.Min != a.Want {
			ranged++
		}
	}
	nl := len(lims)
	oneBucket := nl == 1 && !lims[0].quota
	b, line, args, keys := newBatchStore(len(calls), 2+3*nl+2*len(calls)+2*ranged, keyed)
	life := r.life
	if !keyed {
		life = unkeyedArg
	}
	if oneBucket {
		args = append(args, life, int64(-1))
	} else {
		args = append(args, life, int64(nl))
	}
	for _, la := range lims {
		args = la.header(args)
	}
	for _, a := range calls {
		switch {
		case a.Min == a.Want && oneBucket: // share cannot matter: the grant is want or nothing
			args = append(args, a.Want)
		case a.Min == a.Want:
			args = append(args, int64(limitIndex(lims, a.lim)+1), a.Want)
		case oneBucket:
			args = append(args, -a.Want, a.Min, ppm(a.Share))
		default:
			args = append(args, int64(limitIndex(lims, a.lim)+1+nl), a.Want, a.Min, ppm(a.Share))
		}
	}
	if keyed {
		keys = append(keys, r.resendKey(calls[0].Key))
	}
	for _, a := range calls {
		keys = append(keys, a.Key)
	}
	*b = batch{calls: calls, oneBucket: oneBucket, invocation: invocation{keys: keys, args: args, line: line, resendable: keyed}}
	return b
}

// limitIndex returns the index of la in lims, or -1.
func limitIndex(lims []*limitArgs, la *limitArgs) int {
	for i, l := range lims {
		if l == la {
			return i
		}
	}
	return -1
}

// batchOfOne is a batch of one call with room for its keys and its whole
// command, its arguments in it, made in one allocation: a lone caller's
// batch, and most of the long tail's, took four (the batch, its
// arguments, its keys, the command's arguments in go-redis's EvalSha).
type batchOfOne struct {
	batch
	line [3 + 2 + oneCallArgs]any // the command: name, body, key count, keys, args (see command)
	keys [2]string
}

// oneCallArgs is the most arguments a batch of one call has: window_ms
// and L, one limit's header, a call's four values.
const oneCallArgs = 2 + 3 + 4

// newBatchStore returns an empty batch of n calls and room for its nargs
// arguments and its keys (the batch key first when keyed): a batch of one
// call in one allocation (see batchOfOne), its arguments then in line, the
// room for its whole command (see invocation.command), else line nil.
func newBatchStore(n, nargs int, keyed bool) (b *batch, line, args []any, keys []string) {
	nkeys := n
	if keyed {
		nkeys++
	}
	if n == 1 && nargs <= oneCallArgs {
		one := new(batchOfOne)
		return &one.batch, one.line[:], one.line[3+nkeys : 3+nkeys], one.keys[:0]
	}
	return new(batch), nil, make([]any, 0, nargs), make([]string, 0, nkeys)
}

// keyIndexes holds the maps grouped uses, for reuse: one per batch would
// be most of what building a batch allocates.
var keyIndexes = sync.Pool{New: func() any { return make(map[string]int, maxPerScript) }}

// grouped returns calls with the calls on each key together: keys in the
// order of their first calls, each key's calls in their order. The script
// reads and writes a bucket once per run of calls on it (see batch.lua),
// so a key that comes back after another would be read and written again.
// It returns calls itself when no key does, as in most batches.
func grouped(calls []*Acquisition) []*Acquisition {
	runs := 1 // of calls on one key
	for i := 1; i < len(calls) && runs < 3; i++ {
		if calls[i].Key != calls[i-1].Key {
			runs++
		}
	}
	if runs < 3 {
		// One or two runs: no key comes back after another. A hot key's
		// batch, one run, takes no map from the pool.
		return calls
	}
	index := keyIndexes.Get().(map[string]int) // key -> its group
	defer func() {
		clear(index)
		keyIndexes.Put(index)
	}()
	apart := false // a key comes back after another
	for i, a := range calls {
		if i > 0 && a.Key == calls[i-1].Key {
			continue
		}
		if _, seen := index[a.Key]; seen {
			apart = true
			break
		}
		index[a.Key] = len(index)
	}
	if !apart {
		return calls
	}
	clear(index)
	var size []int // calls per group
	for _, a := range calls {
		g, seen := index[a.Key]
		if !seen {
			g = len(size)
			index[a.Key] = g
			size = append(size, 0)
		}
		size[g]++
	}
	next := make([]int, len(size)) // where each group's next call goes
	for g := 1; g < len(size); g++ {
		next[g] = next[g-1] + size[g-1]
	}
	out := make([]*Acquisition, len(calls))
	for _, a := range calls {
		g := index[a.Key]
		out[next[g]] = a
		next[g]++
	}
	return out
}

// decode gives each call of b its outcome.
func (b *batch) decode() {
	v, err := b.cmd.Result()
	if err == nil {
		s, ok := v.(string)
		if !ok {
			err = fmt.Errorf("%w: batch reply %T, want a string", ErrReply, v)
		} else {
			err = decodeBatch(s, b.calls, b.oneBucket)
		}
	} else {
		err = classify(err)
	}
	if err != nil {
		for _, a := range b.calls {
			a.Grant, a.Err = Grant{}, err
		}
	}
}

// parseInt parses a reply's decimal integer: by Atoi where an int has 64
// bits, whose fast path for fewer than 19 digits takes half of
// ParseInt's time (a lone call's reply has four numbers).
func parseInt(s string) (int64, error) {
	if strconv.IntSize == 64 {
		n, err := strconv.Atoi(s)
		return int64(n), err
	}
	return strconv.ParseInt(s, 10, 64)
}

// clockOf reads the server's clock at the head of a batch reply, "<s>
// <us>" as TIME gave it, in µs, and returns the rest of the reply.
func clockOf(body string) (now int64, rest string, ok bool) {
	st, rest := field(body)
	ut, rest := field(rest)
	s, err1 := parseInt(st)
	us, err2 := parseInt(ut)
	if err1 != nil || err2 != nil || us < 0 || us >= 1e6 || s < 0 || s > (maxExact-1-us)/1e6 {
		return 0, "", false
	}
	return s*1e6 + us, rest, true
}

// decodeBatch decodes a batch reply (see batch.lua) in place, into each
// call's Grant or Err; oneBucket tells a batch on one token bucket, where
// an exact call has two values, not the usual three.
func decodeBatch(reply string, calls []*Acquisition, oneBucket bool) error {
	body, lines, _ := strings.Cut(reply, "\n")
	now, rest, ok := clockOf(body)
	if !ok {
		return fmt.Errorf("%w: batch reply %.80q", ErrReply, reply)
	}
	var err error
	for _, a := range calls {
		exact := oneBucket && a.Min == a.Want
		values := 3 // " <g> <w> <x>"
		if exact {
			values = 2 // " <w> <x>", g being want
		}
		var t [3]string
		for i := range values {
			t[i], rest = field(rest)
		}
		if t[0] == "e" {
			j, err := strconv.Atoi(t[1])
			msg, ok := line(lines, j)
			if err != nil || !ok {
				return fmt.Errorf("%w: batch reply %.80q", ErrReply, reply)
			}
			a.Grant, a.Err = Grant{}, classify(replyError(msg))
			continue
		}
		var n [3]int64
		for i := range values {
			if n[i], err = parseInt(t[i]); err != nil {
				return fmt.Errorf("%w: batch reply %.80q", ErrReply, reply)
			}
		}
		g, w, x := n[0], n[1], n[2]
		if exact {
			g, w, x = a.Want, n[0], n[1]
			if x < 0 { // a denial
				g, x = 0, -1-x
			}
		}
		if a.Grant, err = grantOf(a, now, g, w, x); err != nil {
			return err
		}
		a.Err = nil
	}
	if rest != "" {
		return fmt.Errorf("%w: batch reply %.80q has more than %d calls", ErrReply, reply, len(calls))
	}
	return nil
}

// field returns the text of s up to its first space, and what follows it.
func field(s string) (string, string) {
	if i := strings.IndexByte(s, ' '); i >= 0 {
		return s[:i], s[i+1:]
	}
	return s, ""
}

// line returns the j-th (1-based) line of lines.
func line(lines string, j int) (string, bool) {
	for ; j > 0 && lines != ""; j-- {
		var l string
		l, lines, _ = strings.Cut(lines, "\n")
		if j == 1 {
			return l, true
		}
	}
	return "", false
}

// replyError is an error reply the batch script put in its reply for one
// call's bucket: a redis.Error, so that it classifies as Redis's own.
type replyError string

func (e replyError) Error() string { return string(e) }
func (e replyError) RedisError()   {}

// grantOf is the outcome of call a from the script's g (granted), w (whole
// tokens left, negative in debt) and x (a token bucket's fraction, a quota's
// window end) at now: RetryAfter until min tokens (denials only) and
// ResetAfter until burst tokens, as the script's take() computed them.
func grantOf(a *Acquisition, now, g, w, x int64) (Grant, error) {
	la := a.lim
	if (g != 0 && (g < a.Min || g > a.Want)) || (g == 0 && w >= a.Min) || w <= -maxExact || w >= maxExact ||
		x < 0 || x >= maxExact || (la.quota && x <= now) || (!la.quota && uint64(x) >= la.period) {
		return Grant{}, fmt.Errorf("%w: batch reply {%d %d %d} for want=%d min=%d", ErrReply, g, w, x, a.Want, a.Min)
	}
	wait := func(m int64) time.Duration { // m >= 1 tokens more
		if la.quota {
			return time.Duration(x-now) * time.Microsecond
		}
		return time.Duration(untilTokens(uint64(m), uint64(x), la.rate, la.period)) * time.Microsecond
	}
	gr := Grant{Granted: g, Remaining: max(w, 0), At: now}
	if g == 0 {
		gr.RetryAfter = wait(a.Min - w)
	}
	if w < la.burst {
		gr.ResetAfter = wait(la.burst - w)
	}
	return gr, nil
}

// untilTokens returns the µs until a bucket holding w + f/p tokens holds m
// more whole tokens (m >= 1, f < p): ceil((m*p - f) / r), at most huge, as
// until_tokens in common.lua, in 128-bit integers.
func untilTokens(m, f, r, p uint64) int64 {
	hi, lo := bits.Mul64(m, p)
	lo, borrow := bits.Sub64(lo, f, 0)
	hi -= borrow
	if hi >= r { // the quotient needs more than 64 bits
		return huge
	}
	q, rem := bits.Div64(hi, lo, r)
	if q >= huge {
		return huge
	}
	if rem > 0 {
		q++
	}
	return int64(q)
}
