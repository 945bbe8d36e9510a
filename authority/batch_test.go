package authority

import (
	"context"
	"errors"
	"strconv"
	"testing"

	"github.com/leaselimit/leaselimit/policy"
)

// suiteAcquireAll: a batch decides each call as the same calls made one by
// one would, each with its own outcome: a call with bad arguments fails
// alone, two calls on one key see each other in order, and calls the server
// answers NOSCRIPT (after SCRIPT FLUSH) are sent again by EVAL.
func suiteAcquireAll(t *testing.T, nb backendFactory) {
	ctx := context.Background()
	b := nb(t)
	r := b.newAuthority(t, testPrefix)
	l := policy.PerSecond(10) // burst 10
	k := func(i int) string { return r.Key(l, "batch-"+strconv.Itoa(i)) }
	batch := []*Acquisition{
		{Key: k(0), Limit: l, Want: 4, Min: 4, Share: 1},
		{Key: k(1), Limit: l, Want: 10, Min: 10, Share: 1},
		{Key: k(2), Limit: l, Want: 11, Min: 1, Share: 1}, // want > burst: our bug, not sent
		{Key: k(0), Limit: l, Want: 7, Min: 7, Share: 1},  // 6 left after the first: denied
		{Key: k(0), Limit: l, Want: 6, Min: 6, Share: 1},
	}
	b.flushScripts(t)
	r.AcquireAll(ctx, batch)
	want := []struct {
		granted, remaining int64
		err                error
	}{{4, 6, nil}, {10, 0, nil}, {0, 0, ErrScript}, {0, 6, nil}, {6, 0, nil}}
	for i, w := range want {
		a := batch[i]
		if !errors.Is(a.Err, w.err) || (w.err == nil && a.Err != nil) {
			t.Errorf("call %d: err %v; want %v", i, a.Err, w.err)
			continue
		}
		if a.Grant.Granted != w.granted || (w.err == nil && a.Grant.Remaining != w.remaining) {
			t.Errorf("call %d: %+v; want granted %d, remaining %d", i, a.Grant, w.granted, w.remaining)
		}
	}
	if batch[3].Grant.RetryAfter <= 0 {
		t.Errorf("denied call in a batch: RetryAfter %v; want > 0", batch[3].Grant.RetryAfter)
	}
	if got := b.keys(t); len(got) != 2 {
		t.Errorf("keys after the batch: %v; want the two granted buckets", got)
	}
}

func TestAcquireAll(t *testing.T) { forEachBackend(t, suiteAcquireAll) }
