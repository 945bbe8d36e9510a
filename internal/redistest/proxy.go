package redistest

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// proxyDialTimeout bounds the proxy's connection attempts to its target.
const proxyDialTimeout = 5 * time.Second

// Proxy is a TCP proxy that forwards connections to a target address and can
// inject faults: latency, a blackhole, and abrupt disconnection. Create one
// with NewProxy; its methods are safe for concurrent use.
type Proxy struct {
	// Addr is the address clients connect to, "127.0.0.1:<port>".
	Addr string

	target string
	ln     net.Listener
	ctx    context.Context // cancelled by Close, aborts dials to target
	cancel context.CancelFunc

	latency   atomic.Int64 // time.Duration added before forwarding a chunk
	blackhole atomic.Bool  // drop everything read while set

	mu     sync.Mutex
	conns  map[*proxyConn]struct{} // live connections
	closed bool

	wg        sync.WaitGroup // every goroutine started by the proxy
	closeOnce sync.Once
}

// proxyConn is one proxied connection: the accepted client side and the
// dialed server side.
type proxyConn struct {
	client net.Conn
	done   chan struct{} // closed by close

	mu     sync.Mutex
	server net.Conn // nil until dialed
	closed bool
}

// setServer records the dialed server side. It reports false (and closes
// server) if the connection was closed in the meantime.
func (pc *proxyConn) setServer(server net.Conn) bool {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.closed {
		abort(server)
		return false
	}
	pc.server = server
	return true
}

// close closes both sides abruptly; it is idempotent.
func (pc *proxyConn) close() {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.closed {
		return
	}
	pc.closed = true
	close(pc.done)
	abort(pc.client)
	if pc.server != nil {
		abort(pc.server)
	}
}

// abort closes c, with a TCP RST rather than a FIN when possible.
func abort(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

// NewProxy starts a proxy listening on 127.0.0.1 (on a free port) that
// forwards each accepted connection to target, over a new connection dialed
// when the client connects. If the dial fails, the client connection is
// closed. The proxy is closed by the test's cleanup.
func NewProxy(tb testing.TB, target string) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("redistest: proxy listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{
		Addr:   ln.Addr().String(),
		target: target,
		ln:     ln,
		ctx:    ctx,
		cancel: cancel,
		conns:  make(map[*proxyConn]struct{}),
	}
	p.wg.Add(1)
	go p.acceptLoop()
	tb.Cleanup(p.Close)
	return p
}

// SetLatency makes the proxy wait d before forwarding each chunk of data it
// reads, in both directions, so a request/response round trip takes at least
// 2*d longer. It applies to live connections too. Zero removes the latency.
func (p *Proxy) SetLatency(d time.Duration) {
	p.latency.Store(int64(max(d, 0)))
}

// Blackhole turns the blackhole on or off. While it is on, the proxy keeps
// existing connections open and accepts (and dials the target for) new ones,
// but forwards nothing in either direction: the data it reads is dropped.
// When it is turned off, forwarding resumes with data read from then on;
// what was dropped is lost, so connections that were mid-request are
// typically unusable and clients should discard them after their timeout.
func (p *Proxy) Blackhole(on bool) {
	p.blackhole.Store(on)
}

// CutAll abruptly closes (with a TCP reset where possible) all current
// connections, on both the client and the target side. The proxy keeps
// accepting new connections.
func (p *Proxy) CutAll() {
	for _, pc := range p.takeConns() {
		pc.close()
	}
}

// Close stops the listener, closes all connections and waits until every
// goroutine the proxy started has exited. It is idempotent, and is called by
// the cleanup registered by NewProxy.
func (p *Proxy) Close() {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		_ = p.ln.Close()
		p.cancel()
		p.CutAll()
		p.wg.Wait()
	})
}

// takeConns removes and returns all live connections.
func (p *Proxy) takeConns() []*proxyConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	conns := make([]*proxyConn, 0, len(p.conns))
	for pc := range p.conns {
		conns = append(conns, pc)
		delete(p.conns, pc)
	}
	return conns
}

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// A transient failure such as running out of file descriptors:
			// back off briefly instead of spinning, unless we are closing.
			select {
			case <-p.ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		pc := &proxyConn{client: c, done: make(chan struct{})}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			abort(c)
			return
		}
		p.conns[pc] = struct{}{}
		p.wg.Add(1) // acceptLoop holds a count, so this may run concurrently with Wait
		p.mu.Unlock()
		go p.serve(pc)
	}
}

// serve dials the target for pc and forwards data both ways until either
// side fails or pc is closed.
func (p *Proxy) serve(pc *proxyConn) {
	defer p.wg.Done()
	defer p.forget(pc)
	defer pc.close()

	d := net.Dialer{Timeout: proxyDialTimeout}
	server, err := d.DialContext(p.ctx, "tcp", p.target)
	if err != nil {
		return
	}
	if !pc.setServer(server) {
		return
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer pc.close()
		p.pump(pc, server, pc.client)
	}()
	p.pump(pc, pc.client, server)
}

// forget removes pc from the live connections.
func (p *Proxy) forget(pc *proxyConn) {
	p.mu.Lock()
	delete(p.conns, pc)
	p.mu.Unlock()
}

// pump copies from src to dst, applying the latency and the blackhole, until
// reading or writing fails (which is how closing pc stops it).
func (p *Proxy) pump(pc *proxyConn, src, dst net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && p.forwardable(pc) {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// forwardable waits out the current latency and reports whether a chunk just
// read should be forwarded: not if the blackhole is on (before or after the
// wait) or pc was closed during the wait.
func (p *Proxy) forwardable(pc *proxyConn) bool {
	if p.blackhole.Load() {
		return false
	}
	if d := time.Duration(p.latency.Load()); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-pc.done:
			return false
		}
	}
	return !p.blackhole.Load()
}
