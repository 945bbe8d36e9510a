package authority

import (
	"context"
	_ "embed"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

//go:embed peek.lua
var peekBody string

var peekScript = newScript(commonSrc + peekBody)

// Bucket is a bucket's state as Peek read it.
type Bucket struct {
	Tokens     int64         // whole tokens it holds (0 for a bucket in debt)
	RetryAfter time.Duration // until it holds one token (0 when it does)
	ResetAfter time.Duration // until it is full
}

// Peek reads key's bucket under l on Redis's clock without changing it: one
// script call that runs GET and TIME and nothing else. A missing bucket is
// full. (It is sent as EVALSHA, not EVALSHA_RO: miniredis, which many
// users test against, refuses TIME in a read-only script.)
func (r *Redis) Peek(ctx context.Context, key string, l policy.Limit) (Bucket, error) {
	rate, period := spec(l)
	v, err := r.run(ctx, peekScript, key, rate, period, l.Burst)
	if err != nil {
		return Bucket{}, err
	}
	var n [3]int64
	if err := decodeInts(v, n[:], 0); err != nil {
		return Bucket{}, err
	}
	return Bucket{Tokens: max(n[0], 0), RetryAfter: time.Duration(n[1]) * time.Microsecond,
		ResetAfter: time.Duration(n[2]) * time.Microsecond}, nil
}
