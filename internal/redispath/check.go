package redispath

import (
	"context"
	"fmt"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/deadline"
)

// Check runs authority.Check within the budget of every node it visits,
// whatever the client's own timeouts; ctx can end it sooner. It runs in a
// goroutine of the gate, since a client that does not honour deadlines
// could hold it for its ReadTimeout.
func (p *Path) Check(ctx context.Context) error {
	ch := make(chan error, 1)
	if !p.gate.spawn(func() { ch <- p.auth.Check(context.WithoutCancel(ctx), p.budget) }) {
		return p.closed
	}
	wait, cancel := context.WithTimeout(ctx, p.checkBudget())
	defer cancel()
	select {
	case err := <-ch:
		return err
	case <-wait.Done():
		if err := deadline.Ended(ctx); err != nil {
			return err
		}
		return fmt.Errorf("%w: no reply within %v: check the address, the network, and that Redis is not hung", authority.ErrCheck, p.checkBudget())
	}
}

// checkBudget bounds a whole Check: three budgets a node (the scripts,
// tried twice, and the eviction policy; see authority.Check), and as many
// for the cluster's masters.
func (p *Path) checkBudget() time.Duration {
	nodes := 1
	if p.nodes.cluster != nil {
		nodes = max(len(p.nodes.cluster.Options().Addrs), 1) + 1
	}
	return time.Duration(3*nodes) * p.budget
}
