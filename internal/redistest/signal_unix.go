//go:build unix

package redistest

import (
	"os"
	"syscall"
)

// pauseProcess stops p with SIGSTOP.
func pauseProcess(p *os.Process) error { return p.Signal(syscall.SIGSTOP) }

// resumeProcess continues p with SIGCONT.
func resumeProcess(p *os.Process) error { return p.Signal(syscall.SIGCONT) }

// terminateProcess asks p to exit with SIGTERM.
func terminateProcess(p *os.Process) error { return p.Signal(syscall.SIGTERM) }
