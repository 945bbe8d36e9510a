package lease

import (
	"math"
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
