package design

import (
	"testing"

	"go.uber.org/goleak"
)

// Every design's Close stops what it started: the layer designs run
// leaselimit's Redis path, whose senders and watchdogs are goroutines.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
