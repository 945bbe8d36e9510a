package redistest_test

import (
	"testing"

	"github.com/leaselimit/leaselimit/internal/redistest"
)

// TestMain fails the package if any test leaves a goroutine behind, which
// checks that servers, clients and proxies are fully cleaned up.
func TestMain(m *testing.M) {
	redistest.VerifyTestMain(m)
}
