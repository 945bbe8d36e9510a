package redispath

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine outlives them: the
// lanes' senders must be stopped by Wait.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
