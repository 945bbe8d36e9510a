package httplimit_test

import (
	"context"
	"errors"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/policy"
)

// Addresses: 203.0.113.0/24 and 2001:db8:c::/48 are "the internet",
// 10.0.0.0/8 and fd00::/8 the trusted proxies.
var proxies = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}

func keyOf(t *testing.T, f httplimit.KeyFunc, remote string, hdr http.Header) string {
	t.Helper()
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = remote
	for k, v := range hdr {
		r.Header[k] = v
	}
	k, err := f(r)
	if err != nil {
		t.Fatalf("remote %s, header %v: %v", remote, hdr, err)
	}
	return k
}

func xff(v ...string) http.Header { return http.Header{"X-Forwarded-For": v} }
func fwd(v ...string) http.Header { return http.Header{"Forwarded": v} }

func TestClientIP(t *testing.T) {
	trusting := httplimit.ClientIP(proxies...)
	for _, tc := range []struct {
		name   string
		f      httplimit.KeyFunc
		remote string
		hdr    http.Header
		want   string
	}{
		{"peer", httplimit.ClientIP(), "203.0.113.7:5555", nil, "203.0.113.7"},
		{"peer without port", httplimit.ClientIP(), "203.0.113.7", nil, "203.0.113.7"},
		{"peer v6", httplimit.ClientIP(), "[2001:db8:c::1]:443", nil, "2001:db8:c::/64"},
		{"peer v6 zone", httplimit.ClientIP(), "[fe80::1%eth0]:443", nil, "fe80::1"}, // link-local: whole
		// An IPv6 client is keyed by its /64: every address in it is the
		// client's for the taking.
		{"peer v6, another address of its /64", httplimit.ClientIP(), "[2001:db8:c::ffff:1]:443", nil, "2001:db8:c::/64"},
		{"peer v6, another /64", httplimit.ClientIP(), "[2001:db8:c:1::1]:443", nil, "2001:db8:c:1::/64"},
		{"peer through NAT64", httplimit.ClientIP(), "[64:ff9b::203.0.113.7]:443", nil, "203.0.113.7"},
		{"peer 4in6", httplimit.ClientIP(), "[::ffff:203.0.113.7]:1", nil, "203.0.113.7"},

		// Not trusted by default: a spoofed X-Forwarded-For is ignored.
		{"spoof, nothing trusted", httplimit.ClientIP(), "203.0.113.7:1", xff("198.51.100.1"), "203.0.113.7"},
		{"spoof from a proxy address, nothing trusted", httplimit.ClientIP(), "10.0.0.1:1", xff("198.51.100.1"), "10.0.0.1"},
		// From an untrusted peer, even with proxies configured.
		{"spoof, untrusted peer", trusting, "203.0.113.7:1", xff("198.51.100.1"), "203.0.113.7"},
		{"spoof naming a proxy, untrusted peer", trusting, "203.0.113.7:1", xff("198.51.100.1, 10.0.0.1"), "203.0.113.7"},

		// From a trusted peer: honoured.
		{"one proxy", trusting, "10.0.0.1:1", xff("203.0.113.7"), "203.0.113.7"},
		{"one proxy, port in entry", trusting, "10.0.0.1:1", xff("203.0.113.7:4711"), "203.0.113.7"},
		{"one proxy, v6 entry", trusting, "10.0.0.1:1", xff("2001:db8:c::9"), "2001:db8:c::/64"},
		{"one proxy, bracketed v6 entry", trusting, "10.0.0.1:1", xff("[2001:db8:c::9]:80"), "2001:db8:c::/64"},
		{"v6 proxy", trusting, "[fd00::5]:1", xff("203.0.113.7"), "203.0.113.7"},
		{"4in6 proxy", trusting, "[::ffff:10.1.2.3]:1", xff("203.0.113.7"), "203.0.113.7"},
		{"trusted peer, no header", trusting, "10.0.0.1:1", nil, "10.0.0.1"},
		// Client-written entries to the left of the first untrusted one are never read.
		{"client prepends", trusting, "10.0.0.1:1", xff("1.1.1.1, 10.9.9.9, 203.0.113.7"), "203.0.113.7"},
		// Multiple hops: walk past every trusted one.
		{"two proxies", trusting, "10.0.0.1:1", xff("203.0.113.7, 10.0.0.2"), "203.0.113.7"},
		{"three proxies, spoof", trusting, "10.0.0.1:1", xff("6.6.6.6, 203.0.113.7, fd00::3, 10.0.0.2"), "203.0.113.7"},
		{"hops in several field lines", trusting, "10.0.0.1:1", xff("6.6.6.6, 203.0.113.7", "10.0.0.3", "10.0.0.2"), "203.0.113.7"},
		{"empty members", trusting, "10.0.0.1:1", xff("203.0.113.7,, ,10.0.0.2,"), "203.0.113.7"},
		{"all trusted: leftmost", trusting, "10.0.0.1:1", xff("10.0.0.4, 10.0.0.3, 10.0.0.2"), "10.0.0.4"},
		// A trusted hop that wrote garbage: its own address, not anything further left.
		{"unknown entry", trusting, "10.0.0.1:1", xff("203.0.113.7, unknown"), "10.0.0.1"},
		{"garbage behind a second hop", trusting, "10.0.0.1:1", xff("203.0.113.7, evil.example, 10.0.0.2"), "10.0.0.2"},
		{"bracketed v4 is garbage", trusting, "10.0.0.1:1", xff("[203.0.113.7]"), "10.0.0.1"},

		// ClientIP ignores Forwarded, and ClientIPForwarded ignores X-Forwarded-For.
		{"ClientIP ignores Forwarded", trusting, "10.0.0.1:1", fwd("for=203.0.113.7"), "10.0.0.1"},
		{"Forwarded ignores XFF", httplimit.ClientIPForwarded(proxies...), "10.0.0.1:1", xff("203.0.113.7"), "10.0.0.1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := keyOf(t, tc.f, tc.remote, tc.hdr); got != tc.want {
				t.Errorf("key %q, want %q", got, tc.want)
			}
		})
	}
}

