package fields

import (
	"testing"
	"time"
)

func TestCeilSeconds(t *testing.T) {
	for d, want := range map[time.Duration]int64{
		-time.Second: 0, 0: 0, 1: 1, time.Second: 1, time.Second + 1: 2,
		time.Duration(1<<63 - 1): 9223372037,
	} {
		if got := CeilSeconds(d); got != want {
			t.Errorf("CeilSeconds(%v) = %d, want %d", d, got, want)
		}
	}
}

func TestAppendSFString(t *testing.T) {
	for in, want := range map[string]string{
		"default": `"default"`, `a"b`: `"a\"b"`, `a\b`: `"a\\b"`, "tab\there": `"tab?here"`, "é": `"??"`,
	} {
		if got := string(AppendString(nil, in)); got != want {
			t.Errorf("AppendString(%q) = %s, want %s", in, got, want)
		}
	}
}
