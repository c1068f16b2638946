// Package cgtest gives a test a throwaway cgroup v2 and a child process
// that runs inside it, and inside a network namespace the test chose,
// opening sockets on the test's command: what cgroup sock_addr programs
// (cgroup/connect4, sendmsg6, recvmsg4, getpeername6, ...) need to be
// tested against real sockets without touching anything the test did not
// make.
//
// New creates "<cgroup2 root>/fluxvm-test-<suffix>"; when the test ends it
// kills whatever is still inside (cgroup.kill), waits until the cgroup is
// empty and removes it. Start re-executes the test binary as a child that
// is created inside that cgroup (clone3 CLONE_INTO_CGROUP; the child also
// writes its pid to cgroup.procs before anything else), enters the network
// namespace with setns and then serves requests. Only that child is ever
// put in the cgroup, and a program attached to the cgroup therefore sees
// only the child's sockets.
//
// The child is the test binary itself, so a package that uses Start must
// route the child to its helper from TestMain:
//
//	func TestMain(m *testing.M) { cgtest.Main(m) }
//
// or, with a TestMain of its own, call cgtest.RunHelperIfChild() first.
//
// # Protocol
//
// The parent writes one JSON Request per line on the child's stdin and
// reads one JSON Result per line from its stdout; Child.Do does both.
// Before its first request the child writes a Result describing itself
// (pid, cgroup, network namespace inode). Example exchange:
//
//	-> {"op":"tcp","addr":"10.96.0.10:80","send":"hello","read":9}
//	<- {"local":"10.200.1.2:40312","peer":"10.96.0.10:80","data":"vm2\nhello"}
//	-> {"op":"udp-connected","addr":"[::ffff:10.96.0.10]:53","send":"q","keep":true}
//	<- {"sock":1,"local":"[::ffff:10.200.1.2]:51000","peer":"[::ffff:10.96.0.10]:53","from":"[::ffff:10.96.0.10]:53","data":"vm2\nq"}
//	-> {"op":"send","sock":1,"send":"again"}
//	<- {"sock":1,"local":"...","peer":"...","stage":"recv","errno":"ECONNREFUSED","err":"connection refused"}
//
// Addresses are "ip:port" or "[ip6]:port". The socket's family follows
// the destination: an IPv4 address gives an AF_INET socket, anything else
// (an IPv4-mapped ::ffff:a.b.c.d included) an AF_INET6 socket with
// IPV6_V6ONLY off, and addresses an AF_INET6 socket reports keep their
// mapped form. A socket error does not end the child: the Result names the
// step that failed (Stage) and the errno (EAGAIN: the receive timed out).
//
// It needs Linux; elsewhere New and Start skip the test.
package cgtest