func TestClientIPForwarded(t *testing.T) {
	trusting := httplimit.ClientIPForwarded(proxies...)
	for _, tc := range []struct {
		name   string
		f      httplimit.KeyFunc
		remote string
		hdr    http.Header
		want   string
	}{
		{"untrusted by default", httplimit.ClientIPForwarded(), "10.0.0.1:1", fwd("for=203.0.113.7"), "10.0.0.1"},
		{"spoof, untrusted peer", trusting, "203.0.113.7:1", fwd("for=198.51.100.1"), "203.0.113.7"},
		{"one proxy", trusting, "10.0.0.1:1", fwd("for=203.0.113.7;proto=https;by=10.0.0.1"), "203.0.113.7"},
		{"case-insensitive name", trusting, "10.0.0.1:1", fwd("For=203.0.113.7"), "203.0.113.7"},
		{"quoted v4 with port", trusting, "10.0.0.1:1", fwd(`for="203.0.113.7:4711"`), "203.0.113.7"},
		{"quoted v6", trusting, "10.0.0.1:1", fwd(`for="[2001:db8:c::17]"`), "2001:db8:c::/64"},
		{"quoted v6 with port", trusting, "10.0.0.1:1", fwd(`for="[2001:db8:c::17]:4711"`), "2001:db8:c::/64"},
		{"quoted-pair", trusting, "10.0.0.1:1", fwd(`for="203.0.113.\7"`), "203.0.113.7"},
		{"two hops", trusting, "10.0.0.1:1", fwd("for=6.6.6.6, for=203.0.113.7, for=10.0.0.2;by=10.0.0.1"), "203.0.113.7"},
		{"hops in field lines", trusting, "10.0.0.1:1", fwd("for=6.6.6.6", `for=203.0.113.7;host="a,b"`, "for=10.0.0.2"), "203.0.113.7"},
		{"all trusted", trusting, "10.0.0.1:1", fwd("for=10.0.0.3, for=10.0.0.2"), "10.0.0.3"},
		{"unknown", trusting, "10.0.0.1:1", fwd("for=unknown"), "10.0.0.1"},
		{"obfuscated behind a hop", trusting, "10.0.0.1:1", fwd("for=_hidden, for=10.0.0.2"), "10.0.0.2"},
		{"element without for", trusting, "10.0.0.1:1", fwd("for=203.0.113.7, proto=http"), "10.0.0.1"},
		{"syntax error in the client's line", trusting, "10.0.0.1:1", fwd(`for="6.6.6.6`, "for=203.0.113.7"), "203.0.113.7"},
		// The client's malformed part, left of its proxy's element in one
		// line, is never read: parsed whole, the line was refused and the
		// request took the proxy's bucket, a second one for that client.
		{"syntax error left in the proxy's line", trusting, "10.0.0.1:1", fwd(`for="6.6.6.6, for=203.0.113.7`), "203.0.113.7"},
		{"for twice left in the proxy's line", trusting, "10.0.0.1:1", fwd("for=1.1.1.1;for=2.2.2.2, for=203.0.113.7"), "203.0.113.7"},
		{"syntax error reached behind a hop", trusting, "10.0.0.1:1", fwd(`for="6.6.6.6, for=10.0.0.2`), "10.0.0.2"},
		{"many commas reached behind a hop", trusting, "10.0.0.1:1", fwd(`for="` + strings.Repeat(",", 1000) + `, for=10.0.0.2`), "10.0.0.2"},
		{"quoted comma", trusting, "10.0.0.1:1", fwd(`for=203.0.113.7;host="a,b", for=10.0.0.2`), "203.0.113.7"},
		{"many quoted commas", trusting, "10.0.0.1:1", fwd(`for=203.0.113.7;host="a` + strings.Repeat(",", 100) + `b"`), "203.0.113.7"},
		{"escaped quotes", trusting, "10.0.0.1:1", fwd(`for=6.6.6.6, for=203.0.113.7;host="a\",\\", for=10.0.0.2`), "203.0.113.7"},
		{"for twice in one element", trusting, "10.0.0.1:1", fwd("for=6.6.6.6;for=203.0.113.7"), "10.0.0.1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := keyOf(t, tc.f, tc.remote, tc.hdr); got != tc.want {
				t.Errorf("key %q, want %q", got, tc.want)
			}
		})
	}
}

