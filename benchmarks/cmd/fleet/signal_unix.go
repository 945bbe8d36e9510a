//go:build unix

package main

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

// killGroup sends SIGKILL to the process group p leads (see sysProcAttr):
// p and what it started, such as nginx's workers.
func killGroup(p *os.Process) {
	if err := syscall.Kill(-p.Pid, syscall.SIGKILL); err != nil {
		_ = p.Kill()
	}
}
