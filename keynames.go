package leaselimit

import (
	"sync"

	"github.com/leaselimit/leaselimit/authority"
)

// keyNames names the Redis buckets of one limit's keys (authority.Namer's
// Key: a SHA-256 of the key and a string built) and remembers, on each
// processor, the last key it named there. A hot key's calls, which exact
// mode makes one after another on every processor, are named once rather
// than once per call: on one hot key the naming was about a tenth of a
// decision's CPU on the callers' side. A pool, not one shared slot: a
// slot every processor writes on every call of the long tail would move
// its cache line between them each time.
type keyNames struct {
	namer authority.Namer
	last  sync.Pool // of *namedKey: the last key named on a processor
}

// namedKey is a user key and its bucket's Redis key.
type namedKey struct{ key, rkey string }

func newKeyNames(namer authority.Namer) *keyNames { return &keyNames{namer: namer} }

// Key returns the Redis key of key's bucket, namer.Key(key).
func (k *keyNames) Key(key string) string {
	nk, _ := k.last.Get().(*namedKey)
	if nk == nil {
		nk = new(namedKey)
	}
	if nk.rkey == "" || nk.key != key {
		nk.key, nk.rkey = key, k.namer.Key(key)
	}
	rkey := nk.rkey
	k.last.Put(nk)
	return rkey
}
