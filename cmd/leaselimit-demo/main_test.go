package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/xml"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/internal/redistest"
)

func TestMain(m *testing.M) {
	redistest.VerifyTestMain(m)
}

// shortArgs run the whole demo in a few seconds. The limit is small so that
// the burst does not hide the per-instance over-admission in a short run:
// each of the 3 instances sees 200 hot-key requests/s, twice the rate needed
// to exhaust its own bucket. -timeout is generous because the race detector
// makes the embedded Redis many times slower, and a decision that misses the
// budget falls back to FailOpen, which admits (the bound holds while Redis is
// healthy).
var shortArgs = []string{"-duration", "500ms", "-outage", "1s", "-instances", "3", "-limit", "20", "-load", "1500", "-timeout", "2s"}

// row is one key's row of a design's accuracy table.
type row struct {
	requests, admitted, ideal int64
}

// parseDesigns returns the hot-key and abusive rows of each design in the
// act 1 report, by design label prefix ("(a)", "(b)", "(c)").
func parseDesigns(t *testing.T, out string) map[string]map[string]row {
	t.Helper()
	res := map[string]map[string]row{}
	cur := ""
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "Summary") {
			break
		}
		for _, id := range []string{"(a)", "(b)", "(c)"} {
			if strings.HasPrefix(line, id) {
				cur = id
				res[cur] = map[string]row{}
			}
		}
		if cur == "" {
			continue
		}
		f := strings.Fields(line)
		// "hot key  8,007  7,171  900  7.97×  ..." / "abusive  10,387  ..."
		var key string
		var nums []string
		switch {
		case len(f) >= 5 && f[0] == "hot" && f[1] == "key":
			key, nums = "hot", f[2:5]
		case len(f) >= 4 && f[0] == "abusive":
			key, nums = "abusive", f[1:4]
		default:
			continue
		}
		var r row
		for i, p := range []*int64{&r.requests, &r.admitted, &r.ideal} {
			v, err := strconv.ParseInt(strings.ReplaceAll(nums[i], ",", ""), 10, 64)
			if err != nil {
				t.Fatalf("cannot parse %q in %q: %v", nums[i], line, err)
			}
			*p = v
		}
		res[cur][key] = r
	}
	return res
}

