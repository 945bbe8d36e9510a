package authority

import (
	"context"
	"fmt"
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
// and given back up to this long after it are dropped. Leases come back
// within seconds; only a Reservation settled later than this after a Reset
// of its key could give its tokens to the fresh bucket.
const MarkLife = 24 * time.Hour

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
	// ID is the adjustment's own id, set by Apply or RefundAll when it is
	// empty: a resend under the same id is not applied twice.
	ID string
}

// Failed is an adjustment of a Refund pipeline that failed, with its
// error; its ID is set, to send it again under.
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

// RefundAll applies several adjustments in one pipeline (on a Cluster,
// go-redis splits it by node). Adjustments without an ID to one key are
// merged when they agree (the same sign, window and stamp), each merged
// one gets an ID; adjustments with an ID (sent
// before) go as they are. Entries with Tokens 0 are skipped; Tokens are
// capped as Apply caps them. It returns the adjustments that failed, with
// their IDs, to be sent again under them (see ResendWithin).
func (r *Redis) RefundAll(ctx context.Context, refunds []Refund) []Failed {
	items := mergeRefunds(refunds)
	invs := make([]*invocation, 0, len(items))
	sent := make([]*Refund, 0, len(items))
	for i := range items {
		rf := &items[i]
		n := clampAdjust(rf.Tokens, rf.Limit)
		if n == 0 {
			continue // capped to nothing
		}
		if rf.ID == "" {
			rf.ID = r.nextID("r")
		}
		keys, args := r.adjustCall(rf, n, true)
		invs = append(invs, &invocation{keys: keys, args: args, resendable: true})
		sent = append(sent, rf)
	}
	if len(invs) == 0 {
		return nil
	}
	r.runAll(ctx, refundScript, invs)
	var moving []*invocation // charges refused on a slot in migration
	for i, in := range invs {
		if n := clampAdjust(sent[i].Tokens, sent[i].Limit); n < 0 && circuit.Moving(in.cmd.Err()) {
			keys, args := r.adjustCall(sent[i], n, false)
			invs[i] = &invocation{keys: keys, args: args}
			moving = append(moving, invs[i])
		}
	}
	if len(moving) > 0 {
		r.runAll(ctx, refundScript, moving)
	}
	var failed []Failed
	for i, in := range invs {
		err := in.cmd.Err()
		if err == nil {
			_, _, err = decodeRefund(in.cmd.Val())
		}
		if err != nil {
			failed = append(failed, Failed{Refund: *sent[i], Err: classify(err)})
		}
	}
	return failed
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
		if rf.ID != "" {
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
