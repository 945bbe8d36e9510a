package lease

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
)

// The ledger in the lease: tokens keep where they came from (the grant's
// time and a calendar quota's window), a refill never revives tokens of an
// expired lease or of another window, and whatever leaves the lease says
// where it goes back to.

// TestInstallNeverRevivesExpiredTokens: a refill that finds the lease
// expired takes its tokens out (to return them) rather than counting them
// as the live lease and adding its grant to them, which revived a quota's
// tokens in the next window.
func TestInstallNeverRevivesExpiredTokens(t *testing.T) {
	z := newSizer(policy.PerSecond(1000), policy.Lease{TTL: time.Second})
	e := &entry{key: "k"}
	z.Install(e, request{Want: 10, Min: 1}, Outcome{Granted: 10, Remaining: bigRemaining, At: 100}, 1*s)
	e.AddPending(1)
	req, expired := z.Plan(e, 3*s) // the lease expired at 2s
	if expired.tokens != 10 || expired.since != 100 {
		t.Fatalf("Plan on an expired lease took out %+v; want its 10 tokens, stamped 100", expired)
	}
	if _, stale := z.Install(e, req, Outcome{Granted: 5, Remaining: bigRemaining, Min: req.Min, At: 300}, 3*s); stale.tokens != 0 {
		t.Errorf("Install returned %+v stale; the plan took them already", stale)
	}
	if got := e.Tokens() + e.Reserved(); got != 5 {
		t.Errorf("lease holds %d after the refill; want its 5, none of the expired 10", got)
	}
	if e.since != 300 {
		t.Errorf("since = %d; want 300, the new grant's (the lease was empty)", e.since)
	}
}

// TestInstallOfAnotherWindow: a grant of a quota's next window does not
// join a lease still live on the local clock but of the last window (the
// call crossed the boundary): those tokens come out, stamped with their
// window.
func TestInstallOfAnotherWindow(t *testing.T) {
	z := newSizer(policy.Quota("q", 1000, policy.Hour, time.UTC), policy.Lease{TTL: time.Minute, IdleTTL: time.Hour})
	e := &entry{key: "k"}
	z.Install(e, request{Want: 10, Min: 1}, Outcome{Granted: 10, Remaining: bigRemaining, At: 100, Window: 1000}, 1*s)
	if _, stale := z.Install(e, request{Want: 4, Min: 1}, Outcome{Granted: 4, Remaining: bigRemaining, At: 1200, Window: 2000}, 2*s); stale.tokens != 10 || stale.window != 1000 || stale.since != 100 {
		t.Errorf("stale = %+v; want the 10 tokens of window 1000, stamped 100", stale)
	}
	if e.Tokens() != 4 || e.window != 2000 || e.since != 1200 {
		t.Errorf("lease = %d tokens, window %d, since %d; want 4 of window 2000 since 1200", e.Tokens(), e.window, e.since)
	}
	// A grant of the same window joins, and the lease keeps the earlier
	// stamp: a lower bound of every token it holds.
	if _, stale := z.Install(e, request{Want: 3, Min: 1}, Outcome{Granted: 3, Remaining: bigRemaining, At: 1500, Window: 2000}, 3*s); stale.tokens != 0 {
		t.Errorf("stale = %+v for a grant of the same window", stale)
	}
	if e.Tokens() != 7 || e.since != 1200 {
		t.Errorf("lease = %d tokens since %d; want 7 since 1200", e.Tokens(), e.since)
	}
}

