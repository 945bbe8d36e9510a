package cowmap

import (
	"sync"
	"testing"
)

func TestLoadOrMake(t *testing.T) {
	var m Map[string, int]
	if _, ok := m.Load("a"); ok {
		t.Fatal("Load on an empty Map found a value")
	}
	calls := 0
	mk := func(v int) func() int { return func() int { calls++; return v } }
	if got := m.LoadOrMake("a", mk(1)); got != 1 {
		t.Fatalf("LoadOrMake(a) = %d", got)
	}
	if got := m.LoadOrMake("a", mk(2)); got != 1 || calls != 1 {
		t.Fatalf("second LoadOrMake(a) = %d after %d makes; want 1 after 1", got, calls)
	}
	m.LoadOrMake("b", mk(3))
	if v, ok := m.Load("a"); !ok || v != 1 {
		t.Errorf("Load(a) after adding b = %d, %v", v, ok)
	}
}

// TestConcurrent: concurrent LoadOrMake of one key make it once.
func TestConcurrent(t *testing.T) {
	var m Map[int, *int]
	var wg sync.WaitGroup
	got := make([]*int, 16)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := 0; k < 100; k++ {
				v := m.LoadOrMake(k, func() *int { x := k; return &x })
				if k == 7 {
					got[i] = v
				}
			}
		}()
	}
	wg.Wait()
	for _, v := range got {
		if v != got[0] {
			t.Fatal("two values made for one key")
		}
	}
}

func BenchmarkLoad(b *testing.B) {
	var m Map[struct {
		name string
		n    int64
	}, int]
	k := struct {
		name string
		n    int64
	}{"pro", 100}
	m.LoadOrMake(k, func() int { return 1 })
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if _, ok := m.Load(k); !ok {
			b.Fatal("missing")
		}
	}
}

// TestManyAdditions: n keys added one after another, each looked up a few
// times as a request would, cost O(n) copies in all, and every key is
// found with no lock once the map settles. Regression: each addition
// copied the whole map (30,000 keys took 27 s).
func TestManyAdditions(t *testing.T) {
	const n = 30_000
	var m Map[int, int]
	for k := range n {
		if got := m.LoadOrMake(k, func() int { return -k }); got != -k {
			t.Fatalf("LoadOrMake(%d) = %d", k, got)
		}
		for range 3 {
			if v, ok := m.Load(k); !ok || v != -k {
				t.Fatalf("Load(%d) = %d, %v just after it was made", k, v, ok)
			}
		}
	}
	t.Logf("%d additions copied %d entries", n, m.copied)
	if m.copied > 6*n {
		t.Errorf("%d additions copied %d entries; want O(n), at most %d", n, m.copied, 6*n)
	}
	for k := range n {
		if v, ok := m.Load(k); !ok || v != -k {
			t.Fatalf("Load(%d) = %d, %v after all additions", k, v, ok)
		}
	}
	// A key looked up on every request settles: within as many lookups as
	// the map has keys, it is found with no lock.
	for i := 0; m.read.Load().amended; i++ {
		if i > n {
			t.Fatalf("%d lookups of the newest key and the map still takes the lock for it", i)
		}
		m.Load(n - 1)
	}
	if r := m.read.Load(); len(r.m) != n {
		t.Errorf("settled read map of %d keys; want %d", len(r.m), n)
	}
	if a := testing.AllocsPerRun(100, func() { m.Load(n / 2) }); a != 0 {
		t.Errorf("Load allocates %.1f times; want 0", a)
	}
}

// TestConcurrentAdditions: goroutines adding keys and looking up their own
// and each other's never lose one nor make one twice (run with -race).
func TestConcurrentAdditions(t *testing.T) {
	var m Map[int, *int]
	var wg sync.WaitGroup
	const per = 2000
	made := make([][]*int, 4)
	for g := range made {
		made[g] = make([]*int, per*len(made))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range per * len(made) {
				k := (i*7 + g*per) % (per * len(made))
				made[g][k] = m.LoadOrMake(k, func() *int { x := k; return &x })
				if v, ok := m.Load(k); !ok || v != made[g][k] {
					t.Errorf("Load(%d) right after LoadOrMake: %v, %v", k, v, ok)
					return
				}
			}
		}()
	}
	wg.Wait()
	for k := range per * len(made) {
		for g := range made {
			if made[g][k] != made[0][k] || *made[g][k] != k {
				t.Fatalf("key %d: two values made, or a wrong one", k)
			}
		}
	}
}
