package redistest

import (
	"bufio"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestReadReply(t *testing.T) {
	in := "+OK\r\n" +
		"-ERR wrong\r\n" +
		":-7\r\n" +
		"$5\r\nhe\r\no\r\n" +
		"$-1\r\n" +
		"*3\r\n$1\r\na\r\n:1\r\n*-1\r\n" +
		"*0\r\n"
	rc := &respConn{r: bufio.NewReader(strings.NewReader(in))}
	want := []any{"OK", respError("ERR wrong"), int64(-7), "he\r\no", nil, []any{"a", int64(1), nil}, []any{}}
	for i, w := range want {
		got, err := rc.readReply()
		if err != nil {
			t.Fatalf("reply %d: %v", i, err)
		}
		if !reflect.DeepEqual(got, w) {
			t.Errorf("reply %d = %#v, want %#v", i, got, w)
		}
	}
	for _, bad := range []string{"?x\r\n", ":x\r\n", "$2\r\nabc\r\n", "+OK\n"} {
		rc := &respConn{r: bufio.NewReader(strings.NewReader(bad))}
		if _, err := rc.readReply(); !errors.Is(err, errProtocol) {
			t.Errorf("readReply(%q) error = %v, want errProtocol", bad, err)
		}
	}
}

func TestArgString(t *testing.T) {
	for _, c := range []struct {
		in   any
		want string
	}{
		{"s", "s"}, {[]byte("b"), "b"}, {nil, ""}, {true, "1"}, {false, "0"},
		{42, "42"}, {int64(-3), "-3"}, {1.5, "1.5"}, {time.Second, "1000000000"},
	} {
		if got := argString(c.in); got != c.want {
			t.Errorf("argString(%#v) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestParseStatsAndSub(t *testing.T) {
	info := "# Stats\r\ntotal_connections_received:5\r\ntotal_commands_processed:20\r\n\r\n" +
		"# Commandstats\r\n" +
		"cmdstat_set:calls=10,usec=50,usec_per_call=5.00,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_info:calls=3,usec=9,usec_per_call=3.00,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_script|flush:calls=1,usec=9,usec_per_call=9.00,rejected_calls=0,failed_calls=0\r\n"
	st, err := parseStats(info)
	if err != nil {
		t.Fatal(err)
	}
	want := Stats{TotalCommands: 20, Calls: map[string]int64{"set": 10, "info": 3, "script|flush": 1},
		Usec: map[string]int64{"set": 50, "info": 9, "script|flush": 9}}
	if !reflect.DeepEqual(st, want) {
		t.Fatalf("parseStats = %+v, want %+v", st, want)
	}
	if _, err := parseStats("# Stats\r\n"); err == nil {
		t.Error("parseStats without total_commands_processed succeeded")
	}

	// Snapshots 2 and 5: calls 2, 3 and 4 sent one INFO each.
	earlier := Stats{TotalCommands: 10, Calls: map[string]int64{"set": 4, "info": 1, "get": 2},
		Usec: map[string]int64{"set": 20, "info": 3, "get": 9}, seq: 2}
	later := Stats{TotalCommands: 20, Calls: map[string]int64{"set": 7, "info": 5, "get": 2},
		Usec: map[string]int64{"set": 35, "info": 15, "get": 9}, seq: 5}
	d := later.Sub(earlier)
	wantD := Stats{TotalCommands: 7, Calls: map[string]int64{"set": 3, "info": 1}, Usec: map[string]int64{"set": 15, "info": 12}}
	if !reflect.DeepEqual(d, wantD) {
		t.Errorf("Sub = %+v, want %+v", d, wantD)
	}
}

func TestFrames(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int64
	}{
		{"", 0},
		{"+OK\r\n", 1},
		{"-ERR x\r\n:1\r\n", 2},
		{"$5\r\nhe\r\no\r\n$-1\r\n$0\r\n\r\n", 3},
		{"*3\r\n$4\r\nINCR\r\n$1\r\nk\r\n:7\r\n", 1},
		{"*2\r\n*1\r\n+a\r\n*0\r\n*-1\r\n", 2},
		{"%2\r\n+a\r\n:1\r\n+b\r\n*1\r\n_\r\n", 1},                       // RESP3 map
		{"~2\r\n,1.5\r\n#t\r\n(12\r\n=7\r\ntxt:abc\r\n!3\r\nerr\r\n", 4}, // set, double, bool, big number, verbatim, bulk error
		{">2\r\n+message\r\n+x\r\n", 1},
		{"PING\r\nECHO a\r\n", 2}, // inline commands
		{"*1\r\n$4\r\nPI", 0},     // incomplete
	} {
		// Whole, and split at every position: the count must not depend
		// on how the stream arrives.
		for cut := 0; cut <= len(c.in); cut++ {
			var f frames
			got := f.feed([]byte(c.in[:cut])) + f.feed([]byte(c.in[cut:]))
			if got != c.want || f.broken {
				t.Errorf("frames in %q split at %d = %d (broken %v), want %d", c.in, cut, got, f.broken, c.want)
			}
		}
		var f frames
		var got int64
		for i := range len(c.in) {
			got += f.feed([]byte{c.in[i]})
		}
		if got != c.want {
			t.Errorf("frames in %q byte by byte = %d, want %d", c.in, got, c.want)
		}
	}
	for _, bad := range []string{"+OK\n", "$x\r\n", "*-2\r\n", "|1\r\n+a\r\n+b\r\n", "*1\r\nPING\r\n"} {
		var f frames
		f.feed([]byte(bad))
		if !f.broken {
			t.Errorf("frames(%q) not broken", bad)
		}
	}
}
