//go:build unix

package leaselimit_test

import (
	"syscall"
	"time"
)

// processCPU returns the CPU time (user and system) this process has used,
// for benchmarks that report CPU per decision; ok is false where it cannot
// be read.
func processCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
