package lease

import (
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
)

// TestRetryAfterByEachLimitsRule: after the authority denies a refill for
// m tokens, a request for n waits by the rule of each limit, from the
// authority's answer (Collect, Refused) and from the negative cache
// (Decide, Cached) alike: a calendar quota until its boundary, a token
// bucket until its own refill brings n; a multi-limit until every member
// holds n. Regression (issue 24, item 5): both paths extrapolated at the
// envelope's Period/Rate (the slowest member's, a quota's nominal one),
// and Collect not at all when a quota was among the members.
func TestRetryAfterByEachLimitsRule(t *testing.T) {
	const h = time.Hour
	perSecond := policy.Limit{Name: "ps", Rate: 1, Period: time.Second, Burst: 5}
	perHour := policy.PerHour(100).WithName("ph")
	daily := policy.Quota("daily", 100, policy.Day, nil)
	single := func(l policy.Limit) func() *Leases {
		return func() *Leases { return newLeases(l, 1000, 1) }
	}
	// group is For(ps, other): other's refill is the slower, so it is the
	// envelope's (burst 5).
	group := func(other policy.Limit) func() *Leases {
		return func() *Leases {
			ls := NewGroup(refillTable(1000), "ps+"+other.Name, []policy.Limit{perSecond, other}, policy.Lease{}, 1)
			if env := (policy.Limit{Name: "ps+" + other.Name, Rate: other.Rate, Period: other.Period, Burst: 5}); ls.Limit() != env {
				t.Fatalf("envelope %v; want %v", ls.Limit(), env)
			}
			return ls
		}
	}
	// multi is an acquire_all denial: Remaining the least of the parts,
	// ResetAfter the longest.
	multi := func(retry time.Duration, parts ...authority.Part) authority.Grant {
		g := authority.Grant{RetryAfter: retry, Remaining: parts[0].Remaining, Multi: &authority.Multi{Denied: 0, Parts: parts}}
		for _, p := range parts {
			g.Remaining = min(g.Remaining, p.Remaining)
			g.ResetAfter = max(g.ResetAfter, p.ResetAfter)
		}
		return g
	}
	for _, tc := range []struct {
		name string
		ls   func() *Leases
		m, n int64
		g    authority.Grant // the denial of m
		want time.Duration   // n's RetryAfter
	}{
		{"quota 10/day", single(policy.Quota("q", 10, policy.Day, nil)), 1, 5,
			authority.Grant{RetryAfter: 3*h + 57*time.Minute, ResetAfter: 3*h + 57*time.Minute}, 3*h + 57*time.Minute},
		{"quota 10/hour", single(policy.Quota("q", 10, policy.Hour, nil)), 1, 5,
			authority.Grant{RetryAfter: 14 * time.Minute, ResetAfter: 14 * time.Minute}, 14 * time.Minute},
		{"token bucket", single(policy.PerSecond(10)), 1, 3,
			authority.Grant{RetryAfter: 100 * time.Millisecond, ResetAfter: 1100 * time.Millisecond}, 300 * time.Millisecond},
		// 1/s empty, 100/h holds 95: 3 tokens of 1/s, 3s (not 1s + 2 × 36s).
		{"1/s denies", group(perHour), 1, 3,
			multi(time.Second, authority.Part{Remaining: 0, ResetAfter: 5 * time.Second}, authority.Part{Remaining: 95, ResetAfter: 180 * time.Second}), 3 * time.Second},
		// 100/h holds 2: it denies 3 until its own next token, 36s.
		{"100/h denies n", group(perHour), 1, 3,
			multi(time.Second, authority.Part{Remaining: 0, ResetAfter: 5 * time.Second}, authority.Part{Remaining: 2, ResetAfter: 98 * 36 * time.Second}), 36 * time.Second},
		// The daily quota holds 95: 3s (not 1s, nor 1s + 2 × 864s).
		{"1/s denies beside a quota", group(daily), 1, 3,
			multi(time.Second, authority.Part{Remaining: 0, ResetAfter: 5 * time.Second}, authority.Part{Remaining: 95, ResetAfter: 2 * h}), 3 * time.Second},
		// The quota is spent: its boundary, whatever n.
		{"quota denies beside 1/s", group(daily), 1, 3,
			multi(2*h, authority.Part{Remaining: 5}, authority.Part{Remaining: 0, ResetAfter: 2 * h}), 2 * h},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ls := tc.ls()
			now := int64(s)
			// Callers of m and n share one refill: it asks for Min m.
			am, an := ls.Decide("k", tc.m, now), ls.Decide("k", tc.n, now)
			ls.Join(am.Ticket)
			ls.Join(an.Ticket)
			r := ls.Plan(am.Ticket, now)
			if r.Min != tc.m {
				t.Fatalf("Plan = %+v; want Min %d", r, tc.m)
			}
			o, _ := ls.Complete(r, tc.g, now)
			if a := ls.Collect(an.Ticket, o, now); a.Status != Refused || a.RetryAfter != tc.want {
				t.Errorf("Collect(%d) after a denial of %d = %v, RetryAfter %v; want Refused, %v", tc.n, tc.m, a.Status, a.RetryAfter, tc.want)
			}
			if a := ls.Decide("k", tc.n, now); a.Status != Cached || a.RetryAfter != tc.want {
				t.Errorf("Decide(%d) after a denial of %d = %v, RetryAfter %v; want Cached, %v", tc.n, tc.m, a.Status, a.RetryAfter, tc.want)
			}
		})
	}
}

