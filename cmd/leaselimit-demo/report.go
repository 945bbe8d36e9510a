package main

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/policy"
)

var allSources = []leaselimit.Source{leaselimit.SourceLease, leaselimit.SourceAuthority, leaselimit.SourceCache, leaselimit.SourceFallback}

// ideal is what one central token bucket, full at the start, admits at most
// over a run of length t: Burst + Rate·T.
func (d *demo) ideal(t time.Duration) float64 {
	return float64(d.limit.Burst) + float64(d.limit.Rate)*t.Seconds()/d.limit.Period.Seconds()
}

func (d *demo) reportAct1() {
	w := d.out
	fmt.Fprintf(w, "\nAct 1 results (the designs ran one after another; T is each run's measured length;\n")
	fmt.Fprintf(w, "ideal = Burst + Rate·T, the most one central token bucket admits in T)\n")
	for _, ds := range d.designs {
		st := ds.s.stats
		fmt.Fprintf(w, "\n%s: %s\n", ds.label, ds.how)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(tw, "    %-10s\trequests\tadmitted\tideal\tadmitted/ideal\t\n", "key")
		for _, c := range []int{classHot, classAbusive} {
			req := st.sum(nil, []int{c}, nil, false)
			adm := st.sum(nil, []int{c}, nil, true)
			id := d.ideal(ds.elapsed)
			fmt.Fprintf(tw, "    %-10s\t%s\t%s\t%s\t%s\t  %s\n", classNames[c], num(float64(req)), num(float64(adm)), num(id), ratio(float64(adm)/id)+"×", d.boundNote(ds, c))
		}
		treq := st.sum(nil, []int{classTail}, nil, false)
		tadm := st.sum(nil, []int{classTail}, nil, true)
		note := "of requests admitted"
		if perKey := d.tr.demand(classTail) / float64(d.cfg.tailKeys); perKey < float64(d.limit.Rate)/d.limit.Period.Seconds() {
			note += " (every tail key is under its limit: all should be)"
		}
		fmt.Fprintf(tw, "    %-10s\t%s\t%s\t\t%s\t  %s\n", classNames[classTail], num(float64(treq)), num(float64(tadm)), pct(tadm, treq), note)
		tw.Flush()
		total := st.sum(nil, nil, nil, false)
		lat := st.latencies()
		fmt.Fprintf(w, "    T = %.2fs, %s decisions = %s/s, latency p50 %s p99 %s, errors %d\n",
			ds.elapsed.Seconds(), num(float64(total)), num(float64(total)/ds.elapsed.Seconds()),
			dur(quantile(lat, 0.50)), dur(quantile(lat, 0.99)), d.errorCount(st))
		if ds.usesRedis {
			fmt.Fprintf(w, "    Redis: %s commands sent by the fleet (%s per decision)", num(float64(ds.calls)), per(ds.calls, total))
			if ds.cmdsOK {
				fmt.Fprintf(w, ", %s processed by the server incl. inside scripts (%s per decision)", num(float64(ds.cmds)), per(ds.cmds, total))
			}
			fmt.Fprintln(w)
			fmt.Fprintf(w, "    decisions by source: %s\n", sources(st, nil, nil))
			for _, c := range []int{classHot, classAbusive, classTail} {
				fmt.Fprintf(w, "      %-11s%s\n", classNames[c]+":", sources(st, nil, []int{c}))
			}
		} else {
			fmt.Fprintf(w, "    Redis: none\n")
		}
		d.printErrors(st, ds.closeErrs)
	}

	fmt.Fprintf(w, "\nSummary (same traffic, same limit %s):\n", d.limit)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	lw := 0
	for _, ds := range d.designs {
		lw = max(lw, len(ds.label))
	}
	fmt.Fprintf(tw, "%-*s\thot key\tabusive\tdecisions/s\tRedis cmds sent\tserver cmds\tlatency p50\tlatency p99\t\n", lw, "design")
	fmt.Fprintf(tw, "%-*s\tadmitted/ideal\tadmitted/ideal\t\tper decision\tper decision\t\t\t\n", lw, "")
	for _, ds := range d.designs {
		st := ds.s.stats
		total := st.sum(nil, nil, nil, false)
		lat := st.latencies()
		h := float64(st.sum(nil, []int{classHot}, nil, true)) / d.ideal(ds.elapsed)
		a := float64(st.sum(nil, []int{classAbusive}, nil, true)) / d.ideal(ds.elapsed)
		calls, cmds := "0", "0"
		if ds.usesRedis {
			calls = per(ds.calls, total)
			cmds = "n/a"
			if ds.cmdsOK {
				cmds = per(ds.cmds, total)
			}
		}
		fmt.Fprintf(tw, "%-*s\t%s×\t%s×\t%s\t%s\t%s\t%s\t%s\t\n", lw, ds.label, ratio(h), ratio(a),
			num(float64(total)/ds.elapsed.Seconds()), calls, cmds, dur(quantile(lat, 0.5)), dur(quantile(lat, 0.99)))
	}
	tw.Flush()
}

