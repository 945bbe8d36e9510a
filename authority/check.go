package authority

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/leaselimit/leaselimit/internal/dialstat"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// ErrCheck is wrapped by every error Check returns.
var ErrCheck = errors.New("leaselimit: check")

// checkLimit is the limit of the reserved check key: one token, refilled in
// a second, so the key lives two seconds at most even if its refund fails.
var checkLimit = policy.Limit{Name: "check", Rate: 1, Period: time.Second, Burst: 1}

// maxCheckKeys bounds the search for a check key on each Cluster master.
const maxCheckKeys = 4096

// checkKey returns the i-th reserved check key, "<prefix>:_check:{<i>}". It
// has no parameters segment, so it is never a bucket's key.
func (r *Redis) checkKey(i int) string {
	return r.prefix + ":_check:{" + strconv.Itoa(i) + "}"
}

// Check verifies that the deployment can serve the Limiter: it reaches
// Redis (each master of a Cluster), runs both scripts (loading them if
// needed, which also checks the ACL), writes a reserved key under the
// prefix with a TTL and gives its token back (which deletes it), and, where
// CONFIG GET is allowed, that maxmemory-policy cannot evict buckets
// silently. each bounds every call of a node's check (the scripts' call,
// tried twice if the first runs out of it: see checkNode); the errors of
// all nodes are joined, each saying what is wrong and what to do.
func (r *Redis) Check(ctx context.Context, each time.Duration) error {
	cc, ok := r.client.(*redis.ClusterClient)
	if !ok {
		single, _ := r.client.(*redis.Client) // a Sentinel's client too
		return r.checkNode(ctx, each, r.checkKey(0), r.client, single, "")
	}
	var mu sync.Mutex // ForEachMaster calls its function concurrently
	var masters []string
	if err := withTimeout(ctx, each, func(ctx context.Context) error {
		return cc.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
			mu.Lock()
			defer mu.Unlock()
			masters = append(masters, c.Options().Addr)
			return nil
		})
	}); err != nil {
		return fmt.Errorf("%w: cannot reach the cluster (%v): check the addresses and that the nodes are up", ErrCheck, err)
	}
	var errs []error
	todo := map[string]bool{}
	for _, m := range masters {
		todo[m] = true
	}
	for i := 0; i < maxCheckKeys && len(todo) > 0; i++ {
		key := r.checkKey(i)
		node, err := cc.MasterForKey(ctx, key)
		if err != nil {
			return fmt.Errorf("%w: no slot map (%v): check the cluster's health", ErrCheck, err)
		}
		addr := node.Options().Addr
		if !todo[addr] {
			continue
		}
		delete(todo, addr)
		if err := r.checkNode(ctx, each, key, r.client, node, addr); err != nil {
			errs = append(errs, err)
		}
		if err := checkEviction(ctx, each, node, addr); err != nil {
			errs = append(errs, err)
		}
	}
	for addr := range todo {
		errs = append(errs, fmt.Errorf("%w: %s: no check key found on this master", ErrCheck, addr))
	}
	return errors.Join(errs...)
}

// checkNode runs the scripts on key through client; node names the node in
// errors (empty: the client's own), and direct, if not nil, is the node's
// own client, whose pool tells whether a call that ran out of time could
// not connect (see dialsFailed). On a non-cluster client it checks the
// eviction policy too.
func (r *Redis) checkNode(ctx context.Context, each time.Duration, key string, client redis.UniversalClient, direct *redis.Client, node string) error {
	where := ""
	if node != "" {
		where = node + ": "
	} else if c, ok := client.(*redis.Client); ok {
		// A single node's address, which the advice to check it needs
		// (a Sentinel client's master moves: not named).
		where = c.Options().Addr + ": "
	}
	try := func(ctx context.Context) error {
		a := &Acquisition{Key: key, Limit: checkLimit, Want: 1, Min: 1, Share: 1}
		if !r.check(a) {
			return a.Err
		}
		bt := r.newBatch([]*Acquisition{a})
		r.runAll(ctx, batchScript, []*invocation{&bt.invocation})
		if bt.decode(); a.Err != nil {
			return a.Err
		}
		// The token back: the bucket is full again, so the key is deleted;
		// the refund's id key and the batch key go too (they would expire
		// in IDLife and batchLife). All three share the check key's slot.
		rf := Refund{Key: key, Limit: checkLimit, Tokens: 1}
		if _, err := r.Apply(ctx, &rf); err != nil {
			return err
		}
		return client.Del(ctx, idKey(key, rf.ID), bt.keys[0]).Err()
	}
	// A second try after a timeout: the first call on a cold client
	// dials, and loads the scripts into Redis, which may take longer than
	// one budget (a Redis a few milliseconds away; an embedded one whose
	// Lua compiles slowly: the quick start's test failed so in CI) and
	// says nothing of the calls that follow. The second must pass within
	// the budget.
	mark := markPool(direct)
	err := withTimeout(ctx, each, try)
	if err != nil && errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
		err = withTimeout(ctx, each, try)
	}
	if err != nil && errors.Is(err, context.DeadlineExceeded) && mark.dialsFailed(direct) {
		return fmt.Errorf("%w: %scannot connect to Redis: every connection the check needed failed to open (go-redis logs why): check the address and that Redis is running", ErrCheck, where)
	}
	if err != nil {
		return fmt.Errorf("%w: %s%s", ErrCheck, where, explain(err))
	}
	if node == "" {
		return checkEviction(ctx, each, client, "")
	}
	return nil
}

