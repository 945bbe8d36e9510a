package design

import (
	"testing"

	"github.com/leaselimit/leaselimit/internal/redistest"
)

// Every design's Close stops what it started: the layer designs run
// leaselimit's Redis path, whose senders and watchdogs are goroutines.
func TestMain(m *testing.M) { redistest.VerifyTestMain(m) }
