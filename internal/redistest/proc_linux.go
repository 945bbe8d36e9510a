package redistest

import "syscall"

// sysProcAttr asks the kernel to SIGKILL the server if the thread that
// started it exits, so that a crashed test binary leaves no server behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
