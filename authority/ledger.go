package authority

import (
	"cmp"
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/policy"
)

// The ledger: every token that comes back to a bucket (a refund of unused
// tokens, a lease returned, a reservation settled, a charge) is applied only
// to the generation and the window it left, and only once (see refund.lua).

// IDLife is how long Redis remembers that an adjustment was applied (its
// id key's TTL). Within it an adjustment can be sent again under its id as
// often as need be: go-redis resends a call whose connection broke, and a
// caller resends one whose outcome it does not know (see ResendWithin).
const IDLife = 2 * time.Minute

// ResendWithin is how long after an adjustment was first sent (when it may
// have reached Redis) a caller may still send it again under its id: half
// of IDLife, so that the first send's id is remembered whenever a resend
// arrives. An adjustment that never reached Redis has no such limit.
const ResendWithin = IDLife / 2

// MarkLife is how long a Reset's mark lives: tokens taken before a Reset
// and given back up to this long after it are dropped. A refund of tokens
// that left their bucket this long ago or longer is dropped too (the
// scripts' MARK_LIFE_US, in common.lua): a mark that would tell whether a
// Reset came between may be gone (a Reservation settled later than the
// mark's life after its grant gave its surplus to the fresh bucket of a
// Reset that had come between). A week: far past what a lease holds
// (policy.MaxLeaseTTL, a day; a lease's oldest stamp may trail its newest
// grant by a refill or two), so that no lease's return is ever that old,
// for a key a Reset leaves behind.
const MarkLife = 7 * 24 * time.Hour

// Refund asks to give Tokens unused tokens back to the bucket of Key, or,
// for negative Tokens, to charge it (see Apply): one adjustment of the
// ledger.
type Refund struct {
	Key    string // a key from (*Redis).Key
	Limit  policy.Limit
	Tokens int64
	// Window, for a calendar quota, is the end (Unix µs, the server's
	// clock) of the window the tokens were taken in: an adjustment in
	// another window is not applied (that window started full). 0 for a
	// token bucket; a quota's adjustment without it is not applied either.
	Window int64
	// Since is the server's clock (Unix µs) at or before the moment the
	// tokens left the bucket (a Grant's At, or an earlier one): the
	// adjustment is applied only if the bucket was not Reset since. 0
	// means unknown: a refund is applied only to a bucket never Reset
	// (within MarkLife), a charge always (forgiven, it would over-admit).
	Since int64
	// ID is the adjustment's own id, set by Apply when it is empty, and by
	// RefundAll for a charge: a resend under the same id is not applied
	// twice.
	ID string
	// Call is the id key of the call of refund_batch.lua that carried a
	// refund RefundAll sent without an ID (see refundBatches): such
	// refunds are applied at most once per call. One whose outcome is
	// unknown goes again under its Call, with others of that call or
	// alone, never with refunds of another call: a call applied before
	// applies nothing of a resend.
	Call string
}

// Once is what a resend of rf is applied once under: its ID, or its Call.
func (rf Refund) Once() string { return cmp.Or(rf.ID, rf.Call) }

// Failed is an adjustment of a Refund pipeline that failed, with its
// error; its ID or its Call is set, to send it again under (see Once).
type Failed struct {
	Refund
	Err error
}

// markKey is the reset mark of the bucket at key: the same hash slot (the
// bucket key ends with its hash tag), and no bucket key ends this way.
func markKey(key string) string { return key + ":reset" }

// idKey is the key that records the adjustment id as applied to key's
// bucket.
func idKey(key, id string) string { return key + ":adj:" + id }

// resetKey is the key that records a Reset call as made on key's bucket,
// with the mark it set.
func resetKey(key, id string) string { return key + ":rst:" + id }

// Apply applies one adjustment in one script call: a refund for
// rf.Tokens > 0 (capped at the burst), a charge for rf.Tokens < 0 that
// may take the bucket into debt, at most one burst of it (later requests
// wait it out). It sets rf.ID if empty, and returns the tokens the bucket
// then holds, negative in debt. |Tokens| above the burst (a refund) or
// 2·burst (a charge) is capped there.
func (r *Redis) Apply(ctx context.Context, rf *Refund) (int64, error) {
	n := clampAdjust(rf.Tokens, rf.Limit)
	if n == 0 {
		return 0, fmt.Errorf("%w: adjust by 0", ErrScript)
	}
	if rf.ID == "" {
		rf.ID = r.nextID("r")
	}
	keys, args := r.adjustCall(rf, n, true)
	v, err := r.runKeys(ctx, refundScript, keys, args...)
	if n < 0 && circuit.Moving(err) {
		keys, args = r.adjustCall(rf, n, false)
		v, err = r.runKeys(ctx, refundScript, keys, args...)
	}
	if err != nil {
		return 0, err
	}
	rem, _, err := decodeRefund(v)
	return rem, err
}

