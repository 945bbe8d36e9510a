package telemetry

import (
	"context"
	"errors"
	"net"
	"reflect"
	"strings"
)

// timeoutError is implemented by errors that know whether they are timeouts.
type timeoutError interface{ Timeout() bool }

func isTimeout(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var te timeoutError
	if errors.As(err, &te) && te.Timeout() {
		return true
	}
	return strings.Contains(err.Error(), "time budget exceeded")
}

// isCallerError reports errors that are the caller's doing (bad input, a
// cancelled context, a closed limiter): not infrastructure failures, so they
// do not mark a span as an error.
func isCallerError(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	msg := err.Error()
	return strings.HasPrefix(msg, "leaselimit: invalid") || strings.HasPrefix(msg, "leaselimit: limiter closed") ||
		strings.HasPrefix(msg, "leaselimit: wait would exceed")
}

// errorType is the error.type attribute: "timeout", a Redis error prefix
// such as "NOSCRIPT" or "LOADING", or the Go type of the error.
func errorType(err error) string {
	if isTimeout(err) {
		return "timeout"
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return "network"
	}
	msg := err.Error()
	if i := strings.IndexByte(msg, ' '); i > 0 && strings.ToUpper(msg[:i]) == msg[:i] {
		return msg[:i]
	}
	return reflect.TypeOf(err).String()
}
