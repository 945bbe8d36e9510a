package main

import (
	"testing"
	"time"

	"github.com/leaselimit/leaselimit/policy"
)

func TestClientAddr(t *testing.T) {
	for _, c := range []struct {
		set, keys, k int
		want         string
	}{
		{0, 200, 0, "198.18.0.0"},
		{0, 200, 199, "198.18.0.199"},
		{1, 200, 56, "198.18.1.0"},
		{4, 10_000, 9_999, "198.18.195.79"}, // 49,999 = 195·256 + 79
		{0, maxClients, maxClients - 1, "198.19.255.255"},
	} {
		if got := clientAddr(c.set, c.keys, c.k).String(); got != c.want {
			t.Errorf("clientAddr(%d, %d, %d) = %s; want %s", c.set, c.keys, c.k, got, c.want)
		}
	}
}

func TestQuantiles(t *testing.T) {
	d := make([]time.Duration, 100)
	for i := range d {
		d[i] = time.Duration(100-i) * time.Millisecond // 100ms … 1ms, unsorted
	}
	p50, p90, p99, mx := quantiles(d)
	if p50 != 50*time.Millisecond || p90 != 90*time.Millisecond || p99 != 99*time.Millisecond || mx != 100*time.Millisecond {
		t.Errorf("quantiles(1..100ms) = %v, %v, %v, %v; want 50ms, 90ms, 99ms, 100ms", p50, p90, p99, mx)
	}
	if p50, _, _, mx := quantiles(nil); p50 != 0 || mx != 0 {
		t.Errorf("quantiles(nil) = %v … %v; want zeros", p50, mx)
	}
}

func TestSummarize(t *testing.T) {
	ms := time.Millisecond
	limit := policy.Limit{Name: "burst", Rate: 10, Period: time.Second, Burst: 5}
	ph := &phaseResult{
		keys: 2,
		// Redis could not answer from 1s to 2s.
		windows: []window{{from: time.Second, to: 2 * time.Second}},
		recs: []record{
			{sent: 0, latency: 2 * ms, key: 0, code: 200},
			{sent: 500 * ms, latency: 20 * ms, key: 1, code: 429},
			{sent: 1000 * ms, latency: 5 * ms, key: 0, code: 200},   // in the fault, fast
			{sent: 1500 * ms, latency: 400 * ms, key: 0, code: 200}, // in the fault, over 3 × 100ms
			{sent: 1900 * ms, latency: 1 * ms, key: 1, code: 0, err: "connection refused"},
			{sent: 2000 * ms, latency: 1 * ms, key: 1, code: 503}, // after the fault
			{sent: 2100 * ms, latency: 1 * ms, key: 1, code: 502},
		},
	}
	// T = 2.101s - 0: each key's bound is 5 + 10 × 2.101 = 26.01.
	for range 25 { // key 0 gets 28 admissions in all: over its bound
		ph.recs = append(ph.recs, record{sent: 100 * ms, latency: ms, key: 0, code: 200})
	}
	s := summarize(ph, limit, 100*ms)
	check := func(name string, got, want any) {
		t.Helper()
		if got != want {
			t.Errorf("%s = %v; want %v", name, got, want)
		}
	}
	check("requests", s.requests, 32)
	check("admitted", s.admitted, 28)
	check("429", s.tooMany, 1)
	check("503", s.unavailable, 1)
	check("other codes", s.otherCode, 1)
	check("no answer", s.failed, 1)
	check("span", s.span, 2101*ms)
	check("keys over", s.keysOver, 1)
	check("fault requests", s.faultRequests, 3)
	check("fault fast", s.faultFast, 1) // the failed one is no decision
	check("fault slow", s.faultSlow, 1)
	check("fault admitted", s.faultAdmitted, 2)
	check("calm requests", s.calmRequests, 29)
	if want := 5 + 10*2.101; s.keyBound < want-1e-9 || s.keyBound > want+1e-9 {
		t.Errorf("key bound = %v; want %v", s.keyBound, want)
	}
	if want := 28 / (5 + 10*2.101); s.maxKeyRatio < want-1e-9 || s.maxKeyRatio > want+1e-9 {
		t.Errorf("worst key ratio = %v; want %v", s.maxKeyRatio, want)
	}

	// A kill resets every bucket once: one more Burst a key.
	ph.resets = 1
	if s2 := summarize(ph, limit, 100*ms); s2.keyBound-s.keyBound != 5 {
		t.Errorf("bound after a reset grew by %v; want 5 (one Burst)", s2.keyBound-s.keyBound)
	}
}