// TestGiveKeepsStamps: a surplus joins a live lease only when its tokens
// are no older than the lease's (tokens from before a Reset must not join a
// lease of the fresh bucket, where they would be spent) and of its window.
func TestGiveKeepsStamps(t *testing.T) {
	z := newSizer(policy.Quota("q", 1000, policy.Hour, time.UTC), policy.Lease{TTL: time.Minute, IdleTTL: time.Hour})
	e := &entry{key: "k"}
	z.Install(e, request{Want: 10, Min: 1}, Outcome{Granted: 10, Remaining: bigRemaining, At: 500, Window: 1000}, 1*s)
	if e.Give(3, 600, 600, 2000, 2*s) {
		t.Error("Give of another window's surplus joined the lease")
	}
	if e.Give(3, 50, 50, 1000, 2*s) {
		t.Error("Give of a surplus older than the lease (before a Reset, maybe) joined it")
	}
	if e.Give(3, 0, 0, 1000, 2*s) {
		t.Error("Give of a surplus of an unknown stamp joined the lease")
	}
	if !e.Give(3, 600, 700, 1000, 2*s) || e.Tokens() != 13 || e.since != 500 || e.newest != 700 {
		t.Errorf("Give of 3 stamped 600 to 700: lease %d since %d newest %d; want 13 since 500 newest 700 (an excess taken from them may be of 700)", e.Tokens(), e.since, e.newest)
	}
	h := e.drainHeld()
	if h.tokens != 13 || h.since != 500 || h.window != 1000 || h.windows != nil {
		t.Errorf("drained %+v; want 13 tokens since 500 of window 1000", h)
	}
}

// TestChargeNeverFromAQuotaLease: an excess comes out of a token bucket's
// live lease (its unused tokens all go back to the bucket), never out of a
// calendar quota's, alone or in a multi-limit: what such a lease holds at
// its window's end is lost, so a charge paid from it would cost nothing
// (TestFleetLedger, seed 154231781: 4 over a quota of 45).
func TestChargeNeverFromAQuotaLease(t *testing.T) {
	q := policy.Quota("q", 1000, policy.Hour, time.UTC)
	b := policy.PerSecond(1000)
	for _, tc := range []struct {
		name string
		ls   func(tab *Table) *Leases
		want bool
	}{
		{"token bucket", func(tab *Table) *Leases { return New(tab, b, policy.Lease{}, 1) }, true},
		{"quota", func(tab *Table) *Leases { return New(tab, q, policy.Lease{}, 1) }, false},
		{"multi-limit with a quota", func(tab *Table) *Leases {
			return NewGroup(tab, "b+q", []policy.Limit{b, q}, policy.Lease{}, 1)
		}, false},
	} {
		ls := tc.ls(refillTable(64))
		a := ls.Decide("k", 1, 1*s)
		ls.Join(a.Ticket)
		r := ls.Plan(a.Ticket, 1*s)
		ls.Complete(r, authority.Grant{Granted: 10, Remaining: 500, At: 5, ResetAfter: time.Minute}, 1*s)
		if got := ls.Charge("k", 4, 5, 2*s); got != tc.want {
			t.Errorf("%s: Charge(4) from a lease of 10 = %v; want %v", tc.name, got, tc.want)
		}
	}
}

// TestChargeKeepsGenerations: an excess comes out of a live lease only
// when its reservation's tokens are no older than the lease's (as a
// surplus joins one): the excess of a reservation taken before a Reset is
// not paid from a lease of the fresh bucket, which would charge the fresh
// bucket; nor is one whose tokens' stamp is unknown.
func TestChargeKeepsGenerations(t *testing.T) {
	ls := New(refillTable(64), policy.PerSecond(1000), policy.Lease{}, 1)
	a := ls.Decide("k", 1, 1*s)
	ls.Join(a.Ticket)
	r := ls.Plan(a.Ticket, 1*s)
	ls.Complete(r, authority.Grant{Granted: 10, Remaining: 500, At: 500}, 1*s) // the fresh bucket's, granted at 500
	for _, tc := range []struct {
		since int64
		want  bool
	}{{499, false}, {0, false}, {500, true}, {600, true}} {
		if got := ls.Charge("k", 1, tc.since, 2*s); got != tc.want {
			t.Errorf("Charge(1) of a reservation stamped %d from a lease stamped 500 = %v; want %v", tc.since, got, tc.want)
		}
	}
}