// TestSmallerRequestAfterDenial: a denial of m tokens is not the answer to
// a request for fewer: one the bucket held enough for is not denied,
// neither from the cache nor by collecting a refill it joined too late to
// be counted in. Regression: a large quota denied 1 token for 2h after
// denying 5 with 2 left (the cache took off the nominal refill of 4
// tokens), and a caller of 1 collecting the denial of 5 was refused
// until 5 tokens were due.
func TestSmallerRequestAfterDenial(t *testing.T) {
	for _, tc := range []struct {
		name string
		l    policy.Limit
		g    authority.Grant // the denial of 5
	}{
		{"quota", policy.Quota("q", 1_000_000, policy.Day, nil), authority.Grant{Remaining: 2, RetryAfter: 2 * time.Hour, ResetAfter: 2 * time.Hour}},
		{"token bucket", policy.PerSecond(10), authority.Grant{Remaining: 2, RetryAfter: 300 * time.Millisecond, ResetAfter: 800 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ls := newLeases(tc.l, 1000, 1)
			now := int64(s)
			a5 := ls.Decide("k", 5, now)
			ls.Join(a5.Ticket)
			r := ls.Plan(a5.Ticket, now)
			// A caller of 1 joins after the refill was planned.
			a1 := ls.Decide("k", 1, now)
			ls.Join(a1.Ticket)
			o, _ := ls.Complete(r, tc.g, now)
			if a := ls.Collect(a5.Ticket, o, now); a.Status != Refused || a.RetryAfter != tc.g.RetryAfter {
				t.Errorf("Collect(5) = %v, RetryAfter %v; want Refused, %v", a.Status, a.RetryAfter, tc.g.RetryAfter)
			}
			if a := ls.Collect(a1.Ticket, o, now); a.Status != Miss {
				t.Errorf("Collect(1) of the denial of 5, 2 left = %v, RetryAfter %v; want Miss (ask again)", a.Status, a.RetryAfter)
			}
			if a := ls.Decide("k", 1, now); a.Status != Miss {
				t.Errorf("Decide(1) after the denial of 5, 2 left = %v, RetryAfter %v; want Miss", a.Status, a.RetryAfter)
			}
		})
	}
}

// TestRearmAfterGrantByEachLimitsRule: a key at its limit that takes the
// last tokens of a calendar quota is told the next token is due at the
// boundary, not a nominal per-token refill away.
func TestRearmAfterGrantByEachLimitsRule(t *testing.T) {
	q := policy.Quota("q", 100, policy.Day, time.UTC)
	z := newSizer(q, policy.Lease{TTL: time.Second})
	o := Outcome{Granted: 5, Remaining: 0, Expire: 3 * time.Hour}
	if got := z.oneDue(o); got != 3*time.Hour {
		t.Errorf("quota spent: next token due in %v; want 3h, its boundary", got)
	}
	o.Remaining = 2
	if got := z.oneDue(o); got != 0 {
		t.Errorf("quota with 2 left: next token due in %v; want 0", got)
	}
	b := newSizer(policy.PerSecond(10), policy.Lease{TTL: time.Second})
	if got := b.oneDue(Outcome{Granted: 5, Remaining: 0}); got != 100*time.Millisecond {
		t.Errorf("10/s spent: next token due in %v; want 100ms", got)
	}
}