// TestClientIPThroughMiddleware: a spoofing client behind no trusted proxy
// cannot get a fresh bucket per request.
func TestClientIPThroughMiddleware(t *testing.T) {
	f := allowAll(policy.PerSecond(10))
	h := httplimit.Middleware(f, httplimit.ClientIP(proxies...))(&okHandler{})
	for _, spoof := range []string{"1.1.1.1", "2.2.2.2", "10.0.0.1, 3.3.3.3"} {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = "203.0.113.7:1234"
		r.Header.Set("X-Forwarded-For", spoof)
		serve(h, r)
	}
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = "10.0.0.1:1234"
	r.Header.Set("X-Forwarded-For", "1.1.1.1, 198.51.100.4")
	serve(h, r)
	want := []string{"203.0.113.7", "203.0.113.7", "203.0.113.7", "198.51.100.4"}
	for i := range want {
		if f.keys[i] != want[i] {
			t.Errorf("keys %q, want %q", f.keys, want)
			break
		}
	}
}

// warnings records the log records of httplimit's key functions.
type warnings struct {
	mu      sync.Mutex
	records []map[string]string // attributes, with the message as "msg" and the level as "level"
}

func (w *warnings) Enabled(context.Context, slog.Level) bool { return true }
func (w *warnings) WithAttrs([]slog.Attr) slog.Handler       { return w }
func (w *warnings) WithGroup(string) slog.Handler            { return w }
func (w *warnings) Handle(_ context.Context, r slog.Record) error {
	if !strings.HasPrefix(r.Message, "httplimit: ") {
		return nil
	}
	m := map[string]string{"msg": r.Message, "level": r.Level.String()}
	r.Attrs(func(a slog.Attr) bool {
		m[a.Key] = a.Value.String()
		return true
	})
	w.mu.Lock()
	w.records = append(w.records, m)
	w.mu.Unlock()
	return nil
}

func (w *warnings) get() []map[string]string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]map[string]string(nil), w.records...)
}

// captureDefault makes slog.Default() record into a warnings until the test
// ends.
func captureDefault(t *testing.T) *warnings {
	t.Helper()
	w := &warnings{}
	old, lw, lf := slog.Default(), log.Writer(), log.Flags() // SetDefault redirects the log package, which setting old back does not undo
	slog.SetDefault(slog.New(w))
	t.Cleanup(func() { slog.SetDefault(old); log.SetOutput(lw); log.SetFlags(lf) })
	return w
}

