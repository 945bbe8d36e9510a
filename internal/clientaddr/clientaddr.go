// Package clientaddr keys a client by its IP address, for the middlewares'
// client-address key functions (httplimit.ClientIP, grpclimit.PeerKey).
package clientaddr

import "net/netip"

// V6Bits is the prefix length by which an IPv6 client is keyed: a /64 is
// the smallest block a network gives one customer, and every address in it
// is the same client's for the taking (keyed by whole address, a client
// with a /64 had 2^64 buckets).
const V6Bits = 64

// nat64 is the well-known prefix of NAT64 (RFC 6052): an IPv4 client
// reaches an IPv6 server as 64:ff9b::<its IPv4 address>, so all IPv4
// clients of a NAT64 gateway share one /64.
var nat64 = netip.MustParsePrefix("64:ff9b::/96")

// Key is the key of the client at a (unmapped, without zone): an IPv4
// address whole, the IPv4 address inside a NAT64 one, else an IPv6
// address's /64 ("2001:db8:1:2::/64").
func Key(a netip.Addr) string {
	if a.Is4() {
		return a.String()
	}
	if nat64.Contains(a) {
		b := a.As16()
		return netip.AddrFrom4([4]byte(b[12:])).String()
	}
	return netip.PrefixFrom(a, V6Bits).Masked().String()
}