func runDemo(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code = run(ctx, args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// noOTLPEnv unsets the variables that would make the demo export traces.
func noOTLPEnv(t *testing.T) {
	t.Helper()
	t.Setenv(envEndpoint, "")
	t.Setenv(envTracesEndpoint, "")
}

func TestRunShort(t *testing.T) {
	noOTLPEnv(t)
	chart := filepath.Join(t.TempDir(), "demo.svg")
	code, out, errOut := runDemo(t, append(shortArgs, "-chart", chart)...)
	t.Logf("stdout:\n%s", out)
	if code != exitOK {
		t.Fatalf("exit code %d, want 0; stderr:\n%s", code, errOut)
	}

	for _, want := range []string{"(a) per-instance", "(b) per-request Redis", "(c) leaselimit (leases)",
		"WithoutLease()", "Summary", "FailOpen", "FailClosed", "FailLocal", "authority decisions resumed"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if !strings.Contains(errOut, "act 1 ") || !strings.Contains(errOut, "act 2 ") {
		t.Errorf("no progress lines on stderr:\n%s", errOut)
	}

	designs := parseDesigns(t, out)
	for _, id := range []string{"(a)", "(b)", "(c)"} {
		for _, key := range []string{"hot", "abusive"} {
			if _, ok := designs[id][key]; !ok {
				t.Fatalf("no %s row for design %s in the output", key, id)
			}
		}
	}
	// Leases are debited from the Redis bucket when granted, so leaselimit
	// never admits more than one central bucket: Burst + Rate·T. Exact mode
	// is one central bucket.
	for _, id := range []string{"(b)", "(c)"} {
		for _, key := range []string{"hot", "abusive"} {
			r := designs[id][key]
			if r.admitted > r.ideal {
				t.Errorf("design %s, %s key: admitted %d > Burst + Rate·T = %d", id, key, r.admitted, r.ideal)
			}
			if r.admitted == 0 {
				t.Errorf("design %s, %s key: admitted nothing", id, key)
			}
		}
	}
	// Per-instance buckets each give out the whole limit: with 3 instances
	// and enough demand, close to 3× the bound. Ask for clearly more.
	if r := designs["(a)"]["hot"]; float64(r.admitted) < 1.5*float64(r.ideal) {
		t.Errorf("per-instance design admitted %d for the hot key, want clearly more than the bound %d", r.admitted, r.ideal)
	}

	// An outage is not an error.
	if strings.Contains(out, "ERROR") {
		t.Errorf("the output reports errors")
	}

	checkSVG(t, chart)
	checkSampleSpans(t, out)
}

// checkSampleSpans checks the sample decision spans printed without an
// OTLP endpoint: decision spans with their sources, and no raw key.
func checkSampleSpans(t *testing.T, out string) {
	t.Helper()
	start := strings.Index(out, "Sample decision spans")
	if start < 0 {
		t.Fatalf("no sample decision spans in the output")
	}
	end := strings.Index(out[start:], "In short:")
	if end < 0 {
		t.Fatalf("the sample spans are not followed by the verdict")
	}
	section := out[start : start+end]
	t.Logf("sample spans:\n%s", section)
	if n := strings.Count(section, "ratelimit.decision"); n < 3 {
		t.Errorf("%d decision spans in the sample, want at least 3", n)
	}
	srcs := map[string]bool{}
	for _, m := range regexp.MustCompile(`ratelimit\.source=(\w+)`).FindAllStringSubmatch(section, -1) {
		srcs[m[1]] = true
	}
	if !srcs["lease"] && !srcs["authority"] && !srcs["cache"] {
		t.Errorf("no ratelimit.source of lease, authority or cache in the sample (got %v)", srcs)
	}
	if !srcs["fallback"] {
		t.Errorf("no fallback decision from the outage act in the sample (got %v)", srcs)
	}
	if !strings.Contains(section, "ratelimit.authority") || !strings.Contains(section, "db.system.name=redis") {
		t.Errorf("no authority child span in the sample")
	}
	if !regexp.MustCompile(`ratelimit\.key=[0-9a-f]{16}\b`).MatchString(section) {
		t.Errorf("no keyed digest in ratelimit.key")
	}
	for _, raw := range []string{hotKey, abusiveKey, "tenant:"} {
		if strings.Contains(section, raw) {
			t.Errorf("the sample spans contain the raw key %q", raw)
		}
	}
}

// collector is an OTLP/HTTP trace receiver: it counts the export requests.
type collector struct {
	*httptest.Server
	requests atomic.Int64 // POST /v1/traces
	protobuf atomic.Int64 // of which with Content-Type application/x-protobuf
	other    atomic.Int64 // anything else
}

func newCollector(t *testing.T) *collector {
	c := &collector{}
	c.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" {
			c.other.Add(1)
			http.NotFound(w, r)
			return
		}
		c.requests.Add(1)
		if r.Header.Get("Content-Type") == "application/x-protobuf" {
			c.protobuf.Add(1)
		}
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK) // an empty ExportTraceServiceResponse
	}))
	t.Cleanup(c.Close)
	return c
}

// otlpArgs are shortArgs without the outage act, tracing every decision.
var otlpArgs = append(append([]string(nil), shortArgs...), "-outage", "0", "-trace-ratio", "1")

func TestOTLPExport(t *testing.T) {
	for _, viaEnv := range []bool{false, true} {
		name := "flag"
		if viaEnv {
			name = "env"
		}
		t.Run(name, func(t *testing.T) {
			noOTLPEnv(t)
			c := newCollector(t)
			args := otlpArgs
			if viaEnv {
				t.Setenv(envEndpoint, c.URL)
			} else {
				args = append(append([]string(nil), otlpArgs...), "-otlp", c.URL)
			}
			code, out, errOut := runDemo(t, args...)
			if code != exitOK {
				t.Fatalf("exit code %d, want 0; stderr:\n%s", code, errOut)
			}
			if n := c.requests.Load(); n < 1 {
				t.Errorf("the collector received no export request")
			}
			if p, n := c.protobuf.Load(), c.requests.Load(); p != n {
				t.Errorf("%d of %d export requests had Content-Type application/x-protobuf", p, n)
			}
			if n := c.other.Load(); n > 0 {
				t.Errorf("%d requests to another path or method", n)
			}
			want := "exported over OTLP/HTTP to " + c.URL + "/v1/traces"
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
			if !regexp.MustCompile(`service\.instance\.id "[0-9a-f-]{36}"`).MatchString(out) {
				t.Errorf("output does not name the service.instance.id to look the run up by:\n%s", out)
			}
			if strings.Contains(out, "Sample decision spans") {
				t.Errorf("sample spans printed while exporting")
			}
			if strings.Contains(errOut, "trace export") {
				t.Errorf("export errors reported:\n%s", errOut)
			}
		})
	}
}

