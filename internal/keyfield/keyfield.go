// Package keyfield holds the one rule for a rate-limit key read from a
// field of a request (an HTTP header, gRPC metadata): exactly one value,
// not blank, its surrounding spaces trimmed. Keyed by the first of several
// values, a client chose a fresh bucket for every request while whatever
// authenticated it read another.
package keyfield

import "strings"

// Problem says why a field's values give no key.
type Problem int

const (
	None     Problem = iota // the key is the value
	Missing                 // no value, or a blank one
	Repeated                // more than one value
)

// One returns the key of a field with values, or why there is none.
func One(values []string) (string, Problem) {
	switch {
	case len(values) > 1:
		return "", Repeated
	case len(values) == 0:
		return "", Missing
	}
	k := strings.TrimSpace(values[0])
	if k == "" {
		return "", Missing
	}
	return k, None
}
