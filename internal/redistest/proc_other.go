//go:build !linux

package redistest

import "syscall"

// sysProcAttr returns nil: only Linux can tie the server's lifetime to ours.
func sysProcAttr() *syscall.SysProcAttr { return nil }
