package main

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"math"
	"os"
	"strings"
	"time"
)

// chartSeries is one line of the chart: points at x seconds (from the start
// of act 1) with y the requests admitted in the trailing second.
type chartSeries struct {
	name   string
	color  string
	dashed bool
	xs, ys []float64
}

// chartBand is a labelled stretch of the x axis.
type chartBand struct {
	from, to float64
	label    string
	shade    string  // fill colour, "" for none
	y        float64 // for a reference segment
}

// writeChart writes the SVG chart of the hot key's admitted requests per
// second over the whole run.
func writeChart(path string, d *demo) error {
	svg := renderChart(d)
	return os.WriteFile(path, svg, 0o644)
}

var designColors = []string{"#d95f02", "#7570b3", "#1b9e77"}
var modeColors = []string{"#e7298a", "#555555", "#1f78b4"}

// seriesPoints turns a series' hot-key bins into the requests admitted in
// the trailing second at the end of each bin, skipping a partial last bin.
// A count over a whole second, not one bin scaled up, so the y axis is a
// true per-second figure: the initial burst shows as the burst plus a
// second of refill at most, not as four times one bin.
func seriesPoints(s *seriesStats, offset float64, length time.Duration) (xs, ys []float64) {
	n := int(length / binWidth)
	if n > len(s.bins) {
		n = len(s.bins)
	}
	per := int(time.Second / binWidth) // bins in a second
	var window int64
	for i := 0; i < n; i++ {
		window += s.bins[i].Load()
		if i >= per {
			window -= s.bins[i-per].Load()
		}
		xs = append(xs, offset+float64(i+1)*binWidth.Seconds())
		ys = append(ys, float64(window))
	}
	return xs, ys
}

func renderChart(d *demo) []byte {
	var series []chartSeries
	var bands []chartBand
	var phases []chartBand
	var demand []chartBand // the hot key's demand, per act (label holds nothing)
	x := 0.0
	for k, ds := range d.designs {
		xs, ys := seriesPoints(ds.s.stats, x, d.cfg.duration)
		series = append(series, chartSeries{name: ds.label, color: designColors[k%len(designColors)], xs: xs, ys: ys})
		phases = append(phases, chartBand{from: x, to: x + d.cfg.duration.Seconds(), label: ds.label})
		x += d.cfg.duration.Seconds()
	}
	if x > 0 {
		demand = append(demand, chartBand{from: 0, to: x, y: d.tr.demand(classHot)})
	}
	if o := d.outage; o != nil && o.skipped == "" && len(o.series) > 0 {
		length := o.warmup + o.down + o.back
		for k, s := range o.series {
			xs, ys := seriesPoints(s.stats, x, length)
			series = append(series, chartSeries{name: "outage act: leaselimit " + s.label, color: modeColors[k%len(modeColors)], dashed: k == 1, xs: xs, ys: ys})
		}
		phases = append(phases, chartBand{from: x, to: x + length.Seconds(), label: "act 2: outage, by failure policy"})
		bands = append(bands, chartBand{from: x + o.downAt.Seconds(), to: x + o.upAt.Seconds(), label: "Redis down", shade: "#f3d6d6"})
		demand = append(demand, chartBand{from: x, to: x + length.Seconds(), y: o.tr.demand(classHot)})
		x += length.Seconds()
	}
	limit := float64(d.limit.Rate) / d.limit.Period.Seconds()
	title := fmt.Sprintf("leaselimit demo: hot key admitted per second, %d instances, limit %s/s", d.cfg.instances, num(limit))
	return svgChart(title, x, limit, demand, series, bands, phases)
}

