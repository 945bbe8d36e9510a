package httplimit

import (
	"strings"
	"testing"
	"time"
)

func TestCeilSeconds(t *testing.T) {
	for d, want := range map[time.Duration]int64{
		-time.Second: 0, 0: 0, 1: 1, time.Second: 1, time.Second + 1: 2,
		time.Duration(1<<63 - 1): 9223372037,
	} {
		if got := ceilSeconds(d); got != want {
			t.Errorf("ceilSeconds(%v) = %d, want %d", d, got, want)
		}
	}
}

func TestAppendSFString(t *testing.T) {
	for in, want := range map[string]string{
		"default": `"default"`, `a"b`: `"a\"b"`, `a\b`: `"a\\b"`, "tab\there": `"tab?here"`, "é": `"??"`,
	} {
		if got := string(appendSFString(nil, in)); got != want {
			t.Errorf("appendSFString(%q) = %s, want %s", in, got, want)
		}
	}
}

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
	})
}
