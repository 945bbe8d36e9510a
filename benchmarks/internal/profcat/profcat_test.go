package profcat

import (
	"bytes"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/google/pprof/profile"
)

// stackProfile returns a CPU profile with one sample per stack (leaf
// first), each of the given CPU time.
func stackProfile(each time.Duration, stacks ...[]string) *profile.Profile {
	p := &profile.Profile{SampleType: []*profile.ValueType{{Type: "samples", Unit: "count"}, {Type: "cpu", Unit: "nanoseconds"}}}
	funcs := map[string]*profile.Function{}
	for _, stack := range stacks {
		s := &profile.Sample{Value: []int64{1, int64(each)}}
		for _, name := range stack {
			f := funcs[name]
			if f == nil {
				f = &profile.Function{ID: uint64(len(funcs) + 1), Name: name}
				funcs[name] = f
				p.Function = append(p.Function, f)
			}
			loc := &profile.Location{ID: uint64(len(p.Location) + 1), Line: []profile.Line{{Function: f}}}
			p.Location = append(p.Location, loc)
			s.Location = append(s.Location, loc)
		}
		p.Sample = append(p.Sample, s)
	}
	return p
}

func TestSplit(t *testing.T) {
	const ms = time.Millisecond
	p := stackProfile(ms,
		// The Limiter's own work, under the load generator.
		[]string{"github.com/leaselimit/leaselimit.(*Limiter).decide", "main.drive.func2"},
		// An allocation inside go-redis is allocation.
		[]string{"runtime.mallocgc", "github.com/redis/go-redis/v9.(*Client).Process", "main.drive.func2"},
		// go-redis's own work, a system call it makes included.
		[]string{"internal/runtime/syscall/linux.Syscall6", "syscall.write", "net.(*conn).Write", "github.com/redis/go-redis/v9/internal/pool.(*Conn).Write", "main.drive.func2"},
		// A channel send in go-redis is a hand-off.
		[]string{"runtime.chansend1", "github.com/redis/go-redis/v9/internal/pool.(*ConnPool).Put"},
		// The key digest, inside the Limiter.
		[]string{"crypto/internal/fips140/sha256.blockSHANI", "crypto/sha256.Sum256", "github.com/leaselimit/leaselimit/authority.Namer.Key", "github.com/leaselimit/leaselimit.(*Limiter).allowExact"},
		// A waiter's select in the Redis path is a wait.
		[]string{"runtime.selectgo", "github.com/leaselimit/leaselimit/internal/redispath.(*Caller).detached"},
		[]string{"github.com/leaselimit/leaselimit/internal/redispath.(*lane).take"},
		[]string{"github.com/leaselimit/leaselimit/authority.decodeBatch"},
		[]string{"github.com/leaselimit/leaselimit/internal/recorder.(*Recorder).RecordAuthority"},
		[]string{"runtime.gcBgMarkWorker"},
		[]string{"github.com/go-redis/redis_rate/v10.(*Limiter).AllowN"},
		[]string{"github.com/leaselimit/leaselimit/benchmarks/internal/design.(*leanContract).send"},
		[]string{"main.drive.func2", "sync.(*WaitGroup).Go.func1"},
		[]string{"runtime.nanotime"},
	)
	got, err := Split(p)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]time.Duration{
		"leaselimit Limiter": ms, "allocation": ms, "go-redis": ms, "key digest": ms,
		"hand-offs and waits": 2 * ms, "leaselimit Redis path": ms, "leaselimit authority": ms,
		"telemetry and breaker": ms, "GC": ms, "design's own code": 2 * ms, "load generator": ms, Other: ms,
	}
	for name, d := range want {
		if got[name] != d {
			t.Errorf("%s: %v, want %v", name, got[name], d)
		}
	}
	var sum time.Duration
	for name, d := range got {
		if _, ok := want[name]; !ok {
			t.Errorf("unexpected category %q: %v", name, d)
		}
		sum += d
	}
	if sum != 14*ms {
		t.Errorf("categories add up to %v, want every sample's 14ms", sum)
	}
}

// TestSplitRealProfile splits a profile this process takes of its own
// busy loop: the runtime's real profile format, every sample counted once.
func TestSplitRealProfile(t *testing.T) {
	var buf bytes.Buffer
	if err := pprof.StartCPUProfile(&buf); err != nil {
		t.Skipf("CPU profiling unavailable: %v", err)
	}
	deadline := time.Now().Add(300 * time.Millisecond)
	n := 0
	for time.Now().Before(deadline) {
		n++
	}
	pprof.StopCPUProfile()
	p, err := profile.Parse(&buf)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Split(p)
	if err != nil {
		t.Fatal(err)
	}
	var sum, total time.Duration
	for _, d := range got {
		sum += d
	}
	for _, s := range p.Sample {
		total += time.Duration(s.Value[1])
	}
	if sum != total || total == 0 {
		t.Errorf("categories add up to %v of the profile's %v (loop ran %d times)", sum, total, n)
	}
}

func TestSplitNotCPU(t *testing.T) {
	p := &profile.Profile{SampleType: []*profile.ValueType{{Type: "alloc_space", Unit: "bytes"}}}
	if _, err := Split(p); err == nil {
		t.Error("Split of a heap profile: no error")
	}
}