// adjustCall returns the refund script's keys and arguments for rf, n
// tokens. Without keyed, for a charge refused on a Cluster slot in
// migration (circuit.Moving), it is the form on the bucket alone, which
// the node holding it serves: without the adjustment's id and the reset
// mark (see refund.lua). A charge is never given up for that: a charge not
// made over-admits, one made twice (a resend) under-admits.
func (r *Redis) adjustCall(rf *Refund, n int64, keyed bool) ([]string, []any) {
	rate, period := spec(rf.Limit)
	if !keyed {
		return []string{rf.Key}, []any{rate, period, rf.Limit.Burst, n, rf.Window, rf.Since, 0}
	}
	keys := []string{rf.Key, markKey(rf.Key), idKey(rf.Key, rf.ID)}
	args := []any{rate, period, rf.Limit.Burst, n, rf.Window, rf.Since, IDLife.Milliseconds()}
	return keys, args
}

// RefundAll applies several adjustments, in as few script calls as it
// takes, in one pipeline per script (on a Cluster, go-redis splits it by
// node). Refunds without an ID (a refund queue's own: expired leases,
// grants no caller took) go in calls of refund_batch.lua, each applied
// once by an id key per call (see refundBatches); charges and adjustments
// with an ID (a Settle's, sent again under it) go in calls of refund.lua,
// each applied once by its own id key. Either way up to maxPerScript
// adjustments share a call, those of one hash tag on a Cluster or Ring.
// One call each cost Redis a script call, a clock reading and a reply per
// adjustment, and an id key per refund two million keys on the comparison's
// cold long tail. Adjustments without an ID to one key are merged when
// they agree (the same sign, window and stamp). Entries with Tokens 0 are
// skipped; Tokens are capped as Apply caps them. It returns the
// adjustments that failed, with their ID or Call, to be sent again under
// it (see ResendWithin).
func (r *Redis) RefundAll(ctx context.Context, refunds []Refund) []Failed {
	items := mergeRefunds(refunds)
	var keyed, batched []*Refund
	for i := range items {
		rf := &items[i]
		if clampAdjust(rf.Tokens, rf.Limit) == 0 {
			continue // capped to nothing
		}
		if rf.ID == "" && rf.Tokens > 0 {
			batched = append(batched, rf)
			continue
		}
		if rf.ID == "" {
			rf.ID = r.nextID("r")
		}
		keyed = append(keyed, rf)
	}
	failed := r.refundBatches(ctx, batched, nil)
	if err := ctx.Err(); err != nil && len(keyed) > 0 {
		// The refunds' pipeline took the whole deadline: go-redis would
		// fail these before writing a byte, an error that reads as a call
		// that may have reached Redis.
		for _, rf := range keyed {
			failed = append(failed, Failed{Refund: *rf, Err: fmt.Errorf("%w: %w", ErrNotSent, err)})
		}
		return failed
	}
	return r.refundKeyed(ctx, keyed, failed)
}

// refundKeyed applies adjustments with their own ids (see refund.lua) and
// appends those that failed to failed.
func (r *Redis) refundKeyed(ctx context.Context, sent []*Refund, failed []Failed) []Failed {
	if len(sent) == 0 {
		return failed
	}
	groups := r.adjustGroups(sent)
	invs := r.runGroups(ctx, refundScript, groups, r.adjustInvocation)
	var moving []*Refund // charges refused on a slot in migration
	for i, g := range groups {
		err := invs[i].cmd.Err()
		if err == nil {
			failed = decodeRefunds(invs[i].cmd.Val(), g, failed)
			continue
		}
		for _, rf := range g {
			if clampAdjust(rf.Tokens, rf.Limit) < 0 && circuit.Moving(err) {
				moving = append(moving, rf)
				continue
			}
			failed = append(failed, Failed{Refund: *rf, Err: classify(err)})
		}
	}
	if len(moving) > 0 {
		// Each alone, on its bucket without its id and mark (see
		// adjustCall), which the node holding the bucket serves.
		again := make([]*invocation, len(moving))
		for i, rf := range moving {
			keys, args := r.adjustCall(rf, clampAdjust(rf.Tokens, rf.Limit), false)
			again[i] = &invocation{keys: keys, args: args}
		}
		r.runAll(ctx, refundScript, again)
		for i, rf := range moving {
			if err := again[i].cmd.Err(); err != nil {
				failed = append(failed, Failed{Refund: *rf, Err: classify(err)})
				continue
			}
			failed = decodeRefunds(again[i].cmd.Val(), moving[i:i+1], failed)
		}
	}
	return failed
}