// TestLateInstallOfAWindowsTokens: a grant of a calendar quota's window
// whose reply arrives late (installed after the window's end) does not get
// a fresh life: its lease ends a window's remaining time after the plan,
// which came before the grant.
func TestLateInstallOfAWindowsTokens(t *testing.T) {
	z := newSizer(policy.Quota("q", 1000, policy.Hour, time.UTC), policy.Lease{TTL: time.Minute, IdleTTL: time.Hour})
	e := &entry{key: "k"}
	e.AddPending(1)
	req, _ := z.Plan(e, 1*s)
	// Redis granted 2s before the boundary; the reply lands 3s later.
	z.Install(e, req, Outcome{Granted: 10, Remaining: bigRemaining, Min: req.Min, Expire: 2 * time.Second, At: 7, Window: 9}, 4*s)
	if ok, _ := e.Take(1, 4*s); ok {
		t.Error("a lease of the last window's tokens served after the window ended")
	}
}

// TestCompleteStampsReturns: the tokens a refill brings for an evicted key
// go back stamped with the grant: its time and, for a quota, the end of its
// window (the grant's time plus the time to the boundary).
func TestCompleteStampsReturns(t *testing.T) {
	q := policy.Quota("q", 1000, policy.Hour, time.UTC)
	z := newSizer(q, policy.Lease{TTL: time.Minute, IdleTTL: time.Hour})
	e := &entry{key: "k"}
	ls := over(z, e)
	e.AddPending(1)
	r := ls.Plan(Ticket{e: e, n: 1}, 1*s)
	e.removed.Store(true)
	_, back := ls.Complete(r, authority.Grant{Granted: 5, Remaining: 900, At: 7_000_000, ResetAfter: 3 * time.Second}, 1*s)
	if len(back) != 1 || back[0].Tokens != 5 || back[0].Since != 7_000_000 || back[0].Window != 10_000_000 {
		t.Errorf("returned %+v; want the 5 granted, since 7000000, window 10000000", back)
	}
}

// TestSurrender: the unspent tokens of a live lease come out stamped, the
// negative cache ends, and the tokens set aside for waiting callers stay.
func TestSurrender(t *testing.T) {
	z := newSizer(policy.PerSecond(1000), policy.Lease{TTL: time.Minute, IdleTTL: time.Hour})
	e := &entry{key: "k"}
	ls := over(z, e)
	z.Install(e, request{Want: 10, Min: 1, Need: 2}, Outcome{Granted: 10, Remaining: bigRemaining, At: 42}, 1*s)
	e.denyUntil.Store(5 * s)
	r := ls.Surrender("k", 2*s)
	if r.Tokens != 8 || r.Since != 42 || r.Key != "k" {
		t.Errorf("Surrender = %+v; want the 8 unreserved tokens, since 42", r)
	}
	if e.Tokens() != 0 || e.Reserved() != 2 || e.denyUntil.Load() != 0 {
		t.Errorf("after Surrender: %d tokens, %d reserved, denyUntil %d; want 0, 2, 0", e.Tokens(), e.Reserved(), e.denyUntil.Load())
	}
	if st, ok := ls.Stamps("k", 1*s); !ok || st.Since != 42 {
		t.Errorf("Stamps = %+v, %v; want Since 42, true", st, ok)
	}
	if st, ok := ls.Stamps("k", e.expires.Load()); ok {
		t.Errorf("Stamps of the expired lease = %+v, true; want false: its next refill's tokens are not its own", st)
	}
}

// TestCachedDenialLeavesPooledRequests: the negative cache does not deny a
// request larger than the lease that the lease and the bucket hold
// together (a Settle surplus in the lease): it goes to the authority, whose
// denial the caller pools with the lease. One neither can serve stays
// denied here.
func TestCachedDenialLeavesPooledRequests(t *testing.T) {
	z := newSizer(policy.PerSecond(10), policy.Lease{TTL: time.Minute, IdleTTL: time.Hour})
	e := &entry{key: "k"}
	ls := over(z, e)
	z.Install(e, request{Want: 12, Min: 1}, Outcome{Granted: 12, Remaining: 9, At: 1}, 1*s)
	e.denyUntil.Store(10 * s)
	e.denyMin.Store(20)
	if a := ls.Decide("k", 20, 2*s); a.Status != Miss {
		t.Errorf("Decide(20) with 12 leased and 9 in the bucket = %v; want Miss (pooled)", a.Status)
	}
	if a := ls.Decide("k", 25, 2*s); a.Status != Cached {
		t.Errorf("Decide(25) = %v; want Cached: 21 cannot serve it", a.Status)
	}
}

