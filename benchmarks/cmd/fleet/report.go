package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/leaselimit/leaselimit/benchmarks/internal/host"

	"github.com/leaselimit/leaselimit/policy"
)

// window is a time during which Redis could not answer: stopped, or
// killed until it answered again after its restart.
type window struct {
	from, to time.Duration // since the phase started
}

// phaseResult is what one phase sent, got and did to Redis.
type phaseResult struct {
	name    string
	faults  string // what was done to Redis, for the table
	keys    int
	recs    []record
	windows []window
	// resets is how often Redis lost its state (killed): each time every
	// bucket starts full again, so the bound grows by one Burst a key.
	resets int
	cpu    cpuUse // CPU used during the attack
}

// summary is one row of the tables.
type summary struct {
	requests, admitted, tooMany, unavailable, otherCode, failed, wrong int

	span        time.Duration // first request sent to last answer read
	keyBound    float64       // Burst·(1 + resets) + Rate·span/Period
	bound       float64       // keyBound × keys
	maxKeyRatio float64       // the highest admitted / keyBound over the keys
	keysOver    int           // keys that got more than keyBound

	p50, p90, p99, max time.Duration

	// Requests sent while Redis could not answer (inside the windows).
	faultRequests, faultFast, faultSlow, faultAdmitted int
	faultP50, faultP99, faultMax                       time.Duration
	// The others, for comparison: the same host with Redis answering.
	calmRequests, calmFast int

	errSample string // one transport error, if any
}

// writeRecords writes the requests of ph to path as CSV: sent (ms since
// the phase started), latency (ms), client key, HTTP status (0: no answer),
// error, and whether Redis could not answer when it was sent.
func writeRecords(path string, ph *phaseResult) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	fmt.Fprintln(w, "sent_ms,latency_ms,key,status,error,in_fault")
	for _, r := range ph.recs {
		fmt.Fprintf(w, "%.3f,%.3f,%d,%d,%q,%t\n", float64(r.sent)/1e6, float64(r.latency)/1e6, r.key, r.code, r.err, in(ph.windows, r.sent))
	}
	err = w.Flush()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// fastDecision is the latency an outage decision should stay within.
const fastDecision = 10 * time.Millisecond

// summarize computes the row of ph for limit and budget (the slow
// threshold during faults is 3× budget).
func summarize(ph *phaseResult, limit policy.Limit, budget time.Duration) summary {
	var s summary
	s.requests = len(ph.recs)
	perKey := make([]int, ph.keys)
	lat := make([]time.Duration, 0, len(ph.recs))
	var faultLat []time.Duration
	var first, last time.Duration
	for i, r := range ph.recs {
		if i == 0 || r.sent < first {
			first = r.sent
		}
		last = max(last, r.sent+r.latency)
		lat = append(lat, r.latency)
		switch r.code {
		case 200:
			s.admitted++
			perKey[r.key]++
		case 429:
			s.tooMany++
		case 503:
			s.unavailable++
		case 0:
			s.failed++
			if s.errSample == "" {
				s.errSample = r.err
			}
		default:
			s.otherCode++
		}
		if r.wrong {
			s.wrong++
		}
		if in(ph.windows, r.sent) {
			s.faultRequests++
			faultLat = append(faultLat, r.latency)
			if r.code != 0 && r.latency <= fastDecision {
				s.faultFast++
			}
			if r.latency > 3*budget {
				s.faultSlow++
			}
			if r.code == 200 {
				s.faultAdmitted++
			}
		} else {
			s.calmRequests++
			if r.code != 0 && r.latency <= fastDecision {
				s.calmFast++
			}
		}
	}
	s.span = last - first
	s.keyBound = float64(limit.Burst)*float64(1+ph.resets) + float64(limit.Rate)*s.span.Seconds()/limit.Period.Seconds()
	s.bound = s.keyBound * float64(ph.keys)
	for _, n := range perKey {
		s.maxKeyRatio = max(s.maxKeyRatio, float64(n)/s.keyBound)
		if float64(n) > s.keyBound {
			s.keysOver++
		}
	}
	s.p50, s.p90, s.p99, s.max = quantiles(lat)
	s.faultP50, _, s.faultP99, s.faultMax = quantiles(faultLat)
	return s
}

// in reports whether t falls inside one of ws.
func in(ws []window, t time.Duration) bool {
	for _, w := range ws {
		if t >= w.from && t < w.to {
			return true
		}
	}
	return false
}

// quantiles returns the 50th, 90th and 99th percentiles (nearest rank) and
// the maximum of d, which it sorts.
func quantiles(d []time.Duration) (p50, p90, p99, mx time.Duration) {
	if len(d) == 0 {
		return
	}
	slices.Sort(d)
	at := func(q float64) time.Duration {
		i := int(q*float64(len(d))+0.999999) - 1
		return d[min(max(i, 0), len(d)-1)]
	}
	return at(0.5), at(0.9), at(0.99), d[len(d)-1]
}

