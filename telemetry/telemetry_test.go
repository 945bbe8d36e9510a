package telemetry

import (
	"strings"
	"testing"
)

func TestKeyDigest(t *testing.T) {
	a, b := KeyDigest([]byte("s1")), KeyDigest([]byte("s2"))
	if x, y := a("user-1"), a("user-1"); x != y {
		t.Errorf("digest is not stable: %s, %s", x, y)
	}
	if a("user-1") == a("user-2") || a("user-1") == b("user-1") {
		t.Error("digest does not depend on key and secret")
	}
	if d := a("user-1"); len(d) != 16 || strings.Contains(d, "user") {
		t.Errorf("digest %q: want 16 hex digits and no trace of the key", d)
	}
}

// TestKeyDigestEmptySecret: an empty secret panics at once, rather than
// give digests anyone could reverse by trying the likely keys.
func TestKeyDigestEmptySecret(t *testing.T) {
	for _, secret := range [][]byte{nil, {}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("KeyDigest(%q) did not panic", secret)
				}
			}()
			KeyDigest(secret)
		}()
	}
}
