package redispath

import (
	"testing"

	"github.com/leaselimit/leaselimit/internal/redistest"
)

// TestMain fails the package's tests if any goroutine outlives them: the
// lanes' senders must be stopped by Wait.
func TestMain(m *testing.M) {
	redistest.VerifyTestMain(m)
}
