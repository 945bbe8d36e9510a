package httplimit

import (
	"log/slog"
	"net/http"
	"net/netip"
	"net/textproto"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/leaselimit/leaselimit/internal/clientaddr"
	"github.com/leaselimit/leaselimit/internal/keyfield"
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

// ClientIP keys requests by the client's IP address: an IPv4 address
// (IPv4-mapped IPv6 addresses in their IPv4 form) whole, an IPv6 address
// by its /64 ("2001:db8:1:2::/64"; a /64 is the smallest block a network gives one customer; the IPv4 address inside a NAT64 one), without zone.
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
// When the key is a proxy's address although the request says it was
// forwarded — a peer outside the trusted prefixes (or with none configured)
// sends X-Forwarded-For, Forwarded or X-Real-IP, or a trusted peer sends only
// a field this function does not read — every client behind that proxy
// shares one bucket. The KeyFunc then logs one warning, the first time only,
// to slog.Default() at the time (httplimit has no logger of its own here: set
// your logger with slog.SetDefault). The warning names the field, the peer's
// address and the fix; it never contains the field's value. Requests without
// such a field, or from trusted peers whose field is read, log nothing. If
// clients reach the server directly, a client that sends the field itself
// triggers it, once; the header is then rightly ignored.
//
// ClientIP panics if a prefix is not valid. r.RemoteAddr that is not an IP
// address (a Unix socket) is a KeyError.
func ClientIP(trusted ...netip.Prefix) KeyFunc {
	return clientIP(trusted, xffChain, xffReader)
}

// ClientIPForwarded is ClientIP reading the "for" parameters of the RFC 7239
// Forwarded field instead of X-Forwarded-For, with the same walk from the
// right past trusted hops. Quoted values, ports, "[IPv6]" and obfuscated or
// "unknown" identifiers are understood (the last two stop the walk, as a
// non-address does in ClientIP). Elements are read from the right, each
// on its own, so a malformed part the client wrote to the left of its
// proxy's element is never read; an element that does not parse, reached
// in the walk, stops it at the trusted hop before it. It warns once, as
// ClientIP does, when
// requests arrive through a proxy whose forwarding field it does not read.
func ClientIPForwarded(trusted ...netip.Prefix) KeyFunc {
	return clientIP(trusted, forwardedChain, forwardedReader)
}

// chainFunc walks the forwarding field of h from the right, calling visit
// with each entry's address (ok false when the entry is not an address) until
// visit returns false.
type chainFunc func(h http.Header, visit func(a netip.Addr, ok bool) bool)

// A reader describes a client-address key function for its warning: its
// name, the forwarding field it reads and how to make a proxy send it.
type reader struct {
	fn, field, fix string
}

var (
	xffReader = reader{"ClientIP", "X-Forwarded-For",
		"make the proxy append its peer to X-Forwarded-For (nginx: proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for; HAProxy: option forwardfor), " +
			"or key with httplimit.ClientIPForwarded if it maintains Forwarded"}
	forwardedReader = reader{"ClientIPForwarded", "Forwarded",
		"make the proxy maintain the RFC 7239 Forwarded field, or key with httplimit.ClientIP if it appends to X-Forwarded-For"}
)

// forwardingFields are the request header fields that say a request was
// forwarded by a proxy: canonical key, and the name as usually written.
var forwardingFields = [...]struct{ key, name string }{
	{"X-Forwarded-For", "X-Forwarded-For"},
	{"Forwarded", "Forwarded"},
	{"X-Real-Ip", "X-Real-IP"},
}

// proxyWarning logs, once, that a client-address KeyFunc keyed a forwarded
// request by the proxy's address. Until it has, each request from an
// untrusted peer costs three header lookups; after, one atomic load.
type proxyWarning struct {
	reader
	key     string // field in canonical form
	trusted string // the configured prefixes, for the log
	done    atomic.Bool
}

// forwardedBy returns the name of the first forwarding field h holds, other
// than skip's canonical key, or "".
func forwardedBy(h http.Header, skip string) string {
	for _, f := range forwardingFields {
		if f.key != skip && len(h[f.key]) > 0 {
			return f.name
		}
	}
	return ""
}

// untrustedPeer is called for a request keyed by its peer, which is not a
// trusted proxy.
func (w *proxyWarning) untrustedPeer(r *http.Request, peer netip.Addr) {
	if w.done.Load() {
		return
	}
	field := forwardedBy(r.Header, "")
	if field == "" || !w.done.CompareAndSwap(false, true) {
		return
	}
	host := netip.PrefixFrom(peer, peer.BitLen()).String()
	fix := "if " + peer.String() + " is your load balancer or reverse proxy, add its prefix to the trusted ones: httplimit." + w.fn +
		`(netip.MustParsePrefix("` + host + `"), ...); if clients connect directly, this field is their own and rightly ignored`
	slog.Default().LogAttrs(r.Context(), slog.LevelWarn,
		"httplimit: a request forwarded by a peer that is not a trusted proxy is keyed by the peer's address: all clients behind it share one bucket; logged once",
		slog.String("func", w.fn), slog.String("header", field), slog.String("remote_addr", peer.String()),
		slog.String("trusted", w.trusted), slog.String("fix", fix))
}

// trustedPeer is called for a request from a trusted proxy that sent no
// field w reads.
func (w *proxyWarning) trustedPeer(r *http.Request, peer netip.Addr) {
	if w.done.Load() {
		return
	}
	field := forwardedBy(r.Header, w.key)
	if field == "" || !w.done.CompareAndSwap(false, true) {
		return
	}
	slog.Default().LogAttrs(r.Context(), slog.LevelWarn,
		"httplimit: a trusted proxy sends the client's address in a field this key function does not read: all clients behind it share one bucket; logged once",
		slog.String("func", w.fn), slog.String("header", field), slog.String("reads", w.field),
		slog.String("remote_addr", peer.String()), slog.String("fix", w.fix))
}

func clientIP(trusted []netip.Prefix, chain chainFunc, rd reader) KeyFunc {
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
	warn := &proxyWarning{reader: rd, key: textproto.CanonicalMIMEHeaderKey(rd.field), trusted: "none"}
	if len(prefixes) > 0 {
		names := make([]string, len(prefixes))
		for i, p := range prefixes {
			names[i] = p.String()
		}
		warn.trusted = strings.Join(names, ",")
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
			warn.untrustedPeer(r, peer)
			return clientaddr.Key(peer), nil
		}
		if len(r.Header[warn.key]) == 0 {
			warn.trustedPeer(r, peer)
			return clientaddr.Key(peer), nil
		}
		client := peer
		chain(r.Header, func(a netip.Addr, ok bool) bool {
			if !ok {
				return false // client stays the trusted hop that wrote it
			}
			client = a
			return isTrusted(a)
		})
		return clientaddr.Key(client), nil
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

// forwardedChain walks the "for" values of Forwarded from the right, one
// element at a time: the proxies append theirs to the right of what the
// client wrote, so an element is read only when every one to its right
// named a trusted hop. An element that does not parse, or has no "for",
// stops the walk where it is. (Parsed whole, a line the client made
// malformed on its own side, left of its proxy's well-formed element, was
// refused entirely, and the request took the proxy's bucket: a second
// bucket for that client.)
func forwardedChain(h http.Header, visit func(netip.Addr, bool) bool) {
	lines := h["Forwarded"]
	for i := len(lines) - 1; i >= 0; i-- {
		rest := lines[i]
		for strings.TrimSpace(rest) != "" {
			fors, before, ok := lastElement(rest)
			if !ok {
				visit(netip.Addr{}, false)
				return
			}
			rest = before
			if len(fors) == 0 {
				continue // an empty list member
			}
			a, ok := netip.Addr{}, fors[0] != ""
			if ok {
				a, ok = parseAddr(fors[0])
			}
			if !visit(a, ok) {
				return
			}
		}
	}
}

// lastElement splits the last element off the Forwarded list s: its "for"
// value (none for an empty member; "" for an element without "for") and
// what is left of it. The element runs from the last comma outside a
// quoted string, found in one scan from the right (the line's right end,
// the proxy's, is outside quotes; a '"' after an odd number of '\\' is
// escaped). ok is false when that tail is not one element. (A budget of
// commas tried, the first cut, stopped at an element whose quoted value
// held more of them, and the client got its proxy's bucket.)
func lastElement(s string) (fors []string, before string, ok bool) {
	p, quoted := len(s)-1, false
	for ; p >= 0; p-- {
		switch s[p] {
		case '"':
			escapes := 0
			for p-1-escapes >= 0 && s[p-1-escapes] == '\\' {
				escapes++
			}
			if escapes%2 == 1 {
				p -= escapes // an escaped quote, inside a string
				continue
			}
			quoted = !quoted
			continue
		case ',':
			if quoted {
				continue
			}
		default:
			continue
		}
		break
	}
	fors, ok = parseForwarded(s[p+1:])
	if !ok || len(fors) > 1 {
		return nil, "", false
	}
	if p < 0 {
		return fors, "", true
	}
	return fors, s[:p], true
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
		switch k, why := keyfield.One(r.Header[canon]); why {
		case keyfield.Repeated:
			return "", repeated
		case keyfield.Missing:
			return "", missing
		default:
			return k, nil
		}
	}
}

// Composite keys requests by all of fns' keys together, for example
// Composite(Header("X-Api-Key"), ClientIP()) for a limit per API key and
// client address. Each part is written as its length in decimal, ':' and the
// part, so different tuples never give the same key. The first error of any
// fn is returned, and an empty part is an error (a KeyError): every request
// whose fn returned "" would share one bucket. Composite panics if fns is
// empty or holds nil.
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
	emptyPart := &KeyError{Detail: "The request does not identify its client as this service's rate limit requires."}
	return func(r *http.Request) (string, error) {
		var b []byte
		for _, f := range fns {
			k, err := f(r)
			if err != nil {
				return "", err
			}
			if k == "" {
				return "", emptyPart
			}
			b = strconv.AppendInt(b, int64(len(k)), 10)
			b = append(b, ':')
			b = append(b, k...)
		}
		return string(b), nil
	}
}
