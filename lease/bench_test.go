package lease

import (
	"math"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/leaselimit/leaselimit/policy"
)

func BenchmarkTake(b *testing.B) {
	z := makeSizer(policy.PerSecond(1000), policy.Lease{})
	e := &entry{key: "hot"}
	const now = 1 * s
	z.Install(e, request{Want: 1, Min: 1}, Outcome{Granted: math.MaxInt64 / 2}, now)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if ok, _ := e.Take(1, now); !ok {
				b.Error("Take failed")
				return
			}
		}
	})
}

func BenchmarkTableGet(b *testing.B) {
	// Shards are bounded separately; leave room so no key is evicted.
	tab := newTable(20000)
	keys := make([]string, 10000)
	for i := range keys {
		keys[i] = "user-" + strconv.Itoa(i)
		tab.GetOrCreate(nil, keys[i], 1*s)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			if tab.Get(nil, keys[i%len(keys)]) == nil {
				b.Error("missing key")
				return
			}
			i++
		}
	})
}

// BenchmarkTableGetLongTail looks up keys of a table of 200,000 in a
// random order, as the comparison harness's cold long tail does, and
// reads each one's lease, as Decide does: each lookup misses the CPU's
// caches.
func BenchmarkTableGetLongTail(b *testing.B) {
	const n = 200_000
	tab := newTable(2 * n)
	ls := &Leases{salt: 0x9E3779B97F4A7C15}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "tail:k" + strconv.Itoa(i)
		tab.GetOrCreate(ls, keys[i], 1*s)
	}
	order := rand.New(rand.NewPCG(1, 2)).Perm(n)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			e := tab.Get(ls, keys[order[i%n]])
			if e == nil {
				b.Error("missing key")
				return
			}
			if ok, _ := e.Take(1, 1*s); ok {
				b.Error("Take from an entry that holds no lease")
				return
			}
			i++
		}
	})
}

func BenchmarkTableGetTake(b *testing.B) {
	z := makeSizer(policy.PerSecond(1000), policy.Lease{})
	tab := newTable(1000)
	e, _ := tab.GetOrCreate(nil, "hot", 1*s)
	z.Install(e, request{Want: 1, Min: 1}, Outcome{Granted: math.MaxInt64 / 2}, 1*s)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if ok, _ := tab.Get(nil, "hot").Take(1, 1*s); !ok {
				b.Error("Take failed")
				return
			}
		}
	})
}
