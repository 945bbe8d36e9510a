package redispath

import (
	"context"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
)

// Refund sends adjustments rs, all of brk's node, in one pipeline within
// the budget, and returns those that failed. It reports false, sending
// nothing, when brk holds calls back: they wait for Redis.
func (p *Path) Refund(brk *circuit.Breaker, rs []authority.Refund, tokens int64) (failed []authority.Failed, sent bool) {
	if brk.Rejects(p.nodes.now) { // the breakers' clock (withClock)
		return nil, false
	}
	done, err := brk.Allow()
	if err != nil {
		return nil, false
	}
	rkey := ""
	if len(rs) > 0 {
		rkey = rs[0].Key // rs share brk's node
	}
	tell, stopVouch := p.vouchedProbe(brk, rkey, done)
	span := p.tel.StartRefund(p.nodes.laneFor(brk).ep, len(rs))
	start, replies, limit := time.Now(), brk.RepliesSeen(), p.refundBudget(len(rs))
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	failed = p.auth.RefundAll(ctx, rs)
	cancel()
	stopVouch()
	err = firstError(failed)
	p.tel.EndRefund(span, tokens, err)
	// A pipeline cut at its deadline while this process was behind is not
	// Redis's failure (see judged).
	tell(p.judged(brk, rkey, nil, start, limit, replies, err)) // no caller waits for it: no early ask
	return failed, true
}

// RefundFinal sends adjustments rs for Close, whatever the breakers say:
// the engine gets no later chance. What Redis did not answer (see
// circuit.NoAnswer) is sent again, under the same ids (Redis applies each
// adjustment once, and its answer says whether an earlier send was
// applied), until Redis takes it or finalWait has passed since the first
// send (the first send has its whole refundBudget even if that is longer);
// it returns those that failed. Regressions (reviews): Close
// counted as dropped the adjustments of a pipeline whose reply was cut
// after Redis ran it (27-431 tokens counted that were back in their
// buckets); and on a client that honours deadlines, a Settle's charge
// that met a 300ms stall of Redis across Close (stopped, or pausing writes
// as a failover does) was dropped at the budget, so the bucket admitted
// the whole excess again (TestCloseRidesOutAStall: 150 on a bucket of
// 100). A client without deadlines rode it out on go-redis's ReadTimeout.
// And (a review): finalWait cut the first send of a large flush short, so
// Close on a client that honours deadlines, with Redis healthy, dropped
// 93,000 adjustments owed after an outage on 128,000 keys
// (TestCloseSendsALargeFlushWhole).
func (p *Path) RefundFinal(rs []authority.Refund, tokens int64) []authority.Failed {
	until := time.Now().Add(max(p.finalWait(), p.refundBudget(len(rs))))
	span := p.tel.StartRefund(p.nodes.oneLane.ep, len(rs))
	var failed, unanswered []authority.Failed // failed: not to be sent again
	for pause := finalPause; ; pause = min(2*pause, p.budget) {
		deadline := time.Now().Add(p.refundBudget(len(rs)))
		if deadline.After(until) {
			deadline = until
		}
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		outcome := p.auth.RefundAll(ctx, rs)
		cancel()
		rs, unanswered = nil, nil
		for _, f := range outcome {
			if circuit.NoAnswer(f.Err) {
				rs = append(rs, f.Refund)
				unanswered = append(unanswered, f)
			} else {
				failed = append(failed, f) // a misconfiguration: sending again would not help
			}
		}
		if len(rs) == 0 || time.Until(until) < pause {
			break
		}
		time.Sleep(pause)
	}
	failed = append(failed, unanswered...)
	p.tel.EndRefund(span, tokens, firstError(failed))
	return failed
}

// finalPause is the first pause between Close's sends (see RefundFinal);
// each pause doubles, up to the budget.
const finalPause = 10 * time.Millisecond

// finalWait is how long Close keeps sending adjustments Redis does not
// answer (see RefundFinal): a second, or the budget if longer. Long enough
// for a stall of Redis of a few hundred milliseconds (a failover's write
// pause), short enough that Close on a Redis that is down returns soon.
func (p *Path) finalWait() time.Duration { return max(time.Second, p.budget) }

// perRefund is what one adjustment adds to its pipeline's deadline: Redis
// runs a refund script (four commands) and the pipeline carries it in 10 to
// 30 µs on a loaded machine; 50 µs leaves a margin.
const perRefund = 50 * time.Microsecond

// maxRefundWait caps a pipeline's deadline (Close's final one waits for
// it), unless the budget is longer.
const maxRefundWait = 3 * time.Second

// refundBudget is the deadline of a pipeline of n adjustments: the budget,
// plus perRefund each, at most maxRefundWait (or the budget, if longer). A
// pipeline is sent whole, and on a client that honours deadlines a flush of
// the leases of thousands of keys (Close's) does not fit in one budget.
func (p *Path) refundBudget(n int) time.Duration {
	return min(p.budget+time.Duration(n)*perRefund, max(maxRefundWait, p.budget))
}

// firstError returns the error of the first failed adjustment, if any.
func firstError(failed []authority.Failed) error {
	if len(failed) == 0 {
		return nil
	}
	return failed[0].Err
}
