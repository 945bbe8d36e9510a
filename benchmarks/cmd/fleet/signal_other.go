//go:build !unix

package main

import (
	"errors"
	"os"
)

var errNoSignals = errors.New("fleet: stopping and continuing a process needs a Unix system")

func pauseProcess(*os.Process) error       { return errNoSignals }
func resumeProcess(*os.Process) error      { return errNoSignals }
func terminateProcess(p *os.Process) error { return p.Kill() }
func killGroup(p *os.Process)              { _ = p.Kill() }
