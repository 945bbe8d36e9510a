// Package deadline tells whether a context has ended, counting a deadline
// that has passed before the context's own timer marked it: that timer
// runs on a goroutine of its own, and a socket deadline or another timer
// set for the same instant can be seen first.
package deadline

import (
	"context"
	"time"
)

// Ended returns ctx's error, or context.DeadlineExceeded once ctx's
// deadline has passed though ctx.Err() is still nil. Regression: under
// load (a CI run under -race), a go-redis read cut by ctx's deadline on
// the socket came back while ctx.Err() was nil, in 19 of 45 runs of a
// test, and the cut call was taken for something else.
func Ended(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return context.DeadlineExceeded
	}
	return nil
}