// boundNote says whether a design stayed within Burst + Rate·T for a class,
// and records a violation when a leaselimit design did not.
func (d *demo) boundNote(ds *designResult, class int) string {
	st := ds.s.stats
	adm := float64(st.sum(nil, []int{class}, nil, true))
	bound := d.ideal(ds.elapsed)
	if adm <= bound {
		return "within the bound"
	}
	note := fmt.Sprintf("OVER the bound by %s", num(adm-bound))
	if !ds.usesRedis {
		return note
	}
	if fb := st.sum(nil, []int{class}, []leaselimit.Source{leaselimit.SourceFallback}, true); fb > 0 {
		// Redis did not answer within the time budget and the failure
		// policy (FailOpen) admitted: the bound only holds while Redis is healthy.
		return note + fmt.Sprintf(" (%s admitted by the failure policy: Redis slower than -timeout)", num(float64(fb)))
	}
	d.violations = append(d.violations, fmt.Sprintf("%s admitted %s requests of the %s in %.3fs, more than Burst + Rate·T = %s, with Redis healthy",
		ds.label, num(adm), classNames[class], ds.elapsed.Seconds(), num(bound)))
	return note + " — a leaselimit bug"
}

func (d *demo) errorCount(st *seriesStats) int64 {
	var n int64
	for w := range st.errors {
		n += st.errors[w].Load()
	}
	return n
}

// printErrors lists the distinct errors of a series and of its Close calls;
// errors of leaselimit decisions are violations (an outage is not an error).
func (d *demo) printErrors(st *seriesStats, closeErrs []string) {
	if len(st.errs) > 0 {
		msgs := make([]string, 0, len(st.errs))
		for m := range st.errs {
			msgs = append(msgs, m)
		}
		sort.Strings(msgs)
		for _, m := range msgs {
			fmt.Fprintf(d.out, "    ERROR ×%d: %s\n", st.errs[m], m)
			d.violations = append(d.violations, fmt.Sprintf("Allow returned an error %d times: %s", st.errs[m], m))
		}
	}
	for _, e := range closeErrs {
		fmt.Fprintf(d.out, "    Close: %s\n", e)
	}
}

