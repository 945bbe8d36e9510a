// Package nilclient tells whether a Redis client given to leaselimit is
// missing, including a nil pointer in a non-nil interface.
package nilclient

import (
	"reflect"

	"github.com/redis/go-redis/v9"
)

// Is reports whether client is nil, or a nil pointer of a client type
// (a `var rdb *redis.Client` never assigned, passed as a UniversalClient):
// the interface is then not nil, and the first method called on it
// panics. Regression (a new user's trial): NewClient panicked on one in
// reading the client's options, where a nil client gets an error.
func Is(client redis.UniversalClient) bool {
	if client == nil {
		return true
	}
	v := reflect.ValueOf(client)
	return v.Kind() == reflect.Pointer && v.IsNil()
}
