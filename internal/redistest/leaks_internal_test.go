package redistest

import (
	"testing"
	"time"

	"go.uber.org/goleak"
)

// TestLeftAfter: a goroutine that ends within the grace is not a leak,
// as go-redis's dial retry ends a second after its client's Close; one
// that outlives it is.
func TestLeftAfter(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	done := make(chan struct{})
	go func() { time.Sleep(1200 * time.Millisecond); close(done) }()
	if err := leftAfter(3*time.Second, ignore); err != nil {
		t.Errorf("a goroutine that ends after 1.2 s, with 3 s of grace: %v", err)
	}
	<-done

	stop := make(chan struct{})
	go func() { <-stop }()
	err := leftAfter(200*time.Millisecond, ignore)
	close(stop)
	if err == nil {
		t.Error("a goroutine that outlives the grace: no leak found")
	}
}