// TestClientIPProxyWarning: a request keyed by a proxy's address although it
// says it was forwarded logs one warning per KeyFunc, naming the field, the
// peer and the fix; other requests log nothing.
func TestClientIPProxyWarning(t *testing.T) {
	type req struct {
		remote string
		hdr    http.Header
	}
	plain := []req{{"203.0.113.7:1", nil}, {"10.0.0.1:1", http.Header{"X-Other": {"1"}}}}
	realIP := func(v string) http.Header { return http.Header{"X-Real-Ip": {v}} }
	for _, tc := range []struct {
		name string
		f    httplimit.KeyFunc
		reqs []req
		want map[string]string // nil: no warning; else attributes that must match exactly
		fix  []string          // substrings of the fix
	}{
		{"no forwarding field", httplimit.ClientIP(), plain, nil, nil},
		{"trusted proxy, no field", httplimit.ClientIP(proxies...), []req{{"10.0.0.1:1", nil}}, nil, nil},
		{"trusted proxy, field read", httplimit.ClientIP(proxies...),
			[]req{{"10.0.0.1:1", xff("203.0.113.7")}, {"[fd00::1]:1", http.Header{"X-Forwarded-For": {"203.0.113.7"}, "X-Real-Ip": {"203.0.113.7"}}}}, nil, nil},
		{"trusted proxy, Forwarded read", httplimit.ClientIPForwarded(proxies...),
			[]req{{"10.0.0.1:1", fwd("for=203.0.113.7")}, {"10.0.0.1:1", http.Header{"Forwarded": {"for=203.0.113.7"}, "X-Forwarded-For": {"203.0.113.7"}}}}, nil, nil},

		{"X-Forwarded-For, nothing trusted", httplimit.ClientIP(),
			append(plain, req{"10.1.2.3:4", xff("198.51.100.1")}, req{"10.1.2.4:4", xff("198.51.100.2")}, req{"10.1.2.3:4", fwd("for=198.51.100.2")}),
			map[string]string{"level": "WARN", "func": "ClientIP", "header": "X-Forwarded-For", "remote_addr": "10.1.2.3", "trusted": "none"},
			[]string{`httplimit.ClientIP(netip.MustParsePrefix("10.1.2.3/32"), ...)`, "if 10.1.2.3 is your load balancer"}},
		{"Forwarded, nothing trusted", httplimit.ClientIP(), []req{{"10.1.2.3:4", fwd("for=198.51.100.1")}},
			map[string]string{"func": "ClientIP", "header": "Forwarded", "remote_addr": "10.1.2.3", "trusted": "none"}, nil},
		{"X-Real-IP, nothing trusted", httplimit.ClientIP(), []req{{"10.1.2.3:4", realIP("198.51.100.1")}},
			map[string]string{"func": "ClientIP", "header": "X-Real-IP", "remote_addr": "10.1.2.3", "trusted": "none"}, nil},
		{"v6 peer", httplimit.ClientIP(), []req{{"[2001:db8::5%eth0]:4", xff("198.51.100.1")}},
			map[string]string{"header": "X-Forwarded-For", "remote_addr": "2001:db8::5"}, []string{`"2001:db8::5/128"`}},
		{"ClientIPForwarded, nothing trusted", httplimit.ClientIPForwarded(), []req{{"10.1.2.3:4", xff("198.51.100.1")}},
			map[string]string{"func": "ClientIPForwarded", "header": "X-Forwarded-For", "remote_addr": "10.1.2.3", "trusted": "none"},
			[]string{"httplimit.ClientIPForwarded(netip.MustParsePrefix"}},
		{"peer outside the trusted prefixes", httplimit.ClientIP(proxies...), []req{{"10.0.0.1:1", xff("203.0.113.7")}, {"192.0.2.1:1", xff("198.51.100.1")}},
			map[string]string{"func": "ClientIP", "header": "X-Forwarded-For", "remote_addr": "192.0.2.1", "trusted": "10.0.0.0/8,fd00::/8"}, nil},

		{"trusted proxy sends X-Real-IP only", httplimit.ClientIP(proxies...), []req{{"10.0.0.1:1", realIP("198.51.100.1")}},
			map[string]string{"func": "ClientIP", "header": "X-Real-IP", "reads": "X-Forwarded-For", "remote_addr": "10.0.0.1"},
			[]string{"proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for"}},
		{"trusted proxy sends Forwarded to ClientIP", httplimit.ClientIP(proxies...), []req{{"10.0.0.1:1", fwd("for=198.51.100.1")}},
			map[string]string{"func": "ClientIP", "header": "Forwarded", "reads": "X-Forwarded-For", "remote_addr": "10.0.0.1"},
			[]string{"key with httplimit.ClientIPForwarded"}},
		{"trusted proxy sends X-Forwarded-For to ClientIPForwarded", httplimit.ClientIPForwarded(proxies...), []req{{"[fd00::2]:1", xff("198.51.100.1")}},
			map[string]string{"func": "ClientIPForwarded", "header": "X-Forwarded-For", "reads": "Forwarded", "remote_addr": "fd00::2"},
			[]string{"key with httplimit.ClientIP if"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := captureDefault(t)
			for _, r := range tc.reqs {
				keyOf(t, tc.f, r.remote, r.hdr)
				keyOf(t, tc.f, r.remote, r.hdr) // and again: still one warning
			}
			got := w.get()
			if tc.want == nil {
				if len(got) != 0 {
					t.Fatalf("warnings %v, want none", got)
				}
				return
			}
			if len(got) != 1 {
				t.Fatalf("%d warnings %v, want 1", len(got), got)
			}
			for k, v := range tc.want {
				if got[0][k] != v {
					t.Errorf("%s = %q, want %q (%v)", k, got[0][k], v, got[0])
				}
			}
			for _, s := range tc.fix {
				if !strings.Contains(got[0]["fix"], s) {
					t.Errorf("fix %q does not contain %q", got[0]["fix"], s)
				}
			}
			for k, v := range got[0] {
				if strings.Contains(v, "198.51.100.") {
					t.Errorf("%s = %q holds the field's value", k, v)
				}
			}
		})
	}
}

