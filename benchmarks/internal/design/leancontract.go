package design

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// The lean contract: the lean floor with only what leaselimit's contract
// makes every Redis design pay, and nothing of leaselimit's own code:
//
//   - bucket keys named as leaselimit names them (DESIGN.md: a digest of
//     the user key, never its bytes, under the prefix, the limit's name and
//     its parameters), by authority.Namer: the same length, and a SHA-256
//     per decision;
//   - resend safety per batch (issue 25): a batch key that holds the
//     batch's reply once it granted anything, so that a batch go-redis
//     resends returns that reply instead of taking twice. The script
//     decides, then reads and claims the key in one command (SET NX GET,
//     or a GET for a batch that granted nothing), and writes its buckets
//     only once it knows the batch is not a resend: a command fewer per
//     batch than a GET first and a SET last;
//   - one cost per call in, two values per call back (the grant and the
//     whole tokens left, for Decision.Remaining), in one bulk string, the
//     form a stored reply takes;
//   - calls on one key decided in order in one batch, the key read and
//     written once (issue 25, item 2): what lets a batched design serve
//     one hot key at less than a GET and a SET per decision.
//
// Batching, script and state are otherwise the floor's. Its share of the
// floor is what the contract costs on the machine at hand; leaselimit's
// share of it is what leaselimit's own code costs over that.

// leanContractScript decides one batch. KEYS[1] is the batch key, then one
// bucket per call (repeats allowed: a repeated key is read once, decided
// in order, and written once, after the last call). ARGV: the batch key's life in ms, r, p
// (the limit as r tokens every p µs, reduced), burst, then one cost per
// call. Returns "<granted> <whole tokens left>" per call, space-separated.
var leanContractScript = redis.NewScript(`
local r, p, burst = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local out, any = {}, false
local W, F, T, written, nw = {}, {}, {}, {}, 0
for i = 2, #KEYS do
  local k, cost = KEYS[i], tonumber(ARGV[i + 3])
  if not W[k] then
` + leanBucketAt + `    W[k], F[k], T[k] = w, f, t
  end
  local w, g = W[k], 0
  if w >= cost then
    g, w, any = cost, w - cost, true
    W[k] = w
    if not written[k] then written[k], nw = true, nw + 1; written[nw] = k end
  end
  out[i - 1] = string.format('%d %d', g, w)
end
local reply = table.concat(out, ' ')
local done
if any then done = redis.call('SET', KEYS[1], reply, 'NX', 'GET', 'PX', ARGV[1]) else done = redis.call('GET', KEYS[1]) end
if done then return done end
for j = 1, nw do
  local k = written[j]
  local w, f = W[k], F[k]
  local ttl = math.ceil(((burst - w) * p - f) / r / 1000) + 1000
  redis.call('SET', k, string.format('%d %d %d', w, f, T[k]), 'PX', ttl)
end
return reply
`)

// leanContractLife is how long a batch key keeps its reply (ms), as long as
// go-redis may take to resend a batch.
const leanContractLife = 10_000

// leanContract sends the lean contract's batches: the floor's arguments
// with the batch key's life first, and the names of its keys.
type leanContract struct {
	client *redis.Client
	head   []any // life, r, p, burst: read-only, shared by all batches
	namer  authority.Namer
	prefix string // of batch keys
	idBase string // this decider's, random, as leaselimit's request ids
	seq    atomic.Uint64
}

func newLeanContract(client *redis.Client, limit policy.Limit) (Decider, error) {
	c, err := newContractBatches(client, limit, "ll-contr")
	if err != nil {
		return nil, err
	}
	return &leanDecider{send: c.send, keyOf: c.namer.Key}, nil
}

// newLeanNecessary returns the lean necessary design: the contract's
// batches, sent as lean_handoff sends them (see leanhandoff.go).
func newLeanNecessary(client *redis.Client, limit policy.Limit) (Decider, error) {
	c, err := newContractBatches(client, limit, "ll-necss")
	if err != nil {
		return nil, err
	}
	return newHandoff(LeanNecessary, c.send, c.namer.Key), nil
}

// newContractBatches returns the sender of the contract's batches, its
// keys under prefix: as long as the leaselimit designs' ("ll-exact"), so
// that keys are the same length, and the design's own.
func newContractBatches(client *redis.Client, limit policy.Limit, prefix string) (*leanContract, error) {
	b, err := newLeanBatches(client, limit)
	if err != nil {
		return nil, err
	}
	auth, err := authority.New(client, prefix)
	if err != nil {
		return nil, err
	}
	var rnd [8]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, err
	}
	return &leanContract{client: client, head: append([]any{leanContractLife}, b.args...),
		namer: auth.Namer(limit), prefix: prefix, idBase: hex.EncodeToString(rnd[:]) + "-b"}, nil
}

// batchKey returns a new batch key, in the slot of bucket (the batch's
// first key).
func (c *leanContract) batchKey(bucket string) string {
	tag := bucket
	if i := strings.IndexByte(tag, '{'); i >= 0 {
		tag = tag[i+1 : len(tag)-1] // the digest
	}
	return c.prefix + ":batch:{" + tag + "}:" + c.idBase + strconv.FormatUint(c.seq.Add(1), 36)
}

// send runs one batch and hands each call its outcome.
func (c *leanContract) send(ctx context.Context, batch []*leanCall) {
	keys := make([]string, 1+len(batch))
	keys[0] = c.batchKey(batch[0].key)
	args := make([]any, len(c.head), len(c.head)+len(batch))
	copy(args, c.head)
	for i, call := range batch {
		keys[1+i] = call.key
		args = append(args, max(call.cost, 1))
	}
	reply, err := leanContractScript.Run(context.WithoutCancel(ctx), c.client, keys, args...).Text()
	var fields []string
	if err == nil {
		fields = strings.Fields(reply)
		if len(fields) != 2*len(batch) {
			err = fmt.Errorf("design: %s: %d values for %d calls", LeanContract, len(fields), len(batch))
		}
	}
	for i, call := range batch {
		if err != nil {
			call.err = err
		} else {
			call.allowed = fields[2*i] != "0"
		}
		close(call.done)
	}
}
