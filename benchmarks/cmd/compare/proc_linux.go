package main

import "syscall"

// sysProcAttr asks the kernel to SIGKILL redis-server if the thread that
// started it exits, so a crashed compare run leaves no server behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
