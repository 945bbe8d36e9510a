package authority

import (
	"context"
	"fmt"

	"github.com/leaselimit/leaselimit/policy"
)

// Shorthands the tests use for the ledger's calls (see ledger.go).

// Adjust adds n tokens to key's bucket under l, in one script call, as
// Apply does for Refund{Key: key, Limit: l, Tokens: n, Window: window}:
// tokens of an unknown generation, under a new id.
func (r *Redis) Adjust(ctx context.Context, key string, l policy.Limit, n, window int64) (int64, error) {
	return r.Apply(ctx, &Refund{Key: key, Limit: l, Tokens: n, Window: window})
}

// Refund is RefundAll for a caller that needs only the first failure's
// error.
func (r *Redis) Refund(ctx context.Context, refunds []Refund) error {
	if failed := r.RefundAll(ctx, refunds); len(failed) > 0 {
		return failed[0].Err
	}
	return nil
}

// refundOne gives n unused tokens back to key's bucket, capped at l.Burst,
// as tokens of an unknown generation. It returns the whole tokens the
// bucket then holds.
func (r *Redis) refundOne(ctx context.Context, key string, l policy.Limit, n int64) (int64, error) {
	if n < 1 || n > l.Burst {
		return 0, fmt.Errorf("%w: refund n=%d burst=%d", ErrScript, n, l.Burst)
	}
	return r.Adjust(ctx, key, l, n, 0)
}