// checkEviction reports a maxmemory-policy that can evict buckets. A
// refused CONFIG GET (an ACL without it, a managed Redis) is not an error:
// the policy cannot be known, and the README says what to set.
func checkEviction(ctx context.Context, each time.Duration, client redis.UniversalClient, node string) error {
	var policy string
	_ = withTimeout(ctx, each, func(ctx context.Context) error {
		v, err := client.ConfigGet(ctx, "maxmemory-policy").Result()
		if err == nil {
			policy = v["maxmemory-policy"]
		}
		return err
	})
	switch policy {
	case "", "noeviction", "volatile-ttl":
		return nil
	}
	where := ""
	if node != "" {
		where = node + ": "
	}
	return fmt.Errorf("%w: %smaxmemory-policy is %s, which can evict rate-limit buckets (an evicted bucket reads as full and admits a whole burst): use noeviction on a dedicated instance, or volatile-ttl on a shared one", ErrCheck, where, policy)
}

// explain turns a failed check call into what is wrong and what to do.
func explain(err error) string {
	msg := err.Error()
	switch {
	case redis.IsReadOnlyError(err):
		return "Redis refuses writes (READONLY): the client points at a replica; point it at the master, or use redis.NewFailoverClient (Sentinel) or redis.NewClusterClient"
	case redis.IsOOMError(err):
		return "Redis is out of memory (" + msg + "): raise maxmemory, or free memory on a dedicated instance"
	case redis.HasErrorPrefix(err, "WRONGTYPE"):
		return "a key under the prefix holds another program's data (" + msg + "): give the Limiter its own prefix (WithPrefix)"
	case redis.HasErrorPrefix(err, "BUSY "):
		return "Redis is busy running a script or function (" + msg + "): it answers nothing else until that ends (SCRIPT KILL or FUNCTION KILL ends one that has not written)"
	case redis.IsLoadingError(err), redis.IsMasterDownError(err), redis.IsClusterDownError(err), redis.IsTryAgainError(err):
		return "Redis cannot serve yet (" + msg + "): retry once it has loaded or the cluster has recovered"
	case redis.IsPermissionError(err), errors.Is(err, ErrRefused):
		return "Redis refused a command (" + msg + "): grant the ACL user +evalsha +eval +time +get +set +del on the prefix's keys (see docs/operations.md, \"A least-privilege ACL user\")"
	case redis.IsAuthError(err):
		return "Redis refused the client's credentials (" + msg + "): set Username and Password in the go-redis options to an ACL user of this Redis"
	case errors.Is(err, context.DeadlineExceeded):
		return "cannot reach Redis within the time budget (" + msg + "): check the address, the network, and that Redis is up and not hung"
	case errors.Is(err, ErrScript), errors.Is(err, ErrReply):
		return msg
	}
	return "cannot reach Redis (" + msg + "): check the address and that Redis is running"
}

// poolMark is a node's pool statistics before a check's calls (see
// dialsFailed); ok is false for a client without a pool to read.
type poolMark struct {
	dialstat.Mark
	ok bool
}

// markPool reads c's pool statistics; c may be nil (no mark).
func markPool(c *redis.Client) poolMark {
	if c == nil {
		return poolMark{}
	}
	st := c.PoolStats()
	if st == nil {
		return poolMark{}
	}
	return poolMark{Mark: dialstat.Of(st), ok: true}
}

// dialsFailed reports whether c's pool needed new connections since m and
// opened none (see dialstat): a wrong address or a stopped Redis read as
// "context deadline exceeded" otherwise (a new user's trial: Check on a
// port nothing listens on), while a hung Redis, or one too far for the
// budget, accepts the dial. The statistics say so without a dial of
// leaselimit's own, which a dialer that ignores its context (go-redis's
// own with TLS) could hold past the check's bound, and Close with it (a
// review).
func (m poolMark) dialsFailed(c *redis.Client) bool {
	if !m.ok {
		return false
	}
	st := c.PoolStats()
	return st != nil && m.Failing(dialstat.Of(st))
}

func withTimeout(ctx context.Context, d time.Duration, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return f(ctx)
}
