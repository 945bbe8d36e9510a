package clientaddr

import (
	"net/netip"
	"testing"
)

func TestKey(t *testing.T) {
	for in, want := range map[string]string{
		"203.0.113.7":           "203.0.113.7",
		"2001:db8:1:2::1":       "2001:db8:1:2::/64",
		"2001:db8:1:2:ffff::9":  "2001:db8:1:2::/64",
		"2001:db8:1:3::1":       "2001:db8:1:3::/64",
		"64:ff9b::203.0.113.7":  "203.0.113.7",
		"64:ff9b::198.51.100.1": "198.51.100.1",
		"64:ff9b:1::1":          "64:ff9b:1::/64", // not the well-known /96
	} {
		if got := Key(netip.MustParseAddr(in)); got != want {
			t.Errorf("Key(%s) = %s; want %s", in, got, want)
		}
	}
}