// svgChart draws the chart by hand: axes with ticks and labels, the shaded
// bands, the limit and demand lines, the series and a legend.
func svgChart(title string, xmax, limit float64, demand []chartBand, series []chartSeries, bands, phases []chartBand) []byte {
	const (
		width, height                = 1000.0, 560.0
		left, right, top, bottomArea = 78.0, 24.0, 64.0, 150.0
	)
	pw, ph := width-left-right, height-top-bottomArea
	ymax := limit
	for _, dm := range demand {
		ymax = math.Max(ymax, dm.y)
	}
	for _, s := range series {
		for _, y := range s.ys {
			ymax = math.Max(ymax, y)
		}
	}
	ystep := niceStep(ymax*1.08, 6)
	ymax = math.Ceil(ymax*1.08/ystep) * ystep
	if xmax <= 0 {
		xmax = 1
	}
	xstep := niceStep(xmax, 12)
	px := func(v float64) float64 { return left + v/xmax*pw }
	py := func(v float64) float64 { return top + ph - v/ymax*ph }

	var b bytes.Buffer
	fmt.Fprintf(&b, `<?xml version="1.0" encoding="UTF-8"?>`+"\n")
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%g" height="%g" viewBox="0 0 %g %g" font-family="Helvetica, Arial, sans-serif" font-size="12">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect x="0" y="0" width="%g" height="%g" fill="#ffffff"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%g" y="24" font-size="16" font-weight="bold" text-anchor="middle">%s</text>`+"\n", width/2, esc(title))

	// Shaded bands (the outage) and phase separators with their names.
	for _, band := range bands {
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`+"\n", px(band.from), top, px(band.to)-px(band.from), ph, band.shade)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#a33">%s</text>`+"\n", (px(band.from)+px(band.to))/2, top+16, esc(band.label))
	}
	for i, p := range phases {
		if i > 0 {
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#999" stroke-width="1"/>`+"\n", px(p.from), top-14, px(p.from), top+ph)
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="11" fill="#333">%s</text>`+"\n", (px(p.from)+px(p.to))/2, top-6, esc(p.label))
	}

	// Grid and axes.
	for v := 0.0; v <= ymax+ystep/2; v += ystep {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#e5e5e5"/>`+"\n", left, py(v), left+pw, py(v))
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end">%s</text>`+"\n", left-6, py(v)+4, num(v))
	}
	for v := 0.0; v <= xmax+xstep/1000; v += xstep {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#333"/>`+"\n", px(v), top+ph, px(v), top+ph+5)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", px(v), top+ph+18, trimFloat(v))
	}
	fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#333"/>`+"\n", left, top+ph, left+pw, top+ph)
	fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#333"/>`+"\n", left, top, left, top+ph)
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">time since the demo started, seconds (each design runs on its own; the outage act runs three fleets side by side)</text>`+"\n", left+pw/2, top+ph+38)
	fmt.Fprintf(&b, `<text transform="translate(18 %.1f) rotate(-90)" text-anchor="middle">hot key: admitted in the trailing second</text>`+"\n", top+ph/2)

	// Reference lines: the limit and the hot key's demand.
	fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#000" stroke-width="1.5" stroke-dasharray="8 4"/>`+"\n", left, py(limit), left+pw, py(limit))
	for _, dm := range demand {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#999" stroke-width="1.2" stroke-dasharray="2 3"/>`+"\n", px(dm.from), py(dm.y), px(dm.to), py(dm.y))
	}

	// The series.
	for _, s := range series {
		if len(s.xs) == 0 {
			continue
		}
		var pts strings.Builder
		for i := range s.xs {
			fmt.Fprintf(&pts, "%.1f,%.1f ", px(s.xs[i]), py(s.ys[i]))
		}
		dash := ""
		if s.dashed {
			dash = ` stroke-dasharray="5 3"`
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" stroke-linejoin="round"%s points="%s"/>`+"\n", s.color, dash, strings.TrimSpace(pts.String()))
	}

	// Legend, below the x axis label, in two columns.
	type entry struct {
		name, color, dash string
		width             float64
	}
	entries := []entry{
		{fmt.Sprintf("the limit: %s requests/s per key", num(limit)), "#000", "8 4", 1.5},
		{"hot key demand (offered requests per second)", "#999", "2 3", 1.2},
	}
	for _, s := range series {
		dash := ""
		if s.dashed {
			dash = "5 3"
		}
		entries = append(entries, entry{s.name, s.color, dash, 2})
	}
	ly := top + ph + 60
	for i, e := range entries {
		col, row := i%2, i/2
		x0 := left + float64(col)*pw/2
		y0 := ly + float64(row)*18
		dash := ""
		if e.dash != "" {
			dash = fmt.Sprintf(` stroke-dasharray="%s"`, e.dash)
		}
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="%g"%s/>`+"\n", x0, y0-4, x0+28, y0-4, e.color, e.width, dash)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f">%s</text>`+"\n", x0+36, y0, esc(e.name))
	}
	b.WriteString("</svg>\n")
	return b.Bytes()
}

// niceStep returns a round step (1, 2 or 5 × 10^k) giving about n ticks up to max.
func niceStep(max float64, n int) float64 {
	if max <= 0 {
		return 1
	}
	raw := max / float64(n)
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if raw <= m*mag {
			return m * mag
		}
	}
	return 10 * mag
}

func trimFloat(v float64) string {
	s := fmt.Sprintf("%.2f", v)
	s = strings.TrimRight(s, "0")
	return strings.TrimSuffix(s, ".")
}

func esc(s string) string {
	var b strings.Builder
	xml.EscapeText(&b, []byte(s))
	return b.String()
}