// TestOTLPUnreachable: a collector that is not there does not fail the
// demo; the export errors are reported once, at the end.
func TestOTLPUnreachable(t *testing.T) {
	noOTLPEnv(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now
	code, out, errOut := runDemo(t, append(append([]string(nil), otlpArgs...), "-otlp", addr)...)
	if code != exitOK {
		t.Fatalf("exit code %d, want 0; stderr:\n%s", code, errOut)
	}
	if n := strings.Count(errOut, "trace export to http://"+addr+"/v1/traces failed"); n != 1 {
		t.Errorf("export failure reported %d times on stderr, want once:\n%s", n, errOut)
	}
	if !strings.Contains(out, "Traces: export over OTLP/HTTP to http://"+addr+"/v1/traces failed") {
		t.Errorf("output does not say the export failed:\n%s", out)
	}
}

// checkSVG decodes the whole chart as XML and checks it is an SVG with data.
func checkSVG(t *testing.T, path string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("chart: %v", err)
	}
	dec := xml.NewDecoder(bytes.NewReader(data))
	root := ""
	polylines, texts := 0, 0
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("chart %s is not well-formed XML: %v", path, err)
		}
		if se, ok := tok.(xml.StartElement); ok {
			if root == "" {
				root = se.Name.Local
				if se.Name.Space != "http://www.w3.org/2000/svg" {
					t.Errorf("root namespace %q, want the SVG namespace", se.Name.Space)
				}
			}
			switch se.Name.Local {
			case "polyline":
				polylines++
			case "text":
				texts++
			}
		}
	}
	if root != "svg" {
		t.Errorf("root element %q, want svg", root)
	}
	// Three designs and three failure policies.
	if polylines != 6 {
		t.Errorf("%d series in the chart, want 6", polylines)
	}
	if texts < 10 {
		t.Errorf("only %d text elements: axes or legend missing", texts)
	}
	for _, want := range []string{"per-instance", "per-request", "FailLocal", "Redis down", "limit"} {
		if !bytes.Contains(data, []byte(want)) {
			t.Errorf("chart lacks %q", want)
		}
	}
}

func TestBadFlags(t *testing.T) {
	tests := []struct {
		args    []string
		mention string
	}{
		{[]string{"-instances", "0"}, "-instances"},
		{[]string{"-instances", "-3"}, "-instances"},
		{[]string{"-duration", "-1s"}, "-duration"},
		{[]string{"-duration", "0"}, "-duration"},
		{[]string{"-duration", "soon"}, "invalid value"},
		{[]string{"-outage", "-1s"}, "-outage"},
		{[]string{"-load", "0"}, "-load"},
		{[]string{"-load", "NaN"}, "-load"},
		{[]string{"-limit", "0"}, "-limit"},
		{[]string{"-workers", "0"}, "-workers"},
		{[]string{"-tail-keys", "0"}, "-tail-keys"},
		{[]string{"-timeout", "-1s"}, "-timeout"},
		{[]string{"-chart", "out.png"}, ".svg"},
		{[]string{"-trace-ratio", "2"}, "-trace-ratio"},
		{[]string{"-trace-ratio", "-0.1"}, "-trace-ratio"},
		{[]string{"-trace-ratio", "NaN"}, "-trace-ratio"},
		{[]string{"-otlp", "ftp://collector:4318"}, "-otlp"},
		{[]string{"-otlp", "http://"}, "-otlp"},
		{[]string{"-redis", "a:1", "-redis-cluster", "b:1,c:1"}, "cannot both"},
		{[]string{"-redis", "redis://:pw@host:notaport/x"}, "-redis"},
		{[]string{"-no-such-flag"}, "flag provided but not defined"},
		{[]string{"extra"}, "unexpected argument"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, out, errOut := runDemo(t, tc.args...)
			if code != exitUsage {
				t.Errorf("exit code %d, want %d", code, exitUsage)
			}
			if out != "" {
				t.Errorf("wrote to stdout: %q", out)
			}
			if !strings.Contains(errOut, tc.mention) {
				t.Errorf("stderr does not mention %q:\n%s", tc.mention, errOut)
			}
		})
	}
}

