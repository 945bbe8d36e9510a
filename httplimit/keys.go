package httplimit

import (
	"net/http"
	"net/netip"
	"net/textproto"
	"strconv"
	"strings"
)

// KeyError is a KeyFunc error whose Detail may be shown to the client; the
// key functions of this package return it. The default key error handler
// shows Detail, and a generic text for any other error.
type KeyError struct {
	Detail string // a sentence for the client, e.g. "The X-Api-Key header is missing."
	Err    error  // the cause, if any; never shown to the client
}

func (e *KeyError) Error() string {
	if e.Err != nil {
		return "httplimit: key: " + e.Detail + " (" + e.Err.Error() + ")"
	}
	return "httplimit: key: " + e.Detail
}

func (e *KeyError) Unwrap() error { return e.Err }

// ClientIP keys requests by the client's IP address (IPv4-mapped IPv6
// addresses in their IPv4 form, without zone).
//
// By default that is the connection's peer, r.RemoteAddr; X-Forwarded-For is
// ignored, since any client can send it. When the peer is inside one of the
// trusted prefixes (your load balancers and reverse proxies), ClientIP reads
// X-Forwarded-For, all of its field lines in order, from the right — the
// entry the nearest proxy appended — past every entry that is itself
// trusted, and returns the first untrusted address: the client as seen by the
// outermost trusted proxy. Entries to its left were written by the client and
// are never read. If every hop is trusted, it returns the leftmost one. If
// the walk meets an entry that is not an IP address ("unknown", a hostname,
// garbage), it returns the trusted hop that wrote it, so such requests share
// that proxy's bucket instead of choosing their own.
//
// List only proxies that append the address of their peer to X-Forwarded-For
// (nginx's $proxy_add_x_forwarded_for, HAProxy's option forwardfor, the cloud
// load balancers). Use ClientIPForwarded if yours maintain the RFC 7239
// Forwarded field instead: a Middleware that read both would let clients
// choose their key by sending the field the proxies do not maintain.
//
// ClientIP panics if a prefix is not valid. r.RemoteAddr that is not an IP
// address (a Unix socket) is a KeyError.
func ClientIP(trusted ...netip.Prefix) KeyFunc {
	return clientIP(trusted, xffChain)
}

// ClientIPForwarded is ClientIP reading the "for" parameters of the RFC 7239
// Forwarded field instead of X-Forwarded-For, with the same walk from the
// right past trusted hops. Quoted values, ports, "[IPv6]" and obfuscated or
// "unknown" identifiers are understood (the last two stop the walk, as a
// non-address does in ClientIP). A field line that does not parse stops the
// walk at the trusted hop before it.
func ClientIPForwarded(trusted ...netip.Prefix) KeyFunc {
	return clientIP(trusted, forwardedChain)
}

// chainFunc walks the forwarding field of h from the right, calling visit
// with each entry's address (ok false when the entry is not an address) until
// visit returns false.
type chainFunc func(h http.Header, visit func(a netip.Addr, ok bool) bool)