func (d *demo) reportAct2() {
	o := d.outage
	if o == nil || o.skipped != "" {
		return
	}
	w := d.out
	downFor := o.upAt - o.downAt
	fmt.Fprintf(w, "\nAct 2 results: Redis up %.1fs, down %.2fs (stopped at %.2fs, back at %.2fs), then up %.1fs.\n",
		o.downAt.Seconds(), downFor.Seconds(), o.downAt.Seconds(), o.upAt.Seconds(), (o.elapsed - o.upAt).Seconds())
	fmt.Fprintf(w, "Each Limiter: WithFailureMode(m), WithFleetSize(%d), WithBreaker(breaker.Settings{OpenFor: %v}), default timeout %v.\n",
		d.cfg.instances, breakerOpenFor, leaselimit.DefaultTimeout)
	bound := d.ideal(downFor)
	fmt.Fprintf(w, "Hot-key limit while Redis was down: Burst + Rate·T = %s (T = %.2fs); its demand was %s requests.\n",
		num(bound), downFor.Seconds(), num(o.tr.demand(classHot)*downFor.Seconds()))
	for k, s := range o.series {
		st := s.stats
		fmt.Fprintf(w, "\n%s (policy.%s): %s\n", s.label, s.label, modeHow(o.modes[k], d.cfg.instances, d.limit.Rate))
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(tw, "    %-10s\tdecisions\tlease\tauthority\tcache\tfallback\tadmitted\thot key admitted\terrors\t\n", "window")
		wins := []struct {
			name string
			w    int
		}{{"Redis up", winBefore}, {"Redis down", winDown}, {"Redis back", winAfter}}
		for _, win := range wins {
			ws := []int{win.w}
			row := fmt.Sprintf("    %-10s\t%s", win.name, num(float64(st.sum(ws, nil, nil, false))))
			for _, src := range allSources {
				row += "\t" + num(float64(st.sum(ws, nil, []leaselimit.Source{src}, false)))
			}
			row += "\t" + num(float64(st.sum(ws, nil, nil, true)))
			hot := st.sum(ws, []int{classHot}, nil, true)
			hotCol := num(float64(hot))
			if win.w == winDown {
				hotCol += fmt.Sprintf(" = %s× limit", ratio(float64(hot)/bound))
			}
			row += "\t" + hotCol + "\t" + strconv.FormatInt(st.errors[win.w].Load(), 10) + "\t"
			fmt.Fprintln(tw, row)
		}
		tw.Flush()
		fmt.Fprintf(w, "    %s\n", d.resumed(st))
		d.printErrors(st, o.closeErrs[k])
	}
}

func modeHow(m interface{ String() string }, n int, r int64) string {
	switch m.String() {
	case "open":
		return "admit everything while Redis is unavailable"
	case "closed":
		return "deny everything while Redis is unavailable"
	}
	share := (r + int64(n) - 1) / int64(n)
	return fmt.Sprintf("each instance runs a local bucket with 1/%d of the limit (%d/s) while Redis is unavailable", n, share)
}

// resumed says when authority decisions resumed after Redis came back.
func (d *demo) resumed(st *seriesStats) string {
	o := d.outage
	var first, lastInst time.Duration = -1, -1
	missing := 0
	for i := range st.firstAuth {
		v := st.firstAuth[i].Load()
		if v == 0 {
			missing++
			continue
		}
		t := time.Duration(v) - o.upAt
		if t < 0 {
			t = 0
		}
		if first < 0 || t < first {
			first = t
		}
		if t > lastInst {
			lastInst = t
		}
	}
	if first < 0 {
		return fmt.Sprintf("authority decisions did not resume within %.1fs of Redis coming back", (o.elapsed - o.upAt).Seconds())
	}
	s := fmt.Sprintf("authority decisions resumed %.2fs after Redis came back", first.Seconds())
	if missing == 0 {
		s += fmt.Sprintf(" (on all %d instances by %.2fs)", len(st.firstAuth), lastInst.Seconds())
	} else {
		s += fmt.Sprintf(" (%d of %d instances made none)", missing, len(st.firstAuth))
	}
	return s
}