func TestHelp(t *testing.T) {
	for _, h := range []string{"-h", "-help", "--help"} {
		code, out, errOut := runDemo(t, h)
		if code != exitOK {
			t.Errorf("%s: exit code %d, want 0", h, code)
		}
		if out != "" {
			t.Errorf("%s: wrote to stdout: %q", h, out)
		}
		for _, flag := range []string{"-redis ADDR", "-redis-cluster ADDRS", "-instances N", "-duration", "-outage", "-chart FILE.svg",
			"-seed", "-limit N", "-load", "-workers", "-tail-keys", "-timeout",
			"-otlp ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "-trace-ratio R",
			"(default 8)", "(default 8s)", "(default 3s)", "(default 1)", "(default 2500)", "(default 100)", "(default 0.01)"} {
			if !strings.Contains(errOut, flag) {
				t.Errorf("%s: help lacks %q:\n%s", h, flag, errOut)
			}
		}
	}
}

// TestRealRedis runs the demo against a redis-server (see redistest.Start):
// commands are counted with INFO, and the outage act is skipped.
func TestRealRedis(t *testing.T) {
	addr := redistest.Start(t).Addr // skips without redis-server, unless LEASELIMIT_REQUIRE_REDIS=1

	noOTLPEnv(t)
	code, out, errOut := runDemo(t, "-redis", addr, "-duration", "500ms", "-instances", "2", "-limit", "20", "-load", "600", "-timeout", "1s")
	t.Logf("stdout:\n%s", out)
	if code != exitOK {
		t.Fatalf("exit code %d, want 0; stderr:\n%s", code, errOut)
	}
	if !strings.Contains(out, "processed by the server") {
		t.Errorf("no server command counts from INFO")
	}
	if !strings.Contains(out, "outage act needs the embedded Redis") {
		t.Errorf("the outage act was not skipped")
	}
	if strings.Contains(out, "FailLocal instance") {
		t.Errorf("the report speaks of the skipped act's traced FailLocal instance")
	}
	designs := parseDesigns(t, out)
	if r, ok := designs["(c)"]["hot"]; !ok || r.admitted > r.ideal {
		t.Errorf("leaselimit hot key: %+v, want admitted <= ideal", r)
	}
}

func TestRedisUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now
	code, _, errOut := runDemo(t, "-redis", addr, "-duration", "200ms")
	if code != exitFailed {
		t.Errorf("exit code %d, want %d", code, exitFailed)
	}
	if !strings.Contains(errOut, "cannot reach Redis") {
		t.Errorf("stderr: %s", errOut)
	}
}

// TestSeriesPointsPerSecond: the chart plots requests admitted in the
// trailing second, not one 250ms bin scaled by four. Regression: a burst of
// 20 in the first bin under a 20/s limit showed as 80/s, a 4× overshoot
// that never happened.
func TestSeriesPointsPerSecond(t *testing.T) {
	s := &seriesStats{bins: make([]atomic.Int64, 8)}
	for i, n := range []int64{20, 5, 5, 5, 5, 5, 5, 5} {
		s.bins[i].Store(n)
	}
	xs, ys := seriesPoints(s, 0, 2*time.Second)
	want := []float64{20, 25, 30, 35, 20, 20, 20, 20}
	if len(ys) != len(want) {
		t.Fatalf("%d points; want %d", len(ys), len(want))
	}
	for i := range want {
		if ys[i] != want[i] || xs[i] != float64(i+1)*binWidth.Seconds() {
			t.Errorf("point %d = (%v, %v); want (%v, %v)", i, xs[i], ys[i], float64(i+1)*binWidth.Seconds(), want[i])
		}
	}
}
