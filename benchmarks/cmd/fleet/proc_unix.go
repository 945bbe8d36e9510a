//go:build unix && !linux

package main

import "syscall"

// sysProcAttr puts a child in a process group of its own: Ctrl-C in a
// terminal then reaches only fleet, which stops its children in order.
func sysProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
