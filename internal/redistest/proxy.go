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

// relistenFor bounds how long Refuse(false) retries listening on the
// proxy's address again.
const relistenFor = 5 * time.Second

// Proxy is a TCP proxy that forwards connections to a target address and can
// inject faults: latency, a blackhole, abrupt disconnection, refused
// connections and replies dropped after the target applied the request.
// Create one with NewProxy; its methods are safe for concurrent use.
//
// The proxy follows the RESP protocol on each connection (commands one way,
// replies the other), so that Refuse can close a connection between
// requests and DropReplies after the target has answered. A stream that is
// not RESP is still forwarded; those two faults then cut it at once.
type Proxy struct {
	// Addr is the address clients connect to, "127.0.0.1:<port>".
	Addr string

	tb     testing.TB // reports a failure to listen again after Refuse
	target string
	ctx    context.Context // cancelled by Close, aborts dials to target
	cancel context.CancelFunc

	latency   atomic.Int64                        // time.Duration added before forwarding a chunk
	blackhole atomic.Bool                         // drop everything read while set
	drop      atomic.Pointer[func(c []byte) bool] // DropReplies' match; nil: off
	drops     atomic.Int64                        // connections DropReplies matched
	hold      atomic.Pointer[holding]             // HoldReplies' match and release; nil: off

	mu       sync.Mutex
	ln       net.Listener // nil while refusing (and after Close)
	refusing bool
	conns    map[*proxyConn]struct{} // live connections
	closed   bool

	wg        sync.WaitGroup // every goroutine started by the proxy
	closeOnce sync.Once
}

// proxyConn is one proxied connection: the accepted client side and the
// dialed server side, and where each direction stands in its protocol.
type proxyConn struct {
	client net.Conn
	done   chan struct{} // closed by close

	// Each framer is fed by the one pump of its direction only.
	reqFrames, repFrames frames

	mu     sync.Mutex
	server net.Conn // nil until dialed
	closed bool
	// sent counts the complete requests forwarded to the server, answered
	// the complete replies read from it (forwarded or dropped); writing is
	// set while a chunk of requests is being written. A connection with
	// answered >= sent and nothing being written has no request in flight.
	sent, answered int64
	writing        bool
	unframed       bool            // a direction is not RESP (or lost data): nothing is known
	retiring       bool            // Refuse: forward no more requests, close once answered
	dropping       bool            // DropReplies matched: drop the replies, cut once answered
	held           <-chan struct{} // HoldReplies matched: forward replies once it is closed
}

// holding is one HoldReplies: its match, and the channel ReleaseReplies
// closes.
type holding struct {
	match   func(c []byte) bool
	release chan struct{}
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
	pc.closeLocked(false)
}

// closeLocked closes both sides: the client's with a FIN if graceful (so
// that a client reading a reply sees the end of the stream, which go-redis
// retries, rather than a reset, which it does not), else with a reset.
// pc.mu must be held.
func (pc *proxyConn) closeLocked(graceful bool) {
	if pc.closed {
		return
	}
	pc.closed = true
	close(pc.done)
	if graceful {
		_ = pc.client.Close()
	} else {
		abort(pc.client)
	}
	if pc.server != nil {
		abort(pc.server)
	}
}

// idle reports whether pc has no request in flight. pc.mu must be held.
func (pc *proxyConn) idle() bool {
	return !pc.writing && pc.answered >= pc.sent
}

