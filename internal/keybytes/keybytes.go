// Package keybytes holds the one rule for the bytes leaselimit puts into
// Redis key names from its configuration (a prefix, a quota's zone name):
// printable ASCII without spaces or braces. A space or a control byte has
// no place in a name an operator reads; a brace would form a Cluster hash
// tag and put every key of the name on one slot.
package keybytes

// FirstBad returns the index of the first byte of s outside the rule, or
// -1 if there is none.
func FirstBad(s string) int {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c > '~' || c == '{' || c == '}' {
			return i
		}
	}
	return -1
}
