package httplimit

import (
	"net/http"
	"net/netip"
	"strings"
	"testing"
)

func FuzzParseForwarded(f *testing.F) {
	for _, s := range []string{
		"for=1.2.3.4", `for="[::1]:80";by=x, for=unknown`, `for="a\"b"`, ";;,,", `for="`, "for=a;for=b",
		`host="a,b";for=1.2.3.4`, " for = 1.2.3.4 ",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		fors, ok := parseForwarded(s)
		if !ok && fors != nil {
			t.Fatal("values returned with a parse error")
		}
		for _, v := range fors {
			if ok && strings.Contains(s, v) == false && !strings.Contains(s, `\`) {
				t.Fatalf("value %q not in %q", v, s)
			}
		}
		parseAddr(s)
		// The walk ends, whatever the line holds.
		forwardedChain(http.Header{"Forwarded": {s, s}}, func(netip.Addr, bool) bool { return true })
	})
}
