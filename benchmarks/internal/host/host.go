// Package host describes the machine a benchmark ran on, for its report:
// numbers from a machine busy with other work are not comparable with
// others.
package host

import (
	"os"
	"strings"
)

// LoadAvg returns ", load average at the end X Y Z" from /proc/loadavg, or
// "" where there is none.
func LoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return ", load average at the end " + strings.Join(f[:3], " ")
}