// refundBatches applies refunds without an ID in calls of
// refund_batch.lua, and appends those that failed to failed: a call's own
// error fails each of its refunds with its Call (its outcome unknown, it is
// sent again under it); a refund the call reports failed goes without, its
// error wrapping ErrRejected (it was not applied, and would fail again).
func (r *Redis) refundBatches(ctx context.Context, rfs []*Refund, failed []Failed) []Failed {
	if len(rfs) == 0 {
		return failed
	}
	groups := r.batchGroups(rfs)
	invs := r.runGroups(ctx, refundBatchScript, groups, r.refundBatchInvocation)
	for i, g := range groups {
		if err := invs[i].cmd.Err(); err != nil {
			for _, rf := range g {
				failed = append(failed, Failed{Refund: *rf, Err: classify(err)})
			}
			continue
		}
		failed = decodeRefundBatch(invs[i].cmd.Val(), g, failed)
	}
	return failed
}

// runGroups runs one call of s per group of adjustments, made by build,
// in one pipeline (see runAll), and returns the calls in the groups' order.
func (r *Redis) runGroups(ctx context.Context, s script, groups [][]*Refund, build func([]*Refund) *invocation) []*invocation {
	invs := make([]*invocation, len(groups))
	for i, g := range groups {
		invs[i] = build(g)
	}
	r.runAll(ctx, s, invs)
	return invs
}

// batchGroups splits refunds into the calls of refund_batch.lua: those of
// one Call together, as they were sent before (or fewer of them); new ones
// by limit (a call is of one limit) and, on a Cluster or Ring, by hash
// tag, up to maxPerScript per call, each call's refunds given its new
// Call.
func (r *Redis) batchGroups(rfs []*Refund) [][]*Refund {
	type group struct {
		call  string
		limit policy.Limit
		tag   string
	}
	bySlot := !r.multiKey()
	groups := groupsBy(rfs, func(rf *Refund) group {
		if rf.Call != "" {
			return group{call: rf.Call} // at most maxPerScript: never split
		}
		k := group{limit: rf.Limit}
		if bySlot {
			k.tag = hashTag(rf.Key)
		}
		return k
	})
	for _, g := range groups {
		if g[0].Call == "" {
			call := r.refundCallKey(g[0].Key)
			for _, rf := range g {
				rf.Call = call
			}
		}
	}
	return groups
}

// idLifeArg is IDLife in ms, boxed once.
var idLifeArg any = IDLife.Milliseconds()

// refundBatchInvocation is the call of refund_batch.lua for the refunds g,
// of one limit and one Call.
func (r *Redis) refundBatchInvocation(g []*Refund) *invocation {
	in := &invocation{keys: make([]string, 0, 1+2*len(g)), args: make([]any, 0, 4+3*len(g)), resendable: true}
	in.keys = append(in.keys, g[0].Call)
	if la := r.limitArgsOf(g[0].Limit); !la.quota && la.err == nil {
		in.args = append(in.args, idLifeArg, la.head[0], la.head[1], la.head[2])
	} else {
		rate, period := spec(g[0].Limit) // a quota's windows, as of now
		in.args = append(in.args, idLifeArg, rate, period, g[0].Limit.Burst)
	}
	for _, rf := range g {
		in.keys = append(in.keys, rf.Key, markKey(rf.Key))
		in.args = append(in.args, clampAdjust(rf.Tokens, rf.Limit), rf.Window, rf.Since)
	}
	return in
}

// decodeRefundBatch reads the reply v of one call of refund_batch.lua for
// the refunds g, and appends to failed those it reports failed, without
// their Call (see refundBatches), or all of them, with it, when v is not
// such a reply.
func decodeRefundBatch(v any, g []*Refund, failed []Failed) []Failed {
	s, _ := v.(string)
	if s == "=" {
		return failed // applied before: this is a resend
	}
	codes, rest, found := strings.Cut(s, "\n")
	var msgs []string
	if found {
		msgs = strings.Split(rest, "\n")
	}
	if len(codes) != len(g) || strings.Trim(codes, "+e") != "" || strings.Count(codes, "e") != len(msgs) {
		err := fmt.Errorf("%w: refund batch reply %q for %d refunds", ErrReply, s, len(g))
		for _, rf := range g {
			failed = append(failed, Failed{Refund: *rf, Err: err})
		}
		return failed
	}
	for i := range codes {
		if codes[i] == 'e' {
			f := Failed{Refund: *g[i], Err: fmt.Errorf("%w: %w", ErrRejected, classify(replyError(msgs[0])))}
			f.Call = ""
			failed = append(failed, f)
			msgs = msgs[1:]
		}
	}
	return failed
}

// adjustGroups splits adjustments into the groups one script call each
// applies: up to maxPerScript of them, on a Cluster or Ring those of one
// hash tag (one slot) only.
func (r *Redis) adjustGroups(rfs []*Refund) [][]*Refund {
	if !r.multiKey() {
		return tagGroups(rfs, func(rf *Refund) string { return rf.Key })
	}
	var groups [][]*Refund
	for i := 0; i < len(rfs); i += maxPerScript {
		groups = append(groups, rfs[i:min(i+maxPerScript, len(rfs))])
	}
	return groups
}

