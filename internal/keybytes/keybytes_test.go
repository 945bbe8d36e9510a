package keybytes

import "testing"

func TestFirstBad(t *testing.T) {
	for s, want := range map[string]int{"": -1, "leaselimit": -1, "Asia/Tokyo": -1, "UTC+9": -1, "a b": 1, "x{y}": 1, "z}": 1, "é": 0, "a\n": 1, "~": -1, "\x7f": 0} {
		if got := FirstBad(s); got != want {
			t.Errorf("FirstBad(%q) = %d; want %d", s, got, want)
		}
	}
}