// TestPooled: Leases.Pooled says what the negative cache's check says, for
// a live lease only.
func TestPooled(t *testing.T) {
	z := newSizer(policy.PerSecond(10), policy.Lease{TTL: time.Minute, IdleTTL: time.Hour})
	e := &entry{key: "k"}
	ls := over(z, e)
	z.Install(e, request{Want: 12, Min: 1}, Outcome{Granted: 12, Remaining: 9, At: 1}, 1*s)
	for _, tc := range []struct {
		n, now int64
		want   bool
	}{
		{20, 2 * s, true},   // 12 leased + 9 in the bucket
		{21, 2 * s, true},   // exactly
		{22, 2 * s, false},  // neither together
		{10, 2 * s, false},  // the lease alone
		{20, 62 * s, false}, // the lease expired
	} {
		if got := ls.Pooled("k", tc.n, tc.now); got != tc.want {
			t.Errorf("Pooled(%d) at %ds = %v; want %v", tc.n, tc.now/s, got, tc.want)
		}
	}
}

// TestQuotaReservedTokensEndWithTheirWindow: a caller that joined a refill
// of a calendar quota whose reply came after the window's end is not
// admitted from that window's tokens (5,001 of 5,000 in a new day, under
// -race); for a token bucket the tokens set aside are its own.
func TestQuotaReservedTokensEndWithTheirWindow(t *testing.T) {
	for _, tc := range []struct {
		limit policy.Limit
		want  Status
	}{
		{policy.Quota("q", 1000, policy.Hour, time.UTC), Miss},
		{policy.PerSecond(1000), Granted},
	} {
		ls := New(refillTable(64), tc.limit, policy.Lease{}, 1)
		a := ls.Decide("k", 1, 1*s)
		ls.Join(a.Ticket)
		r := ls.Plan(a.Ticket, 1*s)
		// Granted 2s before the boundary; the reply is collected 3s later.
		o, _ := ls.Complete(r, authority.Grant{Granted: 5, Remaining: 500, At: 7, ResetAfter: 2 * time.Second}, 4*s)
		if tc.limit.IsQuota() {
			o.Expire = 2 * time.Second
		}
		if got := ls.Collect(a.Ticket, o, 4*s); got.Status != tc.want {
			t.Errorf("%v: Collect after the window's end = %v; want %v", tc.limit, got.Status, tc.want)
		}
	}
}

