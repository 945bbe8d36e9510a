package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	vegeta "github.com/tsenart/vegeta/v12/lib"
)

// record is one request of a phase, as vegeta saw it.
type record struct {
	sent    time.Duration // since the phase started
	latency time.Duration // until the answer was read, or the request failed
	key     int32
	code    uint16 // HTTP status; 0: no answer (see err)
	wrong   bool   // a 200 whose body names another client: keys are mixed up
	err     string
}

// clientBase is the first client address: the clients are numbered from
// 198.18.0.0/15, the range set aside for benchmarks (RFC 2544). They only
// appear in X-Forwarded-For; no traffic goes to them.
var clientBase = netip.MustParseAddr("198.18.0.0")

// maxClients is the size of that range.
const maxClients = 1 << 17

// clientAddr returns client k of key set set (each set has keys clients):
// every phase uses a set of its own, so that it starts on full buckets.
func clientAddr(set, keys, k int) netip.Addr {
	b := clientBase.As4()
	n := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	n += uint32(set*keys + k)
	return netip.AddrFrom4([4]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)})
}

// load is what vegeta sends in one attack.
type load struct {
	lb      string // the load balancer's address
	rate    int    // requests/s
	d       time.Duration
	keys    int
	set     int // which clients (clientAddr)
	timeout time.Duration
	onStart func(t0 time.Time) // if not nil, called with the time records are relative to, as the attack starts
}

// attack sends GET / at l.rate for l.d, open loop (vegeta's constant pacer
// starts more workers when answers are slow), to the keys in turn, each
// request carrying its client's address in X-Forwarded-For. It returns every
// request's record.
func attack(ctx context.Context, l load) ([]record, error) {
	urls := make([]string, l.keys)
	headers := make([]http.Header, l.keys)
	bodies := make([][]byte, l.keys)
	for k := range l.keys {
		a := clientAddr(l.set, l.keys, k).String()
		urls[k] = "http://" + l.lb + "/?k=" + strconv.Itoa(k)
		headers[k] = http.Header{"X-Forwarded-For": {a}}
		bodies[k] = []byte("hello, " + a + "\n")
	}
	var next atomic.Uint64
	targeter := func(t *vegeta.Target) error {
		k := (next.Add(1) - 1) % uint64(l.keys)
		t.Method, t.URL, t.Header = http.MethodGet, urls[k], headers[k]
		return nil
	}
	atk := vegeta.NewAttacker(
		vegeta.Timeout(l.timeout),
		vegeta.KeepAlive(true),
		vegeta.Workers(64),
		vegeta.MaxBody(256),
		vegeta.Redirects(vegeta.NoFollow),
	)
	stop := context.AfterFunc(ctx, func() { atk.Stop() })
	defer stop()

	recs := make([]record, 0, int(float64(l.rate)*l.d.Seconds())+16)
	start := time.Now()
	if l.onStart != nil {
		l.onStart(start)
	}
	for res := range atk.Attack(targeter, vegeta.ConstantPacer{Freq: l.rate, Per: time.Second}, l.d, "fleet") {
		r := record{sent: res.Timestamp.Sub(start), latency: res.Latency, code: res.Code}
		k, err := strconv.Atoi(res.URL[strings.LastIndexByte(res.URL, '=')+1:])
		if err != nil || k < 0 || k >= l.keys {
			return nil, fmt.Errorf("vegeta result for an unknown target %q", res.URL)
		}
		r.key = int32(k)
		if r.code == 0 {
			r.err = res.Error
		}
		if r.code == http.StatusOK && !bytes.Equal(res.Body, bodies[k]) {
			r.wrong = true
		}
		recs = append(recs, r)
	}
	return recs, ctx.Err()
}
