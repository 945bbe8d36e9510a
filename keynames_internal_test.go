package leaselimit

import (
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"

	"github.com/leaselimit/leaselimit/authority"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// testNamer returns the namer of a limit, on a client never dialled.
func testNamer(t *testing.T, name string) authority.Namer {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = c.Close() })
	auth, err := authority.New(c, "names-test")
	if err != nil {
		t.Fatal(err)
	}
	return auth.Namer(policy.PerSecond(100).WithName(name))
}

// TestKeyNamesNameEveryKey: whatever key a processor named last, each
// call gets its own key's name, with callers on every processor mixing a
// hot key, keys of its length that differ in a byte, and a long tail.
func TestKeyNamesNameEveryKey(t *testing.T) {
	namer := testNamer(t, "names")
	k := newKeyNames(namer)
	keys := []string{"hot-key", "hot-kez", "hot-ke", "hot-key-", "Hot-key"}
	for i := range 200 {
		keys = append(keys, "tail-"+strconv.Itoa(i))
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			for range 5000 {
				key := keys[0]
				if rng.IntN(2) == 0 {
					key = keys[rng.IntN(len(keys))]
				}
				if got, want := k.Key(key), namer.Key(key); got != want {
					t.Errorf("Key(%q) = %q; want %q", key, got, want)
					return
				}
			}
		})
	}
	wg.Wait()
	// Two limits' names of one key differ: each limit has its own.
	other := newKeyNames(testNamer(t, "other"))
	if k.Key("hot-key") == other.Key("hot-key") {
		t.Error("two limits name one key alike")
	}
}

// TestKeyNamesHotKeyAllocatesNothing: a key named again on its processor
// costs no allocation (the name is built once); a new one costs the
// name's.
func TestKeyNamesHotKeyAllocatesNothing(t *testing.T) {
	if raceDetector {
		t.Skip("the race detector drops sync.Pool's items at random")
	}
	k := newKeyNames(testNamer(t, "names-allocs"))
	if a := testing.AllocsPerRun(1000, func() { _ = k.Key("hot") }); a > 0.1 {
		t.Errorf("a hot key's name allocates %.2f times per call; want none", a)
	}
	i := 0
	if a := testing.AllocsPerRun(1000, func() { i++; _ = k.Key("cold-" + strconv.Itoa(i%2)) }); a > 3.1 {
		t.Errorf("a new key's name allocates %.2f times per call; want at most its name's and the test's", a)
	}
}
