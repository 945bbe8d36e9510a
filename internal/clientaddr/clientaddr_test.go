package clientaddr

import (
	"net/netip"
	"testing"
)

func TestKey(t *testing.T) {
	for in, want := range map[string]string{
		"203.0.113.7":                          "203.0.113.7",
		"2001:db8:1:2::1":                      "2001:db8:1:2::/64",
		"2001:db8:1:2:ffff::9":                 "2001:db8:1:2::/64",
		"2001:db8:1:3::1":                      "2001:db8:1:3::/64",
		"64:ff9b::203.0.113.7":                 "203.0.113.7",
		"64:ff9b::198.51.100.1":                "198.51.100.1",
		"64:ff9b:1::1":                         "64:ff9b:1::/64", // not the well-known /96
		"::ffff:0:203.0.113.7":                 "203.0.113.7",    // SIIT
		"2002:c633:6407::1":                    "198.51.100.7",   // 6to4
		"2002:c633:6407:ffff::1":               "198.51.100.7",
		"2001:0:4136:e378:8000:63bf:3fff:fdd2": "192.0.2.45", // Teredo (RFC 4380's example)
		"2001:0:4136:e378:8000:63bf:c0a8:101":  "63.87.254.254",
		"::1":                                  "::1",
		"::203.0.113.7":                        "::cb00:7107",
		"fe80::1":                              "fe80::1",
		"fe80::2":                              "fe80::2",
	} {
		if got := Key(netip.MustParseAddr(in)); got != want {
			t.Errorf("Key(%s) = %s; want %s", in, got, want)
		}
	}
}
