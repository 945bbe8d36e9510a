//go:build !linux

package main

import "time"

func groupCPU(int) (time.Duration, bool) { return 0, false }
func selfCPU() (time.Duration, bool)     { return 0, false }