// TestMultiLimitReturnCarriesWindows: a multi-limit's unused lease tokens
// go back with each member's window end (0 for a token bucket), so that its
// calendar quotas take them back within their windows: on Surrender, on
// expiry (Sweep), on Drain (Close), and for a grant that lands after its
// key was forgotten. Regression: the Return carried one Window, the
// soonest, which no quota member's refund could use, so the quotas kept
// none of the tokens.
func TestMultiLimitReturnCarriesWindows(t *testing.T) {
	bucket := policy.Limit{Name: "b", Rate: 1000, Period: time.Second, Burst: 100_000}
	daily := policy.Quota("d", 1_000_000, policy.Day, nil)
	settings := policy.Lease{TTL: time.Minute, IdleTTL: time.Hour}
	ls := NewGroup(refillTable(1000), "b+d", []policy.Limit{bucket, daily}, settings, 1)
	const at = int64(1_000_000_000) // the server's clock at the grant, µs
	g := authority.Grant{Granted: 10, Remaining: 500_000, At: at, Multi: &authority.Multi{Denied: -1,
		Parts: []authority.Part{{Remaining: 99_990, ResetAfter: 10 * time.Millisecond}, {Remaining: 500_000, ResetAfter: 2 * time.Hour}}}}
	want := []int64{0, at + (2 * time.Hour).Microseconds()}
	now := int64(s)
	// leased gives key a lease of g's 10 tokens.
	leased := func(key string) {
		t.Helper()
		a := ls.Decide(key, 1, now)
		if a.Status != Miss {
			t.Fatalf("Decide(%q) = %+v; want Miss", key, a)
		}
		o := Outcome{Granted: g.Granted, Remaining: g.Remaining, At: g.At, Window: ls.window(g), Parts: g.Multi}
		ls.sizer.Install(a.Ticket.e, request{Want: 10, Min: 1}, o, now)
		if n := a.Ticket.e.Tokens(); n != 10 {
			t.Fatalf("lease of %q holds %d; want 10", key, n)
		}
	}
	check := func(how string, r Return) {
		t.Helper()
		if r.Tokens != 10 || len(r.Limits) != 2 || !slices.Equal(r.Windows, want) {
			t.Errorf("%s: %+v; want 10 tokens to both members, windows %v", how, r, want)
		}
	}

	leased("surrendered")
	check("Surrender", ls.Surrender("surrendered", now))

	leased("expired")
	rs := swept(tableOf(ls), now+int64(settings.TTL))
	if len(rs) != 1 {
		t.Fatalf("Sweep after the TTL = %+v; want the expired lease", rs)
	}
	check("Sweep", rs[0])

	leased("drained")
	if rs = tableOf(ls).Drain(); len(rs) != 1 {
		t.Fatalf("Drain = %+v; want the live lease", rs)
	}
	check("Drain", rs[0])

	a := ls.Decide("forgotten", 1, now)
	ls.Join(a.Ticket)
	r := ls.Plan(a.Ticket, now)
	ls.Forget("forgotten")
	_, back := ls.Complete(r, authority.Grant{Granted: 10, Remaining: g.Remaining, At: at, Multi: g.Multi}, now)
	if len(back) != 1 {
		t.Fatalf("Complete for a forgotten key returned %+v; want its grant", back)
	}
	check("a grant for a forgotten key", back[0])
}

// TestFreshGrantKeepsItsStamp: a grant landing on a lease that still holds
// older tokens (a prefetch that Redis ran after a Reset) goes back stamped
// with its own time, not the older tokens' (which the fresh bucket drops).
// Spent tokens count as the older ones; once only the fresh part is left
// it becomes the older one. A reservation's excess is paid by the lease
// when its tokens are no older than the lease's older ones.
func TestFreshGrantKeepsItsStamp(t *testing.T) {
	z := newSizer(policy.PerSecond(1000), policy.Lease{TTL: time.Minute, IdleTTL: time.Hour})
	e := &entry{key: "k"}
	ls := over(z, e)
	install := func(granted, at int64) {
		t.Helper()
		z.Install(e, request{Want: granted, Min: 1}, Outcome{Granted: granted, Remaining: bigRemaining, At: at}, 1*s)
	}
	take := func(n int64) {
		t.Helper()
		if ok, _ := e.Take(n, 1*s); !ok {
			t.Fatalf("Take(%d) from a lease of %d failed", n, e.Tokens())
		}
	}
	type part struct{ tokens, since int64 }
	stamped := func(how string, r Return, want ...part) {
		t.Helper()
		var got []part
		parts, n := r.Stamped()
		for _, p := range parts[:n] {
			got = append(got, part{p.Tokens, p.Since})
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s: %+v goes back as %+v; want %+v", how, r, got, want)
		}
	}

	install(10, 500)
	take(7)
	install(8, 900) // 3 tokens of 500 left: the 8 are the fresh part
	stamped("3 older, 8 fresh", ls.Surrender("k", 1*s), part{8, 900}, part{3, 500})

	install(10, 500)
	take(7)
	install(8, 900)
	take(4) // 7 left, all of them counted fresh
	install(5, 1200)
	stamped("after the older tokens are spent", ls.Surrender("k", 1*s), part{5, 1200}, part{7, 900})

	// A surplus joins the older tokens: once the fresh part is spent, it
	// goes back as older, however large the fresh part was.
	install(10, 500)
	take(7)
	install(8, 900)
	take(10) // 1 left, of the fresh part
	if !ls.Give("k", 5, 500, 500, 0, 1*s) {
		t.Fatal("a surplus stamped 500 did not join a lease whose older tokens are of 500")
	}
	stamped("a surplus after the fresh part was spent", ls.Surrender("k", 1*s), part{1, 900}, part{5, 500})

	// A late grant (Redis ran it before a Reset at 1050) joins the older
	// tokens: the fresh part is what is left of it, not the 10 it was, so
	// the late tokens never go back stamped 1100.
	install(2, 1000)
	install(10, 1100)
	take(11) // 1 left
	install(5, 800)
	install(4, 1200) // joins what is left of the fresh part, 1 of 1100
	stamped("a late grant after the fresh part was spent", ls.Surrender("k", 1*s), part{5, 1100}, part{5, 800})

	install(10, 500)
	take(7)
	install(8, 900)
	for _, tc := range []struct {
		since int64
		want  bool
	}{{499, false}, {500, true}, {500, true}, {900, true}} { // the second of 500 comes out of the fresh part
		if got := ls.Charge("k", 2, tc.since, 1*s); got != tc.want {
			t.Errorf("Charge(2) of a reservation stamped %d from a lease of %d tokens, 8 fresh of 900 = %v; want %v", tc.since, e.Tokens()+e.Reserved(), got, tc.want)
		}
	}
	stamped("after the charges", ls.Surrender("k", 1*s), part{5, 900})
}

