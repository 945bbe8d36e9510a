package main

import "syscall"

// sysProcAttr puts a child in a process group of its own (Ctrl-C in a
// terminal then reaches only fleet, which stops its children in order) and
// asks the kernel to SIGKILL it if the thread that started it exits, so that
// a crashed or killed fleet leaves no process behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
