// Package clientaddr keys a client by its IP address, for the middlewares'
// client-address key functions (httplimit.ClientIP, grpclimit.PeerKey).
package clientaddr

import "net/netip"

// V6Bits is the prefix length by which an IPv6 client is keyed: a /64 is
// the smallest block a network gives one customer, and every address in it
// is the same client's for the taking (keyed by whole address, a client
// with a /64 had 2^64 buckets).
const V6Bits = 64

// Prefixes whose addresses carry an IPv4 client's address, or are no
// network's /64 (see Key).
var (
	nat64  = netip.MustParsePrefix("64:ff9b::/96")    // RFC 6052: 64:ff9b::<IPv4>
	siit   = netip.MustParsePrefix("::ffff:0:0:0/96") // RFC 2765: ::ffff:0:<IPv4>
	sixTo4 = netip.MustParsePrefix("2002::/16")       // RFC 3056: 2002:<IPv4>::/48
	teredo = netip.MustParsePrefix("2001::/32")       // RFC 4380: the client's IPv4 in the last 32 bits, inverted
	compat = netip.MustParsePrefix("::/96")           // IPv4-compatible, ::1, ::
	link   = netip.MustParsePrefix("fe80::/10")       // link-local: every link's /64 is fe80::/64
)

// Key is the key of the client at a (unmapped, without zone): an IPv4
// address whole; the IPv4 address of a client that an IPv6 address carries
// (NAT64, SIIT, 6to4, Teredo: keyed by /64, a NAT64 gateway's or a Teredo
// server's clients all shared one bucket, and one IPv4 host had 65,536 of
// 6to4's); an address that is no network's /64 (IPv4-compatible, loopback,
// link-local) whole; else an IPv6 address's /64 ("2001:db8:1:2::/64").
func Key(a netip.Addr) string {
	if a.Is4() {
		return a.String()
	}
	b := a.As16()
	switch {
	case nat64.Contains(a), siit.Contains(a):
		return netip.AddrFrom4([4]byte(b[12:])).String()
	case sixTo4.Contains(a):
		return netip.AddrFrom4([4]byte(b[2:6])).String()
	case teredo.Contains(a):
		return netip.AddrFrom4([4]byte{b[12] ^ 0xff, b[13] ^ 0xff, b[14] ^ 0xff, b[15] ^ 0xff}).String()
	case compat.Contains(a), link.Contains(a):
		return a.String()
	}
	return netip.PrefixFrom(a, V6Bits).Masked().String()
}
