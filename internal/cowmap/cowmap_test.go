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