// retire stops pc forwarding requests and closes it as soon as it has no
// request in flight: at once if it has none (or nothing is known of its
// protocol), else once the server has answered and the replies are
// forwarded.
func (pc *proxyConn) retire() {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	pc.retiring = true
	if pc.unframed || pc.idle() {
		pc.closeLocked(true)
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
		tb:     tb,
		target: target,
		ln:     ln,
		ctx:    ctx,
		cancel: cancel,
		conns:  make(map[*proxyConn]struct{}),
	}
	p.wg.Add(1)
	go p.acceptLoop(ln)
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

// Refuse turns refusal on or off. While it is on, nothing listens on Addr,
// so new connections are refused (ECONNREFUSED, as from a server that is
// down), and the established ones are closed between requests: a
// connection with no request in flight is closed at once, one waiting for
// a reply is closed as soon as that reply has been forwarded, and a request
// a client sends on it meanwhile is dropped. So every request either
// reached the target and got its reply, or never reached the target: no
// outcome is left unknown. (A connection whose stream is not RESP is
// closed at once. The proxy forwards what it reads as it reads it, so a
// pipeline that reaches it in several reads can be cut between two of its
// commands: each command is still answered or never sent, but a client may
// report the whole pipeline as failed.) The client side sees the end of
// the stream (a FIN).
//
// Refuse(false) listens on Addr again; the port stays the proxy's, and if
// another process took it meanwhile the test fails.
func (p *Proxy) Refuse(on bool) {
	p.mu.Lock()
	if p.closed || p.refusing == on {
		p.mu.Unlock()
		return
	}
	p.refusing = on
	if on {
		ln := p.ln
		p.ln = nil
		conns := make([]*proxyConn, 0, len(p.conns))
		for pc := range p.conns {
			conns = append(conns, pc)
		}
		p.mu.Unlock()
		if ln != nil {
			_ = ln.Close()
		}
		for _, pc := range conns {
			pc.retire()
		}
		return
	}
	p.mu.Unlock()
	ln, err := p.listenAgain()
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed || p.refusing: // closed, or refusing again, meanwhile
		if ln != nil {
			_ = ln.Close()
		}
	case err != nil:
		p.tb.Errorf("redistest: proxy: listen on %s again: %v", p.Addr, err)
	default:
		p.ln = ln
		p.wg.Add(1) // under p.mu, before Close can start waiting
		go p.acceptLoop(ln)
	}
}

