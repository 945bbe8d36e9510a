package redistest

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"
)

// respConn is a minimal RESP2 client used for readiness probes, Stats and Do.
//
// It deliberately performs no connection handshake (no HELLO, no CLIENT
// SETINFO), so every command it sends is exactly one command as counted by
// Redis in INFO.
type respConn struct {
	conn net.Conn
	r    *bufio.Reader
}

// respError is an error reply sent by the server ("-ERR ...").
type respError string

// Error returns the server's error message.
func (e respError) Error() string { return string(e) }

// errProtocol reports a reply that is not valid RESP2.
var errProtocol = errors.New("redistest: malformed RESP reply")

// dialRESP connects to addr. The whole session (dial and all commands) must
// finish within timeout.
func dialRESP(addr string, timeout time.Duration) (*respConn, error) {
	deadline := time.Now().Add(timeout)
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", addr, err)
	}
	if err := c.SetDeadline(deadline); err != nil {
		c.Close()
		return nil, fmt.Errorf("set deadline on connection to %s: %w", addr, err)
	}
	return &respConn{conn: c, r: bufio.NewReader(c)}, nil
}

// Close closes the connection.
func (rc *respConn) Close() error { return rc.conn.Close() }

// do sends one command and reads its reply. An error reply from the server is
// returned as a respError. Reply values are string (simple and bulk strings),
// int64, nil (null bulk string or null array) and []any (arrays, whose
// elements may themselves be respError values).
func (rc *respConn) do(args ...any) (any, error) {
	var buf bytes.Buffer
	fmt.Fprintf(&buf, "*%d\r\n", len(args))
	for _, a := range args {
		s := argString(a)
		fmt.Fprintf(&buf, "$%d\r\n%s\r\n", len(s), s)
	}
	if _, err := rc.conn.Write(buf.Bytes()); err != nil {
		return nil, fmt.Errorf("write command: %w", err)
	}
	v, err := rc.readReply()
	if err != nil {
		return nil, fmt.Errorf("read reply: %w", err)
	}
	if e, ok := v.(respError); ok {
		return nil, e
	}
	return v, nil
}

// argString converts a command argument to its wire form, following the
// conventions of go-redis for the common types.
func argString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case nil:
		return ""
	case bool:
		if v {
			return "1"
		}
		return "0"
	case time.Duration:
		return strconv.FormatInt(int64(v), 10)
	default:
		return fmt.Sprint(v)
	}
}

// readReply reads one RESP2 value.
func (rc *respConn) readReply() (any, error) {
	line, err := rc.r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	if len(line) < 3 || line[len(line)-2] != '\r' {
		return nil, fmt.Errorf("%w: %q", errProtocol, line)
	}
	kind, body := line[0], line[1:len(line)-2]
	switch kind {
	case '+':
		return body, nil
	case '-':
		return respError(body), nil
	case ':':
		n, err := strconv.ParseInt(body, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%w: bad integer %q: %w", errProtocol, body, err)
		}
		return n, nil
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil || n < -1 {
			return nil, fmt.Errorf("%w: bad bulk length %q", errProtocol, body)
		}
		if n == -1 {
			return nil, nil
		}
		b := make([]byte, n+2)
		if _, err := io.ReadFull(rc.r, b); err != nil {
			return nil, err
		}
		if b[n] != '\r' || b[n+1] != '\n' {
			return nil, fmt.Errorf("%w: bulk string not terminated by CRLF", errProtocol)
		}
		return string(b[:n]), nil
	case '*':
		n, err := strconv.Atoi(body)
		if err != nil || n < -1 {
			return nil, fmt.Errorf("%w: bad array length %q", errProtocol, body)
		}
		if n == -1 {
			return nil, nil
		}
		arr := make([]any, n)
		for i := range arr {
			if arr[i], err = rc.readReply(); err != nil {
				return nil, err
			}
		}
		return arr, nil
	default:
		return nil, fmt.Errorf("%w: unexpected type byte %q", errProtocol, kind)
	}
}
