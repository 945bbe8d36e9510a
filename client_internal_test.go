package leaselimit

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/internal/circuit"
)

// TestCallerError: errors that are the caller's doing are told apart by
// sentinel, wrapped or not, from failures of leaselimit or Redis (which
// mark a decision span as an error).
func TestCallerError(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("%w: length 0", ErrInvalidKey), true},
		{fmt.Errorf("%w: n = 0", ErrInvalidCost), true},
		{ErrClosed, true},
		{fmt.Errorf("%w: retry after 1s", ErrWouldExceedDeadline), true},
		{context.Canceled, true},
		{context.DeadlineExceeded, true},
		{fmt.Errorf("leaselimit: %w", authority.ErrScript), false},
		{fmt.Errorf("leaselimit: redis: %w", errors.New("NOPERM")), false},
		{circuit.ErrBudget, false},
	} {
		if got := callerError(tc.err); got != tc.want {
			t.Errorf("callerError(%v) = %v; want %v", tc.err, got, tc.want)
		}
	}
}
