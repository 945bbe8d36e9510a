package recorder

import (
	"context"
	"errors"
	"net"
	"reflect"
	"strings"

	"github.com/leaselimit/leaselimit/internal/circuit"
	"github.com/redis/go-redis/v9"
)

// timeoutError is implemented by errors that know whether they are timeouts.
type timeoutError interface{ Timeout() bool }

// isTimeout reports a call that ran out of time: its context's deadline,
// the Limiter's time budget, or a network timeout.
func isTimeout(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, circuit.ErrBudget) {
		return true
	}
	var te timeoutError
	return errors.As(err, &te) && te.Timeout()
}

// errorType is the error.type attribute: "network" (no connection could
// be made, even by a dial that timed out, or a broken one), "timeout", the
// error code of a Redis error reply (its first word, such as "NOSCRIPT" or
// "LOADING"), or the Go type of the error.
func errorType(err error) string {
	if circuit.Unreachable(err) {
		return "network"
	}
	if isTimeout(err) {
		return "timeout"
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return "network"
	}
	var re redis.Error
	if errors.As(err, &re) {
		code, _, _ := strings.Cut(re.Error(), " ")
		return code
	}
	return reflect.TypeOf(err).String()
}

// ContextReason is ratelimit.reason (and error.type) of a call a caller's
// context ended: "canceled" or "deadline_exceeded"; "" for any other err.
func ContextReason(err error) string {
	switch {
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline_exceeded"
	}
	return ""
}