// TestLeaseStampsAgainstTokens drives one lease through random grants
// (their times out of order, some unknown), takes, reservations (a late
// grant may land between Reserve's reading of the stamps and its take),
// surpluses given back, charges and returns, beside a model that keeps
// every token with its grant's time and spends the oldest first. For
// every time X a Reset might have marked, a return gives the fresh bucket
// (stamps after X) no more tokens than the lease can hold of grants after
// X, and a reservation's refund bound is no later than any token the
// lease held when it took.
func TestLeaseStampsAgainstTokens(t *testing.T) {
	for seed := range uint64(3000) {
		rng := rand.New(rand.NewPCG(seed, 0x57a3))
		z := newSizer(policy.PerSecond(1000), policy.Lease{TTL: time.Minute, IdleTTL: time.Hour})
		e := &entry{key: "k"}
		ls := over(z, e)
		var model []int64 // the lease's tokens, each its grant's time, oldest first
		var parked [][]int64
		took := func(n int64) []int64 { // the oldest n, out of the model
			slices.Sort(model)
			out := slices.Clone(model[:n])
			model = model[n:]
			return out
		}
		install := func() {
			g, at := 1+rng.Int64N(10), rng.Int64N(100) // 0: unknown
			z.Install(e, request{Want: g, Min: 1}, Outcome{Granted: g, Remaining: bigRemaining, At: at}, 1*s)
			for range g {
				model = append(model, at)
			}
		}
		var log []string
		fail := func(format string, args ...any) {
			t.Helper()
			t.Fatalf("seed %d after %v: "+format, append([]any{seed, log}, args...)...)
		}
		for range 4 + rng.IntN(16) {
			n := int64(len(model))
			switch op := rng.IntN(7); {
			case op < 2:
				install()
				log = append(log, "install")
			case op == 2 && n > 0:
				k := 1 + rng.Int64N(n)
				if ok, _ := e.Take(k, 1*s); !ok {
					fail("Take(%d) of %d failed", k, n)
				}
				took(k)
				log = append(log, "take")
			case op == 3 && n > 0:
				pre, known := ls.Stamps("k", 1*s)
				if rng.IntN(3) == 0 {
					install() // lands between the reading and the take
				}
				k := 1 + rng.Int64N(int64(len(model)))
				oldest, newest := slices.Min(model), slices.Max(model)
				if ok, _ := e.Take(k, 1*s); !ok {
					fail("Take(%d) failed", k)
				}
				taken := took(k)
				for rng.IntN(2) == 0 {
					install() // more land before the second reading
				}
				post, _ := ls.Stamps("k", 1*s)
				bound := pre.Floor(post)
				if !known {
					bound = 0
				}
				if bound > oldest {
					fail("a reservation bounded by %d took from a lease holding a token of %d", bound, oldest)
				}
				ceiling := pre.Ceiling(post)
				if !known {
					ceiling = math.MaxInt64
				}
				if ceiling < newest {
					fail("a reservation's excess charged as of %d took from a lease holding a token of %d", ceiling, newest)
				}
				parked = append(parked, append(taken, bound, ceiling))
				log = append(log, "reserve")
			case op == 4 && len(parked) > 0:
				r := parked[len(parked)-1]
				parked = parked[:len(parked)-1]
				tokens, bound, ceiling := r[:len(r)-2], r[len(r)-2], r[len(r)-1]
				back := 1 + rng.Int64N(int64(len(tokens))) // the surplus: the newest of them, the rest spent
				if ls.Give("k", back, bound, ceiling, 0, 1*s) {
					model = append(model, tokens[int64(len(tokens))-back:]...)
				}
				log = append(log, "give")
			case op == 5 && n > 0:
				pre, _ := ls.Stamps("k", 1*s)
				if ls.Charge("k", 1, pre.Since, 1*s) {
					took(1)
				}
				log = append(log, "charge")
			case op == 6:
				r := ls.Surrender("k", 1*s)
				if r.Tokens != n {
					fail("Surrender returned %d tokens; the lease held %d", r.Tokens, n)
				}
				for x := range int64(100) {
					var back, held int64
					parts, n := r.Stamped()
					for _, p := range parts[:n] {
						if p.Since > x {
							back += p.Tokens
						}
					}
					for _, at := range model {
						if at > x {
							held++
						}
					}
					if back > held {
						fail("a return gives %d tokens stamped after %d; the lease held %d granted after it (%+v)", back, x, held, r)
					}
				}
				model = model[:0]
				log = append(log, "surrender")
			}
		}
	}
}

