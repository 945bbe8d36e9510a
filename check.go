package leaselimit

import (
	"context"
)

// Check verifies that c can work, for start-up and readiness
// probes: it reaches Redis (every master on a Cluster), runs both scripts
// (loading them if needed, which also exercises the ACL), writes a reserved
// key under the prefix with a TTL and gives its token back (which deletes
// it), and, where CONFIG GET is allowed, reports a maxmemory-policy that can
// evict buckets. Each of its calls is bounded by the time budget
// (WithTimeout), whatever the client's own timeouts, and the scripts'
// call that runs out of it is tried once more (a cold client's first call
// dials and loads the scripts); ctx can end it sooner.
//
// The error wraps authority.ErrCheck and says, per node, what is wrong and
// what to do: Redis unreachable, a replica (READONLY), an ACL without a
// command the scripts run, a full Redis, another program's key under the
// prefix, an eviction policy that drops buckets. Check makes no decision
// and touches no bucket; a failed Check changes nothing c does. After
// Close it returns ErrClosed; with a nil ctx, ErrNilContext; on a nil
// *Client, an error wrapping ErrClosed.
func (c *Client) Check(ctx context.Context) error {
	if err := c.missing(); err != nil {
		return err
	}
	if ctx == nil {
		return ErrNilContext
	}
	return c.e.ready(ctx)
}