// TestClientIPProxyWarningConcurrent: one warning, however many requests
// race to log it.
func TestClientIPProxyWarningConcurrent(t *testing.T) {
	w := captureDefault(t)
	f := httplimit.ClientIP()
	var wg sync.WaitGroup
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := httptest.NewRequest("GET", "/", nil)
			r.RemoteAddr = "10.1.2.3:4"
			r.Header.Set("X-Forwarded-For", "198.51.100.1")
			if k, err := f(r); err != nil || k != "10.1.2.3" {
				t.Errorf("key %q, %v", k, err)
			}
		}()
	}
	wg.Wait()
	if got := w.get(); len(got) != 1 {
		t.Errorf("%d warnings, want 1: %v", len(got), got)
	}
	// Another KeyFunc warns on its own.
	keyOf(t, httplimit.ClientIP(), "10.1.2.3:4", xff("198.51.100.1"))
	if got := w.get(); len(got) != 2 {
		t.Errorf("%d warnings after a second KeyFunc, want 2", len(got))
	}
}

func TestInvalidTrustedPrefix(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("no panic for an invalid prefix")
		}
	}()
	httplimit.ClientIP(netip.Prefix{})
}

func TestHeaderKey(t *testing.T) {
	f := httplimit.Header("x-api-key")
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-Api-Key", " abc ")
	if k, err := f(r); err != nil || k != "abc" {
		t.Errorf("key %q, %v", k, err)
	}
	r.Header.Del("X-Api-Key")
	_, err := f(r)
	var ke *httplimit.KeyError
	if !errors.As(err, &ke) || ke.Detail == "" {
		t.Errorf("missing header: %v, want a *KeyError", err)
	}
}

func TestComposite(t *testing.T) {
	hk := httplimit.Composite(httplimit.Header("A"), httplimit.Header("B"))
	key := func(a, b string) string {
		r := httptest.NewRequest("GET", "/", nil)
		r.Header.Set("A", a)
		r.Header.Set("B", b)
		k, err := hk(r)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	// Parts that concatenate alike give different keys.
	pairs := [][2]string{{"a:b", "c"}, {"a", "b:c"}, {"ab", "c"}, {"a", "bc"}, {"1:a", "b"}, {"1", "a1:b"}}
	seen := map[string][2]string{}
	for _, p := range pairs {
		k := key(p[0], p[1])
		if q, dup := seen[k]; dup {
			t.Errorf("%q and %q both give key %q", p, q, k)
		}
		seen[k] = p
	}
	if k := key("ab", "c"); k != "2:ab1:c" {
		t.Errorf("key %q", k)
	}
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("A", "x")
	if _, err := hk(r); err == nil {
		t.Error("missing part gave no error")
	}
	// A part a custom KeyFunc returns empty, with no error, is refused:
	// every such request shared one bucket, keyed "0:0:" (a review).
	blank := func(*http.Request) (string, error) { return "", nil }
	var ke *httplimit.KeyError
	if k, err := httplimit.Composite(blank, httplimit.Header("A"))(r); !errors.As(err, &ke) {
		t.Errorf("Composite with an empty part = %q, %v; want a KeyError", k, err)
	}
	ip := httplimit.Composite(httplimit.ClientIP(), httplimit.Header("A"))
	r.RemoteAddr = "203.0.113.7:1"
	if k, err := ip(r); err != nil || k != "11:203.0.113.71:x" {
		t.Errorf("key %q, %v", k, err)
	}
}
