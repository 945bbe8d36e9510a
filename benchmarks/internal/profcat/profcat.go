// Package profcat sorts the samples of a CPU profile of the comparison
// harness into categories of work, by the functions on their stacks: where a
// design's client CPU goes per decision (hand-offs between goroutines, the
// Redis client, allocation, the key digest, leaselimit's layers...), the
// same way for every design and every run.
package profcat

import (
	"fmt"
	"regexp"
	"time"

	"github.com/google/pprof/profile"
)

// A Category is a kind of work, told by the functions on a sample's stack.
type Category struct {
	Name  string
	match *regexp.Regexp
}

// Categories: a sample goes to the category of the function nearest its
// leaf that one of them matches (the first that matches, in this order),
// else to Other: the work a frame does itself, or through functions that
// match none (the runtime's helpers, system calls). So an allocation made
// inside go-redis is allocation, the SHA-256 blocks of the key digest are
// the digest, a channel send in go-redis is a hand-off, and the load
// generator, on every stack, gets only its own work.
var Categories = []Category{
	{"GC", regexp.MustCompile(`^runtime\.(gcBgMarkWorker|gcAssistAlloc|gcDrain|gcStart|gcMarkDone|gcMarkTermination|markroot|scanobject|bgsweep|bgscavenge|sweepone)`)},
	{"allocation", regexp.MustCompile(`^runtime\.(mallocgc|newobject|makeslice|growslice|makemap|makechan|rawstring|rawbyteslice|concatstring|slicebytetostring|mapassign)`)},
	{"key digest", regexp.MustCompile(`\.Namer\.Key$|^crypto/`)},
	{"go-redis", regexp.MustCompile(`^github\.com/redis/go-redis/`)},
	{"hand-offs and waits", regexp.MustCompile(`^runtime\.(chansend|chanrecv|closechan|selectgo|gopark|goready|ready|schedule|findRunnable|futex|notewakeup|notesleep|wakep|startm|stopm|mcall|park_m|lock2|unlock2|netpoll|semacquire|semrelease)|^sync\.\(\*(Mutex|RWMutex|Cond|WaitGroup)\)\.|^sync\.runtime_|^internal/sync\.`)},
	{"contexts and timers", regexp.MustCompile(`^context\.|^time\.(AfterFunc|NewTimer|\(\*Timer\))|^runtime\.(modtimer|addtimer|deltimer|\(\*timer\)|\(\*timers\))`)},
	{"telemetry and breaker", regexp.MustCompile(`^go\.opentelemetry\.io/|^github\.com/leaselimit/leaselimit/(internal/recorder|telemetry|internal/circuit|breaker)\.|^github\.com/sony/gobreaker`)},
	{"leaselimit authority", regexp.MustCompile(`^github\.com/leaselimit/leaselimit/authority\.`)},
	{"leaselimit Redis path", regexp.MustCompile(`^github\.com/leaselimit/leaselimit/internal/redispath\.`)},
	{"leaselimit Limiter", regexp.MustCompile(`^github\.com/leaselimit/leaselimit(/lease|/internal/[a-z]+)?\.`)},
	{"design's own code", regexp.MustCompile(`^github\.com/go-redis/redis_rate/|^github\.com/leaselimit/leaselimit/benchmarks/internal/design\.`)},
	{"load generator", regexp.MustCompile(`^main\.`)},
}

// Other is the category of a sample no Category matches: the rest of the
// runtime, system calls made outside go-redis.
const Other = "other"

// Names returns the names of Categories, then Other.
func Names() []string {
	names := make([]string, 0, len(Categories)+1)
	for _, c := range Categories {
		names = append(names, c.Name)
	}
	return append(names, Other)
}

// Split returns the CPU time of p's samples in each category, by name.
func Split(p *profile.Profile) (map[string]time.Duration, error) {
	vi := -1
	for i, st := range p.SampleType {
		if st.Type == "cpu" && st.Unit == "nanoseconds" {
			vi = i
		}
	}
	if vi < 0 {
		return nil, fmt.Errorf("profcat: not a CPU profile (no cpu/nanoseconds sample type)")
	}
	out := make(map[string]time.Duration)
	for _, s := range p.Sample {
		out[categoryOf(s)] += time.Duration(s.Value[vi])
	}
	return out, nil
}

// categoryOf returns the category of the function nearest s's leaf that
// a category matches, inlined functions included (a location lists the
// innermost first).
func categoryOf(s *profile.Sample) string {
	for _, loc := range s.Location {
		for _, ln := range loc.Line {
			if ln.Function == nil {
				continue
			}
			for _, c := range Categories {
				if c.match.MatchString(ln.Function.Name) {
					return c.Name
				}
			}
		}
	}
	return Other
}
