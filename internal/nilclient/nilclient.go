// Package nilclient tells whether a Redis client given to leaselimit is
// missing, including a nil pointer in a non-nil interface and a zero value
// that go-redis's constructors did not make.
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
//
// It also reports a zero value of go-redis's client types (new(redis.Client),
// &redis.ClusterClient{}): no options, no pool, and its first method panics
// as a nil one's does (a review: NewClient did, reading its options).
func Is(client redis.UniversalClient) bool {
	if client == nil {
		return true
	}
	v := reflect.ValueOf(client)
	if v.Kind() == reflect.Pointer && v.IsNil() {
		return true
	}
	switch c := client.(type) {
	case *redis.Client:
		// Its Options reads through the embedded *baseClient, nil in a
		// zero Client: that field is read, unexported, through reflect.
		base := v.Elem().FieldByName("baseClient")
		return base.Kind() == reflect.Pointer && base.IsNil()
	case *redis.ClusterClient:
		return c.Options() == nil
	case *redis.Ring:
		return c.Options() == nil
	}
	return false
}