func clientIP(trusted []netip.Prefix, chain chainFunc) KeyFunc {
	prefixes := make([]netip.Prefix, len(trusted))
	for i, p := range trusted {
		if !p.IsValid() {
			panic("httplimit: invalid trusted prefix " + strconv.Quote(p.String()))
		}
		if p.Addr().Is4In6() && p.Bits() >= 96 {
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		prefixes[i] = p.Masked()
	}
	isTrusted := func(a netip.Addr) bool {
		for _, p := range prefixes {
			if p.Contains(a) {
				return true
			}
		}
		return false
	}
	return func(r *http.Request) (string, error) {
		peer, ok := parseAddr(r.RemoteAddr)
		if !ok {
			return "", &KeyError{Detail: "The client's address is unknown."}
		}
		if len(prefixes) == 0 || !isTrusted(peer) {
			return peer.String(), nil
		}
		client := peer
		chain(r.Header, func(a netip.Addr, ok bool) bool {
			if !ok {
				return false // client stays the trusted hop that wrote it
			}
			client = a
			return isTrusted(a)
		})
		return client.String(), nil
	}
}

// parseAddr parses an address as found in RemoteAddr, X-Forwarded-For or a
// Forwarded "for" value: "1.2.3.4", "1.2.3.4:80", "2001:db8::1",
// "[2001:db8::1]" or "[2001:db8::1]:80".
func parseAddr(s string) (netip.Addr, bool) {
	a, err := netip.ParseAddr(s)
	if err != nil {
		ap, err2 := netip.ParseAddrPort(s)
		switch {
		case err2 == nil:
			a = ap.Addr()
		case len(s) > 2 && s[0] == '[' && s[len(s)-1] == ']':
			if a, err = netip.ParseAddr(s[1 : len(s)-1]); err != nil || !a.Is6() {
				return netip.Addr{}, false
			}
		default:
			return netip.Addr{}, false
		}
	}
	return a.Unmap().WithZone(""), true
}

// xffChain walks X-Forwarded-For from the right without splitting the part
// a client may have written.
func xffChain(h http.Header, visit func(netip.Addr, bool) bool) {
	lines := h["X-Forwarded-For"]
	for i := len(lines) - 1; i >= 0; i-- {
		s := lines[i]
		for s != "" {
			j := strings.LastIndexByte(s, ',')
			entry := strings.TrimSpace(s[j+1:])
			if j < 0 {
				s = ""
			} else {
				s = s[:j]
			}
			if entry == "" {
				continue // empty list member
			}
			a, ok := parseAddr(entry)
			if !visit(a, ok) {
				return
			}
		}
	}
}

// forwardedChain walks the "for" values of Forwarded from the right. Each
// field line is parsed on its own; a line that does not parse, or an element
// without "for", stops the walk.
func forwardedChain(h http.Header, visit func(netip.Addr, bool) bool) {
	lines := h["Forwarded"]
	for i := len(lines) - 1; i >= 0; i-- {
		fors, ok := parseForwarded(lines[i])
		if !ok {
			visit(netip.Addr{}, false)
			return
		}
		for j := len(fors) - 1; j >= 0; j-- {
			a, ok := netip.Addr{}, fors[j] != ""
			if ok {
				a, ok = parseAddr(fors[j])
			}
			if !visit(a, ok) {
				return
			}
		}
	}
}

// parseForwarded returns the "for" value of each element of one Forwarded
// field line ("" for an element without one), RFC 7239 Section 4:
//
//	Forwarded   = 1#forwarded-element
//	forwarded-element = [ forwarded-pair ] *( ";" [ forwarded-pair ] )
//	forwarded-pair = token "=" value
//	value          = token / quoted-string
func parseForwarded(s string) (fors []string, ok bool) {
	i := 0
	skipOWS := func() {
		for i < len(s) && (s[i] == ' ' || s[i] == '\t') {
			i++
		}
	}
	for {
		skipOWS()
		elemFor, empty := "", true
		for { // pairs of one element
			skipOWS()
			if i < len(s) && s[i] != ';' && s[i] != ',' {
				start := i
				for i < len(s) && isTchar(s[i]) {
					i++
				}
				name := s[start:i]
				if name == "" || i >= len(s) || s[i] != '=' {
					return nil, false
				}
				i++
				var val string
				if i < len(s) && s[i] == '"' {
					var b strings.Builder
					for i++; ; i++ {
						if i >= len(s) {
							return nil, false
						}
						c := s[i]
						if c == '\\' {
							if i++; i >= len(s) {
								return nil, false
							}
							b.WriteByte(s[i])
							continue
						}
						if c == '"' {
							i++
							break
						}
						b.WriteByte(c)
					}
					val = b.String()
				} else {
					start := i
					for i < len(s) && isTchar(s[i]) {
						i++
					}
					val = s[start:i]
					if val == "" {
						return nil, false
					}
				}
				if strings.EqualFold(name, "for") {
					if elemFor != "" {
						return nil, false // "for" twice in one element
					}
					elemFor = val
				}
				empty = false
				skipOWS()
			}
			if i < len(s) && s[i] == ';' {
				i++
				continue
			}
			break
		}
		if !empty {
			fors = append(fors, elemFor)
		}
		if i >= len(s) {
			return fors, true
		}
		if s[i] != ',' {
			return nil, false
		}
		i++
	}
}

func isTchar(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// Header keys requests by the value of the request header field name, such
// as an API key. A missing or empty field, or one sent more than once, is a
// KeyError (400 by default): the limit is never skipped for want of a key.
// Header does not check that the value is a valid credential; put it behind
// your authentication, or the limit is per claimed key. Header panics if
// name is empty.
func Header(name string) KeyFunc {
	if name == "" {
		panic("httplimit: Header with an empty field name")
	}
	canon := textproto.CanonicalMIMEHeaderKey(name)
	missing := &KeyError{Detail: "The " + canon + " header field is missing or empty."}
	repeated := &KeyError{Detail: "The " + canon + " header field is sent more than once."}
	return func(r *http.Request) (string, error) {
		v := r.Header[canon]
		switch {
		case len(v) > 1:
			return "", repeated
		case len(v) == 0 || strings.TrimSpace(v[0]) == "":
			return "", missing
		}
		return strings.TrimSpace(v[0]), nil
	}
}

// Composite keys requests by all of fns' keys together, for example
// Composite(Header("X-Api-Key"), ClientIP()) for a limit per API key and
// client address. Each part is written as its length in decimal, ':' and the
// part, so different tuples never give the same key. The first error of any
// fn is returned. Composite panics if fns is empty or holds nil.
func Composite(fns ...KeyFunc) KeyFunc {
	if len(fns) == 0 {
		panic("httplimit: Composite of no KeyFunc")
	}
	for _, f := range fns {
		if f == nil {
			panic("httplimit: Composite with a nil KeyFunc")
		}
	}
	fns = append([]KeyFunc(nil), fns...)
	return func(r *http.Request) (string, error) {
		var b []byte
		for _, f := range fns {
			k, err := f(r)
			if err != nil {
				return "", err
			}
			b = strconv.AppendInt(b, int64(len(k)), 10)
			b = append(b, ':')
			b = append(b, k...)
		}
		return string(b), nil
	}
}
