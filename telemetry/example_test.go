package telemetry_test

import (
	"fmt"

	"github.com/leaselimit/leaselimit/telemetry"
)

// KeyDigest turns keys into stable digests for spans (with
// leaselimit.WithKeyRedactor): the same on every instance that shares the
// secret, never the key itself.
func ExampleKeyDigest() {
	redact := telemetry.KeyDigest([]byte("a secret shared by the fleet"))
	a, b := redact("user:42"), redact("user:42")
	fmt.Println(len(a), a == b, a != redact("user:43"))
	// Output:
	// 16 true true
}
