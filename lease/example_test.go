package lease_test

import (
	"fmt"
	"time"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/lease"
	"github.com/leaselimit/leaselimit/policy"
)

// The protocol decides locally and says when the authority must be asked;
// the caller does the asking (here a grant made up for the example).
func Example() {
	tab := lease.NewTable(1000, policy.Lease{})
	ls := lease.New(tab, policy.PerSecond(100).WithName("api"), policy.Lease{}, 1)
	now := int64(time.Second)

	a := ls.Decide("user:42", 1, now)
	fmt.Println(a.Status == lease.Exact) // a key not seen lately: ask for exactly 1, no lease
	a = ls.Decide("user:42", 1, now)
	fmt.Println(a.Status == lease.Miss) // it came back: it earns a lease
	ls.Join(a.Ticket)
	r := ls.Plan(a.Ticket, now)
	fmt.Println(r.Want, r.Min) // its first lease: one token more than its caller needs, at least that
	o, _ := ls.Complete(r, authority.Grant{Granted: r.Want, Remaining: 98}, now)
	d := ls.Collect(a.Ticket, o, now)
	fmt.Println(d.Status == lease.Granted, d.Remaining) // the lease's token and the bucket's 98
	a = ls.Decide("user:42", 1, now)
	fmt.Println(a.Status == lease.Leased) // decided locally
	// Output:
	// true
	// true
	// 2 1
	// true 99
	// true
}
