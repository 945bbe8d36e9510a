package design

import (
	"context"
	"errors"
	"sync"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/leaselimit/leaselimit/internal/recorder"
	"github.com/leaselimit/leaselimit/internal/redispath"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// The layers: exact mode built up one of leaselimit's layers at a time,
// to tell which layer costs what between lean_contract and
// leaselimit_exact (not run unless named: see Layers).
//
//   - leaselimit_authority is lean_contract with leaselimit's authority
//     package in place of the contract's script and client code: its batch
//     script, the building and decoding of a batch (AcquireAll). Batches
//     are sent as the floor's are, by the caller that finds a pipeline free.
//   - leaselimit_path adds leaselimit's Redis path (internal/redispath):
//     the lane's senders, the breaker, the budget's waiter, the call's span
//     and metrics. Calls as exact mode makes them, without the Limiter.
//
// leaselimit_exact then adds the Limiter: its checks, routing, the
// decision's span, metrics and Decision.
//
// One more design runs only when named: lean_necessary, lean_contract's
// batches sent as lean_handoff sends them (long-lived senders, each caller
// waiting at most the budget). It is the prototype that does only what
// leaselimit's exact mode must do on a client with go-redis's default
// options, and no more: a target it misses in a run is out of reach there.
// Another, lean_lease, is lean_necessary with leases for the keys that
// repeat (see leanlease.go): leases' prototype on the cold long tail.
const (
	LeaselimitAuthority = "leaselimit_authority"
	LeaselimitPath      = "leaselimit_path"
	LeanNecessary       = "lean_necessary"
	LeanLease           = "lean_lease"
)

// Layers lists the designs that run only when named: the layers, in the
// order they build up, then lean_necessary.
var Layers = []string{LeaselimitAuthority, LeaselimitPath, LeanNecessary, LeanLease}

// authorityLayer sends the floor's batches through authority.AcquireAll.
type authorityLayer struct {
	auth  *authority.Redis
	limit policy.Limit
}

func newAuthorityLayer(client *redis.Client, limit policy.Limit) (Decider, error) {
	auth, err := authority.New(client, "ll-auth")
	if err != nil {
		return nil, err
	}
	a := &authorityLayer{auth: auth, limit: limit}
	return &leanDecider{send: a.send, keyOf: auth.Namer(limit).Key}, nil
}

// acquisitions holds a batch's calls for reuse, as exact mode keeps each
// call's in a pooled value: a batch of Acquisitions is 14 KB.
var acquisitions = sync.Pool{New: func() any { return new(acquisitionBatch) }}

type acquisitionBatch struct {
	calls [leanMaxBatch]authority.Acquisition
	ptrs  [leanMaxBatch]*authority.Acquisition
}

func (a *authorityLayer) send(ctx context.Context, batch []*leanCall) {
	b := acquisitions.Get().(*acquisitionBatch)
	defer acquisitions.Put(b)
	as := b.ptrs[:len(batch)]
	for i, c := range batch {
		b.calls[i] = authority.Acquisition{Key: c.key, Limit: a.limit, Want: 1, Min: 1, Share: 1}
		as[i] = &b.calls[i]
	}
	a.auth.AcquireAll(context.WithoutCancel(ctx), as)
	for i, c := range batch {
		c.allowed, c.err = as[i].Grant.Granted > 0, as[i].Err
		close(c.done)
	}
}

// pathLayer makes exact calls through leaselimit's Redis path.
type pathLayer struct {
	path   *redispath.Path
	caller *redispath.Caller
	limit  policy.Limit
	namer  authority.Namer
}

// errPathClosed is a call's error once the design is closed.
var errPathClosed = errors.New("design: " + LeaselimitPath + ": closed")

func newPathLayer(client *redis.Client, limit policy.Limit) (Decider, error) {
	const prefix = "ll-path"
	auth, err := authority.New(client, prefix)
	if err != nil {
		return nil, err
	}
	// Telemetry as a Client has it with no providers set: the global ones.
	tel, err := recorder.New(recorder.Config{Prefix: prefix, Sources: []string{"lease", "authority", "cache", "fallback"}})
	if err != nil {
		return nil, err
	}
	path := redispath.New(redispath.Config{Client: client, Auth: auth, Budget: leaselimit.DefaultTimeout,
		Name: "leaselimit:" + prefix, Breaker: circuit.Settings{}.WithDefaults(), Tel: tel,
		Closed: errPathClosed, Unavailable: errPathClosed})
	return &pathLayer{path: path, caller: path.Caller(tel.WithLimit(limit.Name), dropGrants{}), limit: limit,
		namer: auth.Namer(limit)}, nil
}

func (d *pathLayer) Allow(ctx context.Context, key string) (Result, error) {
	rkey := d.namer.Key(key)
	g, err := d.caller.Acquire(ctx, &redispath.Call{Brk: d.path.Route(rkey),
		Acq: authority.Acquisition{Key: rkey, Limit: d.limit, Want: 1, Min: 1, Share: 1}})
	return Result{Allowed: err == nil && g.Granted > 0}, err
}

func (d *pathLayer) Close() error {
	d.path.Close()
	d.path.Wait()
	return nil
}

// dropGrants is the path layer's Receiver: it makes no lease refills, and
// a grant whose caller left is not given back (a Limiter refunds it).
type dropGrants struct{}

func (dropGrants) Arrived(redispath.Call, authority.Grant)   {}
func (dropGrants) Unclaimed(redispath.Call, authority.Grant) {}
func (dropGrants) Saturated()                                {}
