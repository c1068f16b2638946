package cgtest

import (
	"fmt"
	"os"
	"testing"
)

// Environment variables that put the test binary in helper mode.
const (
	// HelperEnv, set to "1", makes RunHelperIfChild run the child.
	HelperEnv = "FLUXVM_CGTEST_HELPER"
	// CgroupEnv names the cgroup directory the child joins.
	CgroupEnv = "FLUXVM_CGTEST_CGROUP"
	// netnsFD is the descriptor the network namespace is passed on.
	netnsFD = 3
)

// Operations a Request can ask for.
const (
	// OpTCP connects a TCP socket to Addr, sends Send, reads a reply
	// (Read bytes, or what one read returns) and reports local and peer
	// addresses. Keep leaves the connection open for OpSend.
	OpTCP = "tcp"
	// OpUDP sends Send with sendto on an unconnected UDP socket and reads
	// one reply with recvfrom, reporting its source (From). Keep leaves
	// the socket open; OpSend on it needs Addr again.
	OpUDP = "udp"
	// OpUDPConnected connects a UDP socket to Addr (reporting getpeername),
	// sends Send with send and reads one reply with recvfrom. Keep leaves
	// the socket open for OpSend.
	OpUDPConnected = "udp-connected"
	// OpSend exchanges Send on the kept socket Sock again: sendto Addr if
	// given, send otherwise; then one receive. Peer is read again.
	OpSend = "send"
	// OpGetpeername reports getpeername (and getsockname) of socket Sock.
	OpGetpeername = "getpeername"
	// OpClose closes the kept socket Sock.
	OpClose = "close"
	// OpInfo reports the child's pid, cgroup and network namespace.
	OpInfo = "info"
	// OpConnectLoop times Count TCP connections, one after the other,
	// taking the addresses of Addrs in turn: socket, blocking connect,
	// getpeername (as Go's dial does), close with SO_LINGER 0 (a reset,
	// so no TIME_WAIT fills the port space). ElapsedNS[i] sums the time
	// of the connections to Addrs[i]. A benchmark's tool: alternating
	// connection by connection, the ways compared share every drift of
	// the machine's speed.
	OpConnectLoop = "connect-loop"
)

// Request is one command to the child, one JSON object per line.
type Request struct {
	Op string `json:"op"`
	// Addr is the destination, "ip:port" or "[ip6]:port".
	Addr string `json:"addr,omitempty"`
	// Bind, if set, is bound before connecting or sending.
	Bind string `json:"bind,omitempty"`
	// Send is the payload; with an empty Send nothing is sent.
	Send string `json:"send,omitempty"`
	// Read, for TCP, is how many bytes to read (until EOF, error or
	// timeout); 0 reads once. A UDP receive always reads one datagram.
	Read int `json:"read,omitempty"`
	// NoRecv skips the receive.
	NoRecv bool `json:"norecv,omitempty"`
	// Keep keeps the socket open; Result.Sock names it for later requests.
	Keep bool `json:"keep,omitempty"`
	// Sock names a kept socket (OpSend, OpGetpeername, OpClose).
	Sock int `json:"sock,omitempty"`
	// TimeoutMS bounds connect, send and each receive (default 2000).
	TimeoutMS int `json:"timeout_ms,omitempty"`
	// Addrs are OpConnectLoop's destinations (1..16), taken in turn.
	Addrs []string `json:"addrs,omitempty"`
	// Count is how many connections OpConnectLoop makes (1..1,000,000).
	Count int `json:"count,omitempty"`
}

// Result is the child's answer to one Request.
type Result struct {
	// Sock is the id of a kept socket.
	Sock int `json:"sock,omitempty"`
	// Local is what getsockname returned after connect or send.
	Local string `json:"local,omitempty"`
	// Peer is what getpeername returned (connected sockets only).
	Peer string `json:"peer,omitempty"`
	// From is the source address recvfrom reported for the reply.
	From string `json:"from,omitempty"`
	// Data is the bytes received.
	Data string `json:"data,omitempty"`
	// Stage names the step that failed: "addr", "socket", "bind",
	// "connect", "send", "recv", "getpeername", "sock" (unknown id) or
	// "op" (unknown operation). Empty on success.
	Stage string `json:"stage,omitempty"`
	// Errno is the failing call's errno by name, e.g. "ECONNREFUSED",
	// "EPERM"; "EAGAIN" means the receive timed out.
	Errno string `json:"errno,omitempty"`
	// Err is the error text.
	Err string `json:"err,omitempty"`

	// Pid, Cgroup (the child's cgroup v2 path, as in /proc/self/cgroup)
	// and NetNS (the inode of its network namespace) answer OpInfo.
	Pid    int    `json:"pid,omitempty"`
	Cgroup string `json:"cgroup,omitempty"`
	NetNS  uint64 `json:"netns,omitempty"`

	// ElapsedNS sums OpConnectLoop's time per destination, in the order
	// of Request.Addrs.
	ElapsedNS []int64 `json:"elapsed_ns,omitempty"`
	// MedianNS is the median time of one OpConnectLoop connection per
	// destination, robust against the rare connection that waits for
	// the scheduler.
	MedianNS []int64 `json:"median_ns,omitempty"`
}

// Error returns nil for a successful Result, else an error naming the
// failed stage and errno.
func (r Result) Error() error {
	if r.Stage == "" && r.Err == "" {
		return nil
	}
	return fmt.Errorf("cgtest child: %s: %s (%s)", r.Stage, r.Err, r.Errno)
}

var helperRouted bool

// RunHelperIfChild turns the process into the cgtest child when the
// parent started it as one (and then never returns); otherwise it returns
// at once. Call it first in TestMain, before m.Run.
func RunHelperIfChild() {
	helperRouted = true
	if os.Getenv(HelperEnv) != "1" {
		return
	}
	os.Exit(runChild())
}

// Main is a whole TestMain for packages that use Start:
// RunHelperIfChild, then m.Run.
func Main(m *testing.M) {
	RunHelperIfChild()
	os.Exit(m.Run())
}
