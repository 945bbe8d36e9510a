package redistest

import (
	"bytes"
	"strconv"
)

// Bounds beyond which a stream is taken for something other than RESP.
const (
	maxFrameHeader = 64 << 10  // bytes of one header line
	maxFrameDepth  = 64        // nesting of aggregates
	maxFrameBulk   = 512 << 20 // bytes of one bulk payload (Redis's own proto-max-bulk-len)
)

// frames counts the complete top-level RESP values (RESP2 or RESP3) in a
// byte stream that is fed to it in chunks of any size: the commands a
// client sends (inline commands too) or the replies a server sends. The
// proxy uses it to know whether a connection has a request in flight. A
// stream that is not RESP (an echo test's text, or one the blackhole broke
// off mid-value) makes it broken for good.
type frames struct {
	line   []byte  // a header line begun in an earlier chunk
	skip   int64   // bytes of a bulk payload, and its CRLF, still to pass
	open   []int64 // for each aggregate being read, the values it still needs
	broken bool
}

// feed reads b and returns how many top-level values it completed.
func (f *frames) feed(b []byte) (n int64) {
	for len(b) > 0 && !f.broken {
		if f.skip > 0 {
			k := min(f.skip, int64(len(b)))
			f.skip -= k
			b = b[k:]
			if f.skip == 0 {
				n += f.done()
			}
			continue
		}
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			f.line = append(f.line, b...)
			f.broken = len(f.line) > maxFrameHeader
			return n
		}
		line := b[:i+1]
		b = b[i+1:]
		if len(f.line) > 0 {
			f.line = append(f.line, line...)
			line = f.line
		}
		n += f.header(line)
		f.line = f.line[:0]
	}
	return n
}

// header reads one header line, CRLF included, and returns the top-level
// values it completed (0 or 1).
func (f *frames) header(line []byte) int64 {
	if len(line) < 3 || line[len(line)-2] != '\r' || len(line) > maxFrameHeader {
		f.broken = true
		return 0
	}
	body := string(line[1 : len(line)-2])
	switch line[0] {
	case '+', '-', ':', ',', '(', '#', '_':
		return f.done()
	case '$', '!', '=': // bulk string, bulk error, verbatim string
		n, ok := f.length(body)
		switch {
		case !ok:
			return 0
		case n < 0:
			return f.done() // the RESP2 null bulk string
		}
		f.skip = n + 2
		return 0
	case '*', '~', '>', '%': // array, set, push, map
		n, ok := f.length(body)
		switch {
		case !ok:
			return 0
		case n <= 0:
			return f.done() // empty, or the RESP2 null array
		case line[0] == '%':
			n *= 2
		}
		if len(f.open) == maxFrameDepth {
			f.broken = true
			return 0
		}
		f.open = append(f.open, n)
		return 0
	case '|':
		// An attribute precedes the value it describes and is not one
		// itself: not worth modelling for a test proxy.
		f.broken = true
		return 0
	}
	if len(f.open) > 0 {
		f.broken = true
		return 0
	}
	return 1 // an inline command ("PING\r\n")
}

// length parses the length of a bulk string or an aggregate: -1 (null) up
// to maxFrameBulk.
func (f *frames) length(s string) (int64, bool) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < -1 || n > maxFrameBulk {
		f.broken = true
		return 0, false
	}
	return n, true
}

// done records a complete value and returns 1 if it was a top-level one.
func (f *frames) done() int64 {
	for len(f.open) > 0 {
		top := len(f.open) - 1
		if f.open[top]--; f.open[top] > 0 {
			return 0
		}
		f.open = f.open[:top]
	}
	return 1
}
