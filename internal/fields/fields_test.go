package fields

import (
	"strings"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
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

// TestMemberNamesTheDecidingLimit: a multi-limit's decision without parts
// (the failure policy's) is one member, named after the limit that
// decided: named after the first, FailLocal's daily share read as the
// burst limit's numbers.
func TestMemberNamesTheDecidingLimit(t *testing.T) {
	burst := policy.Limit{Name: "burst", Rate: 1000, Period: time.Second, Burst: 1000}
	daily := policy.Quota("daily", 4, policy.Day, nil)
	ps := []*Policy{NewPolicy(burst), NewPolicy(daily)}
	d := leaselimit.Decision{Allowed: true, Limit: daily, Remaining: 3, ResetAfter: 6 * time.Hour, Source: leaselimit.SourceFallback}
	if got := Member(ps, 0, d); !strings.HasPrefix(got, `"daily";`) {
		t.Errorf("Member of the daily share's decision = %s; want it named daily", got)
	}
}

// TestResetAfterOfTheTightLimit: the legacy reset of a multi-limit's
// decision is its tight limit's, not the longest of all (a 10/s limit
// said to be full again in 519 s, the daily quota's time).
func TestResetAfterOfTheTightLimit(t *testing.T) {
	perSecond := policy.Limit{Name: "ps", Rate: 10, Period: time.Second, Burst: 10}
	daily := policy.Quota("daily", 1000, policy.Day, nil)
	d := leaselimit.Decision{Allowed: true, Limit: perSecond, ResetAfter: 519 * time.Second, Parts: []leaselimit.Part{
		{Limit: perSecond, Remaining: 4, ResetAfter: 600 * time.Millisecond},
		{Limit: daily, Remaining: 994, ResetAfter: 519 * time.Second},
	}}
	if got := ResetAfter(perSecond, d); got != 600*time.Millisecond {
		t.Errorf("ResetAfter(per second) = %v; want 600ms, its part's", got)
	}
	if got := ResetAfter(perSecond, leaselimit.Decision{ResetAfter: time.Second}); got != time.Second {
		t.Errorf("ResetAfter without parts = %v; want the decision's", got)
	}
}