func (d *demo) verdict() {
	w := d.out
	if len(d.designs) < 3 {
		return
	}
	a, b, c := d.designs[0], d.designs[1], d.designs[2]
	// within reports whether a design admitted no more than the bound for
	// the hot and the abusive key, and the larger of the two ratios.
	within := func(ds *designResult) (bool, float64) {
		worst := 0.0
		for _, class := range []int{classHot, classAbusive} {
			worst = math.Max(worst, float64(ds.s.stats.sum(nil, []int{class}, nil, true))/d.ideal(ds.elapsed))
		}
		return worst <= 1, worst
	}
	latency := func(ds *designResult) string {
		lat := ds.s.stats.latencies()
		return fmt.Sprintf("p50 %s, p99 %s", dur(quantile(lat, 0.5)), dur(quantile(lat, 0.99)))
	}
	fmt.Fprintf(w, "\nIn short:\n")
	if ok, r := within(a); ok {
		fmt.Fprintf(w, "  - (a) per-instance buckets stayed within the bound (%s×): the demand per instance was too low to show N× over-admission.\n", ratio(r))
	} else {
		fmt.Fprintf(w, "  - (a) per-instance buckets admitted up to %s× what one bucket allows: each of the %d instances gives out the whole limit.\n", ratio(r), d.cfg.instances)
	}
	okB, rB := within(b)
	state := "stayed within the bound"
	if !okB {
		state = "went over the bound"
	}
	fmt.Fprintf(w, "  - (b) one Redis call per request %s (%s×), but every decision waits on Redis: latency %s.\n", state, ratio(rB), latency(b))
	cs := c.s.stats
	total := cs.sum(nil, nil, nil, false)
	local := cs.sum(nil, nil, []leaselimit.Source{leaselimit.SourceLease, leaselimit.SourceCache}, false)
	okC, rC := within(c)
	state = "stayed within the bound"
	if !okC {
		state = "went OVER the bound"
	}
	fmt.Fprintf(w, "  - (c) leaselimit %s (%s×), decided %s of requests without Redis (lease or negative cache), latency %s",
		state, ratio(rC), pct(local, total), latency(c))
	if c.calls > 0 && b.calls > 0 {
		fmt.Fprintf(w, ",\n    and sent %s× fewer Redis commands than (b)", ratio(float64(b.calls)/float64(c.calls)))
	}
	fmt.Fprintln(w, ".")
	hotTotal := cs.sum(nil, []int{classHot}, nil, false)
	hotLease := cs.sum(nil, []int{classHot}, []leaselimit.Source{leaselimit.SourceLease}, false)
	if hotTotal > 0 && float64(hotLease) < 0.1*float64(hotTotal) {
		perInst := float64(cs.sum(nil, []int{classHot}, nil, true)) / c.elapsed.Seconds() / float64(d.cfg.instances)
		fmt.Fprintf(w, "    Leases barely engage at this limit (%s of the hot key's decisions): each instance admits only\n", pct(hotLease, hotTotal))
		fmt.Fprintf(w, "    ~%s/s of the hot key, and a lease covers %v of that. What (c) saves here comes from the negative\n",
			num(perInst), policy.DefaultLease().Horizon)
		fmt.Fprintf(w, "    cache and coalescing. With a limit above the demand (try -limit 5000), leases serve most decisions.\n")
	}
}

// sources formats a series' decisions by Source.
func sources(st *seriesStats, windows, classes []int) string {
	total := st.sum(windows, classes, nil, false)
	var parts []string
	for _, src := range allSources {
		n := st.sum(windows, classes, []leaselimit.Source{src}, false)
		parts = append(parts, fmt.Sprintf("%s %s (%s)", src, num(float64(n)), pct(n, total)))
	}
	return strings.Join(parts, ", ")
}

// num formats a count with thousands separators.
func num(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	n := int64(math.Round(v))
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

func ratio(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

func pct(n, of int64) string {
	if of == 0 {
		return "-"
	}
	return strconv.FormatFloat(100*float64(n)/float64(of), 'f', 1, 64) + "%"
}

func per(n, of int64) string {
	if of == 0 {
		return "-"
	}
	v := float64(n) / float64(of)
	switch {
	case v == 0:
		return "0"
	case v < 0.01:
		return strconv.FormatFloat(v, 'f', 4, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

// dur formats a latency with 3 significant digits.
func dur(d time.Duration) string {
	switch {
	case d < time.Microsecond:
		return strconv.FormatInt(int64(d), 10) + "ns"
	case d < time.Millisecond:
		return strconv.FormatFloat(float64(d)/1e3, 'g', 3, 64) + "µs"
	case d < time.Second:
		return strconv.FormatFloat(float64(d)/1e6, 'g', 3, 64) + "ms"
	}
	return strconv.FormatFloat(d.Seconds(), 'g', 3, 64) + "s"
}
