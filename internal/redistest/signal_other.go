//go:build !unix

package redistest

import (
	"errors"
	"fmt"
	"os"
	"runtime"
)

// pauseProcess is not supported without Unix signals.
func pauseProcess(*os.Process) error {
	return fmt.Errorf("pausing a process on %s: %w", runtime.GOOS, errors.ErrUnsupported)
}

// resumeProcess is not supported without Unix signals.
func resumeProcess(*os.Process) error {
	return fmt.Errorf("resuming a process on %s: %w", runtime.GOOS, errors.ErrUnsupported)
}

// terminateProcess kills p: there is no SIGTERM without Unix signals.
func terminateProcess(p *os.Process) error { return p.Kill() }