// listenAgain listens on p.Addr, retrying for a while: a connection the
// proxy just closed can hold the port briefly.
func (p *Proxy) listenAgain() (net.Listener, error) {
	deadline := time.Now().Add(relistenFor)
	for {
		ln, err := net.Listen("tcp", p.Addr)
		if err == nil || time.Now().After(deadline) {
			return ln, err
		}
		select {
		case <-p.ctx.Done():
			return nil, p.ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// DropReplies makes the proxy throw away the target's replies to the
// requests match selects, after the target has applied them, and then cut
// the connection, so that the client never learns the outcome of a call
// that took effect. match is called with each chunk of request bytes the
// proxy reads from a client (a command, a pipeline or part of one); it
// must be safe for concurrent use. Once a connection has forwarded a chunk
// match accepted, the proxy forwards no reply on it: it reads and drops
// the replies to every request forwarded so far, then closes the
// connection, the client side with a FIN (go-redis takes the end of the
// stream for a retryable error and sends the command again on a new
// connection, where it is matched again while dropping is on). A
// connection whose stream is not RESP is cut at its first reply. AnyRequest
// matches every request; nil turns dropping off (connections already
// matched are still cut).
func (p *Proxy) DropReplies(match func(chunk []byte) bool) {
	if match == nil {
		p.drop.Store(nil)
		return
	}
	p.drop.Store(&match)
}

// HoldReplies holds back the replies of the first connection on which a
// request chunk that match accepts is forwarded: the target runs the
// request (and every later one on that connection), and the proxy keeps
// their replies until ReleaseReplies, then forwards them in order. It
// models a reply that arrives late though Redis applied the call long
// before. One connection is held per HoldReplies.
func (p *Proxy) HoldReplies(match func(chunk []byte) bool) {
	p.hold.Store(&holding{match: match, release: make(chan struct{})})
}

// ReleaseReplies forwards the replies HoldReplies held, and turns holding
// off.
func (p *Proxy) ReleaseReplies() {
	if h := p.hold.Swap(nil); h != nil {
		close(h.release)
	}
}

// AnyRequest matches every request, for DropReplies.
func AnyRequest([]byte) bool { return true }

// DroppedReplies returns how many connections DropReplies has matched: no
// reply is forwarded on them from then on, and they are cut once the
// target has answered (or sooner, if the client closes them).
func (p *Proxy) DroppedReplies() int64 { return p.drops.Load() }

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
		ln := p.ln
		p.ln = nil
		p.mu.Unlock()
		if ln != nil {
			_ = ln.Close()
		}
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

// acceptLoop serves the connections ln accepts until ln is closed (by
// Refuse or Close).
func (p *Proxy) acceptLoop(ln net.Listener) {
	defer p.wg.Done()
	for {
		c, err := ln.Accept()
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
		if p.closed || p.ln != ln {
			// Closed, or refusing: accepted just before the listener was.
			p.mu.Unlock()
			abort(c)
			continue
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
		p.pumpReplies(pc, server)
	}()
	p.pumpRequests(pc, server)
}

// forget removes pc from the live connections.
func (p *Proxy) forget(pc *proxyConn) {
	p.mu.Lock()
	delete(p.conns, pc)
	p.mu.Unlock()
}

// pumpRequests copies requests from pc's client to server, applying the
// latency, the blackhole, Refuse and DropReplies, until reading or writing
// fails (which is how closing pc stops it).
func (p *Proxy) pumpRequests(pc *proxyConn, server net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := pc.client.Read(buf)
		if n > 0 && !p.forwardRequests(pc, server, buf[:n]) {
			return
		}
		if err != nil {
			return
		}
	}
}

// forwardRequests forwards one chunk of requests, unless the blackhole
// drops it or pc is retiring, and reports whether pc is still open.
func (p *Proxy) forwardRequests(pc *proxyConn, server net.Conn, chunk []byte) bool {
	if !p.forwardable(pc) {
		pc.mu.Lock()
		pc.unframed = true // data lost: the stream's framing is gone
		pc.mu.Unlock()
		return true
	}
	// Matched before the write, so that no reply to it can slip through.
	matched := false
	if m := p.drop.Load(); m != nil {
		matched = (*m)(chunk)
	}
	var held <-chan struct{}
	if h := p.hold.Load(); h != nil && h.match(chunk) && p.hold.CompareAndSwap(h, &holding{match: func([]byte) bool { return false }, release: h.release}) {
		held = h.release // this connection's, the first matched
	}
	pc.mu.Lock()
	if pc.retiring || pc.closed {
		// Refused: this request never reaches the target.
		if pc.unframed || pc.idle() {
			pc.closeLocked(true)
		}
		open := !pc.closed
		pc.mu.Unlock()
		return open
	}
	pc.writing = true
	if held != nil {
		pc.held = held
	}
	if matched && !pc.dropping {
		pc.dropping = true
		p.drops.Add(1)
	}
	pc.mu.Unlock()

	_, werr := server.Write(chunk)
	n := pc.reqFrames.feed(chunk)

	pc.mu.Lock()
	defer pc.mu.Unlock()
	pc.writing = false
	pc.sent += n
	pc.unframed = pc.unframed || pc.reqFrames.broken
	if pc.retiring && (pc.unframed || pc.idle()) || pc.dropping && pc.idle() {
		// Answered already (the replies were read while this chunk was
		// being written).
		pc.closeLocked(true)
	}
	return werr == nil && !pc.closed
}

// pumpReplies copies replies from server to pc's client, applying the
// latency, the blackhole, Refuse and DropReplies, until reading or writing
// fails.
func (p *Proxy) pumpReplies(pc *proxyConn, server net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := server.Read(buf)
		if n > 0 && !p.forwardReplies(pc, buf[:n]) {
			return
		}
		if err != nil {
			return
		}
	}
}

// forwardReplies forwards one chunk of replies, unless the blackhole drops
// it or DropReplies does, and reports whether pc is still open.
func (p *Proxy) forwardReplies(pc *proxyConn, chunk []byte) bool {
	if !p.forwardable(pc) {
		pc.mu.Lock()
		pc.unframed = true
		pc.mu.Unlock()
		return true
	}
	n := pc.repFrames.feed(chunk)
	pc.mu.Lock()
	pc.unframed = pc.unframed || pc.repFrames.broken
	if pc.dropping {
		// Not forwarded: the target applied these requests, the client
		// will never know.
		pc.answered += n
		if pc.unframed || pc.idle() {
			pc.closeLocked(true)
		}
		open := !pc.closed
		pc.mu.Unlock()
		return open
	}
	held := pc.held
	pc.mu.Unlock()

	if held != nil {
		select {
		case <-held:
		case <-pc.done:
			return false
		case <-p.ctx.Done():
			return false
		}
	}
	_, werr := pc.client.Write(chunk)

	pc.mu.Lock()
	defer pc.mu.Unlock()
	pc.answered += n
	if pc.retiring && (pc.unframed || pc.idle()) {
		pc.closeLocked(true)
	}
	return werr == nil && !pc.closed
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
