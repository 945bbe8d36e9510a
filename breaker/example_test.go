package breaker_test

import (
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/leaselimit/leaselimit/breaker"
)

func Example() {
	b := breaker.New("redis", breaker.Settings{Failures: 2, OpenFor: time.Minute})
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	for i := 0; i < 2; i++ {
		done, err := b.Allow()
		if err != nil {
			fmt.Println(err)
			return
		}
		done(refused) // the call failed: it counts against Redis
	}
	fmt.Println(b.State(), b.Rejects(time.Now()))
	_, err := b.Allow()
	fmt.Println(errors.Is(err, breaker.ErrOpen))
	// Output:
	// open true
	// true
}