// TestFloorAcrossEviction: a reservation's readings of its lease's stamps
// before and after its take bound its tokens only if both are of one lease:
// a key evicted and made again between them has a new entry, whose count
// of lowered stamps starts afresh. Here a late grant (500, before a Reset
// at 700) joins the lease between the first reading (1000) and the take,
// then the key is evicted and refilled at 2000 before the second reading.
// Found by an adversarial review: the bound was 1000, and the surplus of
// tokens granted at 500 would have gone back to the fresh bucket.
func TestFloorAcrossEviction(t *testing.T) {
	settings := policy.Lease{TTL: time.Minute, IdleTTL: time.Hour}
	tb := NewTable(minCapacity, settings) // one entry per shard
	ls := New(tb, policy.PerSecond(1000), settings, 1)
	now := 1 * s
	grant := func(e *entry, g, at int64) {
		ls.sizer.Install(e, request{Want: g, Min: 1}, Outcome{Granted: g, Remaining: bigRemaining, At: at}, now)
	}
	other := ""
	for i := 0; other == ""; i++ {
		if k := fmt.Sprint("o", i); tb.t.shard(ls, k) == tb.t.shard(ls, "k") {
			other = k
		}
	}
	first, _ := ls.getOrCreate("k", now)
	grant(first, 2, 1000)
	pre, known := ls.Stamps("k", now)
	if !known || pre.Since != 1000 {
		t.Fatalf("Stamps = %+v, %v; want Since 1000", pre, known)
	}
	grant(first, 10, 500)
	if a := ls.Decide("k", 10, now); a.Status != Leased {
		t.Fatalf("Decide(10) = %+v; want it from the lease", a)
	}
	now += 10 * s
	if _, ev := ls.getOrCreate(other, now); ev.Tokens == 0 || !first.Removed() {
		t.Fatalf("k was not evicted (%+v)", ev)
	}
	again, _ := ls.getOrCreate("k", now)
	grant(again, 5, 2000)
	post, _ := ls.Stamps("k", now)
	if floor := pre.Floor(post); floor > 500 {
		t.Errorf("Floor = %d for a take of tokens granted at 500 (readings %d and %d of two leases)", floor, pre.Since, post.Since)
	}
}
