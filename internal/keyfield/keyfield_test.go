package keyfield

import "testing"

func TestOne(t *testing.T) {
	for _, tc := range []struct {
		values []string
		key    string
		why    Problem
	}{
		{[]string{"k"}, "k", None},
		{[]string{"  k \t"}, "k", None},
		{nil, "", Missing},
		{[]string{""}, "", Missing},
		{[]string{" "}, "", Missing},
		{[]string{"a", "b"}, "", Repeated},
		{[]string{"", ""}, "", Repeated},
	} {
		if key, why := One(tc.values); key != tc.key || why != tc.why {
			t.Errorf("One(%q) = %q, %v; want %q, %v", tc.values, key, why, tc.key, tc.why)
		}
	}
}
