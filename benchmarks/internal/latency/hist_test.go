package latency

import (
	"testing"
	"time"
)

func TestIndexMonotonicAndBounded(t *testing.T) {
	prev := -1
	for _, v := range []uint64{0, 1, 63, 64, 65, 127, 128, 1000, 1 << 20, 1<<40 + 12345, 1<<63 - 1, 1<<64 - 1} {
		i := index(v)
		if i < prev || i >= buckets {
			t.Fatalf("index(%d) = %d after %d (buckets %d)", v, i, prev, buckets)
		}
		lo, w := lower(i)
		if v < lo || v-lo >= w {
			t.Fatalf("value %d outside its bucket [%d, %d+%d)", v, lo, lo, w)
		}
		prev = i
	}
}

func TestQuantile(t *testing.T) {
	var h, g Hist
	for i := 1; i <= 1000; i++ {
		h.Record(time.Duration(i) * time.Microsecond)
	}
	g.Merge(&h)
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {0.999, 999 * time.Microsecond}} {
		got := g.Quantile(c.q)
		// within a bucket the values are spread evenly, as here: the
		// quantile is exact to a microsecond, not to a bucket's 3%
		if d := got - c.want; d < -time.Microsecond || d > time.Microsecond {
			t.Errorf("Quantile(%v) = %v, want %v ± 1µs", c.q, got, c.want)
		}
	}
	if g.Count() != 1000 {
		t.Errorf("Count = %d", g.Count())
	}
}