// printReport writes the tables and the targets, in Markdown.
func printReport(w io.Writer, cfg *config, env string, phases []*phaseResult) {
	fmt.Fprintln(w, env)
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| phase | faults injected into redis-server | requests | admitted (200) | bound Σ(Burst + Rate·T) | admitted / bound | worst key / its bound | keys over | 429 | 503 | other | p50 | p90 | p99 | max |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	sums := make([]summary, len(phases))
	for i, ph := range phases {
		s := summarize(ph, cfg.limit, cfg.timeout)
		sums[i] = s
		other := fmt.Sprint(s.otherCode + s.failed)
		if s.failed > 0 {
			other = fmt.Sprintf("%d (%d without answer)", s.otherCode+s.failed, s.failed)
		}
		fmt.Fprintf(w, "| %s | %s | %d | %d | %.0f | %.3f | %.3f | %d of %d | %d | %d | %s | %s | %s | %s | %s |\n",
			ph.name, ph.faults, s.requests, s.admitted, s.bound, float64(s.admitted)/s.bound, s.maxKeyRatio, s.keysOver, ph.keys,
			s.tooMany, s.unavailable, other, dur(s.p50), dur(s.p90), dur(s.p99), dur(s.max))
	}

	header := false
	for i, ph := range phases {
		s := sums[i]
		if len(ph.windows) == 0 {
			continue
		}
		if !header {
			header = true
			fmt.Fprintln(w)
			fmt.Fprintf(w, "While Redis could not answer (requests sent inside the faults; budget %v):\n\n", cfg.timeout)
			fmt.Fprintf(w, "| phase | time without Redis | requests | answered within %v | over 3× the budget (%v) | admitted | p50 | p99 | max | the phase's other requests: within %v |\n",
				fastDecision, 3*cfg.timeout, fastDecision)
			fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
		}
		var down time.Duration
		for _, win := range ph.windows {
			down += win.to - win.from
		}
		fmt.Fprintf(w, "| %s | %s | %d | %s | %d | %d | %s | %s | %s | %s |\n",
			ph.name, dur(down), s.faultRequests, pct(s.faultFast, s.faultRequests), s.faultSlow, s.faultAdmitted,
			dur(s.faultP50), dur(s.faultP99), dur(s.faultMax), pct(s.calmFast, s.calmRequests))
	}

	if phases[0].cpu.ok {
		fmt.Fprintln(w)
		fmt.Fprintf(w, "CPU time used during each phase (the machine has %d CPUs × the phase's length):\n\n", runtime.NumCPU())
		fmt.Fprintln(w, "| phase | instances | redis-server | load balancer | vegeta | all, per request |")
		fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|")
		for i, ph := range phases {
			c := ph.cpu
			total := c.instances + c.redis + c.lb + c.fleet
			fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", ph.name, cpuCell(c.instances), cpuCell(c.redis), cpuCell(c.lb), cpuCell(c.fleet),
				dur(total/time.Duration(max(sums[i].requests, 1))))
		}
	}

	for i, ph := range phases {
		s := sums[i]
		if want := float64(cfg.rate) * cfg.duration.Seconds(); float64(s.requests) < 0.95*want || s.p50 > time.Second {
			fmt.Fprintf(w, "\n**%s: the machine did not keep up**: vegeta sent %d of %.0f requests, median latency %s; "+
				"this phase measured an overloaded host more than the limiter (lower -rate, or stop other work).\n", ph.name, s.requests, want, dur(s.p50))
		}
	}

	fmt.Fprintln(w)
	fmt.Fprintln(w, "Bound: every phase uses clients of its own (full buckets at its start); T runs from its first request sent to its last answer;")
	fmt.Fprintln(w, "after a kill Redis restarts empty, so every bucket is full again and the bound grows by one Burst a key. Latency is vegeta's,")
	fmt.Fprintln(w, "through the load balancer: from sending the request to reading the answer.")

	fmt.Fprintln(w)
	fmt.Fprintln(w, "Targets (issue 26):")
	for i, ph := range phases {
		s := sums[i]
		switch {
		case strings.HasPrefix(ph.name, "stalls"):
			r := float64(s.admitted) / s.bound
			fmt.Fprintf(w, "- %s, failure mode %s: admitted ≤ 1.03× the bound: %.3f, %s\n", ph.name, cfg.mode, r, verdict(r <= 1.03))
		case ph.name == "outage" || ph.name == "kill":
			share := float64(s.faultFast) / float64(max(s.faultRequests, 1))
			fmt.Fprintf(w, "- %s: ≥ 95%% of decisions within %v: %s, %s; none over 3× the budget: %d, %s\n",
				ph.name, fastDecision, pct(s.faultFast, s.faultRequests), verdict(share >= 0.95), s.faultSlow, verdict(s.faultSlow == 0))
		}
	}
	for i, ph := range phases {
		if s := sums[i]; s.errSample != "" {
			fmt.Fprintf(w, "\n%s: requests without an answer, e.g. %q\n", ph.name, s.errSample)
		}
	}
}

func cpuCell(d time.Duration) string { return fmt.Sprintf("%.2fs", d.Seconds()) }

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "**not met**"
}

func pct(n, of int) string {
	if of == 0 {
		return "—"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(n)/float64(of))
}

func dur(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%.2fs", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.1fms", float64(d)/1e6)
	case d > 0:
		return fmt.Sprintf("%.0fµs", float64(d)/1e3)
	}
	return "0"
}

// machine describes where the run happened.
func machine() string {
	return fmt.Sprintf("%d CPUs (GOMAXPROCS %d), %s/%s, %s%s", runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.GOOS, runtime.GOARCH, runtime.Version(), host.LoadAvg())
}
