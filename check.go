package leaselimit

import (
	"context"
	"fmt"
	"time"

	"github.com/leaselimit/leaselimit/authority"
)

// Check verifies that the Limiter can work, for start-up and readiness
// probes: it reaches Redis (every master on a Cluster), runs both scripts
// (loading them if needed, which also exercises the ACL), writes a reserved
// key under the prefix with a TTL and gives its token back (which deletes
// it), and, where CONFIG GET is allowed, reports a maxmemory-policy that can
// evict buckets. Each node's check is bounded by the time budget
// (WithTimeout), whatever the client's own timeouts; ctx can end it sooner.
//
// The error wraps authority.ErrCheck and says, per node, what is wrong and
// what to do: Redis unreachable, a replica (READONLY), an ACL without a
// command the scripts run, a full Redis, another program's key under the
// prefix, an eviction policy that drops buckets. Check makes no decision
// and touches no bucket; a failed Check changes nothing the Limiter does.
func (l *Limiter) Check(ctx context.Context) error {
	if l.gate.isClosed() {
		return ErrClosed
	}
	// go-redis's default client options do not honour deadlines on
	// reads: run the check in a goroutine (Close waits for it) and stop
	// waiting at the budget of each node, plus one for the cluster map.
	ch := make(chan error, 1)
	if !l.gate.spawn(func() { ch <- l.auth.Check(context.WithoutCancel(ctx), l.cfg.timeout) }) {
		return ErrClosed
	}
	wait, cancel := context.WithTimeout(ctx, l.checkBudget())
	defer cancel()
	select {
	case err := <-ch:
		return err
	case <-wait.Done():
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("%w: no reply within %v: check the address, the network, and that Redis is not hung", authority.ErrCheck, l.checkBudget())
	}
}

// checkBudget bounds a whole Check: two budgets a node (the scripts and
// the eviction policy), and one for the cluster's masters.
func (l *Limiter) checkBudget() time.Duration {
	nodes := 1
	if l.brks.cluster != nil {
		nodes = max(len(l.brks.cluster.Options().Addrs), 1) + 1
	}
	return time.Duration(2*nodes) * l.cfg.timeout
}