// adjustInvocation is the refund script's call for the adjustments g, each
// with its id (see refund.lua): one call, sent again whole under the same
// ids when its reply is lost.
func (r *Redis) adjustInvocation(g []*Refund) *invocation {
	in := &invocation{keys: make([]string, 0, 3*len(g)), args: make([]any, 0, 7*len(g)), resendable: true}
	for _, rf := range g {
		keys, args := r.adjustCall(rf, clampAdjust(rf.Tokens, rf.Limit), true)
		in.keys = append(in.keys, keys...)
		in.args = append(in.args, args...)
	}
	return in
}

// decodeRefunds reads the reply v of one refund script call for the
// adjustments g, and appends to failed those whose part of it is an error
// or not a reply of the script's.
func decodeRefunds(v any, g []*Refund, failed []Failed) []Failed {
	if len(g) == 1 {
		if _, _, err := decodeRefund(v); err != nil {
			failed = append(failed, Failed{Refund: *g[0], Err: err})
		}
		return failed
	}
	arr, ok := v.([]any)
	if !ok || len(arr) != len(g) {
		err := fmt.Errorf("%w: refund reply %v for %d adjustments", ErrReply, v, len(g))
		for _, rf := range g {
			failed = append(failed, Failed{Refund: *rf, Err: err})
		}
		return failed
	}
	for i, e := range arr {
		var err error
		if msg, ok := adjustError(e); ok {
			err = classify(replyError(msg))
		} else {
			_, _, err = decodeRefund(e)
		}
		if err != nil {
			failed = append(failed, Failed{Refund: *g[i], Err: err})
		}
	}
	return failed
}

// adjustError reports whether e, one adjustment's part of a refund reply
// for several, is its error, {'e', message} (see refund.lua), and the
// message.
func adjustError(e any) (string, bool) {
	pair, ok := e.([]any)
	if !ok || len(pair) != 2 || pair[0] != "e" {
		return "", false
	}
	msg, ok := pair[1].(string)
	return msg, ok
}

// mergeRefunds merges the adjustments without an ID that can be applied as
// one: to one key, of one sign (a refund into a full bucket is capped at
// its burst and a charge after it still counts; netted, the charge would
// vanish), one window and one Since. Stamps differ between grants, and a
// Reset may lie between two of them: merged under the earlier, the later
// grant's tokens would be dropped with the older ones.
func mergeRefunds(refunds []Refund) []Refund {
	type group struct {
		key           string
		window, since int64
		charge        bool
	}
	merged := make(map[group]int, len(refunds))
	items := make([]Refund, 0, len(refunds))
	for _, rf := range refunds {
		if rf.Tokens == 0 {
			continue
		}
		if rf.ID != "" || rf.Call != "" {
			items = append(items, rf)
			continue
		}
		g := group{rf.Key, rf.Window, rf.Since, rf.Tokens < 0}
		if i, ok := merged[g]; ok {
			items[i].Tokens += rf.Tokens
			continue
		}
		merged[g] = len(items)
		items = append(items, rf)
	}
	return items
}

// Reset makes key's bucket full again, for every instance, and starts its
// next generation: tokens taken from it before are never given back to it
// (see refund.lua). It returns the server's clock at the reset (Unix µs).
func (r *Redis) Reset(ctx context.Context, key string) (int64, error) {
	// The id makes the call once: go-redis resends a call whose
	// connection broke, and a reset run twice deletes the fresh bucket.
	id := resetKey(key, r.nextID("z"))
	v, err := r.runKeys(ctx, resetScript, []string{key, markKey(key), id}, MarkLife.Milliseconds(), IDLife.Milliseconds())
	if circuit.Moving(err) {
		// A slot in migration refuses the id key, which never exists
		// beforehand: reset without it (a resend resets again: the fleet
		// may admit a burst more, as before the id; refused for the whole
		// migration, a Reset could not be made at all).
		v, err = r.runKeys(ctx, resetScript, []string{key, markKey(key)}, MarkLife.Milliseconds(), 0)
	}
	if err != nil {
		return 0, err
	}
	at, ok := v.(int64)
	if !ok || at < 0 {
		return 0, fmt.Errorf("%w: reset reply %v", ErrReply, v)
	}
	return at, nil
}

// clampAdjust caps an adjustment of a bucket under l at what the refund
// script accepts: a refund at l.Burst, a charge at 2·l.Burst (the bucket
// owes at most one burst whatever it held).
func clampAdjust(n int64, l policy.Limit) int64 {
	return min(max(n, -2*l.Burst), l.Burst)
}
