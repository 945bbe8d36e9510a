package redistest

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// leakGrace is how long VerifyTestMain lets goroutines end after the last
// test: go-redis's retry of a failed dial (ConnPool.tryDial), which a
// client starts once it counts as many failed dials as its pool's size,
// sleeps a second between dials and ends only at its next turn once its
// client is closed; goleak's own retries give up after about half a
// second.
const leakGrace = 3 * time.Second

// VerifyTestMain runs m's tests and then, if they passed, fails the run
// when goroutines are left (as goleak.VerifyTestMain does), once they have
// had leakGrace to end. Call it from TestMain.
func VerifyTestMain(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	if code == 0 {
		if err := leftAfter(leakGrace, opts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: Errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// leftAfter looks for leaked goroutines until none is left or grace has
// passed, and returns what the last look found.
func leftAfter(grace time.Duration, opts ...goleak.Option) error {
	end := time.Now().Add(grace)
	for {
		err := goleak.Find(opts...)
		if err == nil || time.Now().After(end) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}
