package bpf

import (
	"fmt"
	"io"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/fluxvm/servicefabric/internal/testutils/cgtest"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// sockLab: a lab node with three backend VMs (vm2..vm4, each serving TCP
// and UDP on 8080 and telling clients its name), the socket LB programs
// loaded on a harness's maps and attached to a cgroup the test made, and
// a child process in that cgroup, in the node's network namespace: a
// process on the node itself.
type sockLab struct {
	h     *harness
	vms   []*lab.VM
	cg    *cgtest.Cgroup
	child *cgtest.Child
	coll  *ebpf.Collection
	links []link.Link
	node  *lab.Lab
	// client is vm1 when the child runs in a client VM, else nil.
	client *lab.VM
}

// The services: sid 1 at sockVIP4 (TCP and UDP), sid 2 at sockVIP6, each
// over the three VMs' addresses of its family, backends 1..3 and 11..13.
var (
	sockVIP4 = netip.MustParseAddrPort("10.96.0.10:80")
	sockVIP6 = netip.MustParseAddrPort("[fd00:96::10]:80")
)

func newSockLab(t *testing.T) *sockLab {
	t.Helper()
	return newSockLabIn(t, false)
}

// newSockLabIn is newSockLab with the child in a client VM (vm1, its edge
// with the TC programs too) instead of on the node, when inVM.
func newSockLabIn(t testing.TB, inVM bool) *sockLab {
	t.Helper()
	l := lab.NewForTest(t)
	var client *lab.VM
	if inVM {
		client = l.AddVMForTest(t, 1)
	}
	s := &sockLab{h: newHarness(t), node: l, client: client}
	for i := 2; i <= 4; i++ {
		vm := l.AddVMForTest(t, i)
		srv, err := vm.Serve(8080)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Close() })
		s.vms = append(s.vms, vm)
	}
	spec, err := loadServiceConnect()
	if obj := os.Getenv("FLUXVM_BENCH_SOCK_OBJECT"); obj != "" {
		spec, err = ebpf.LoadCollectionSpec(obj) // BenchmarkSocketConnect's ablations
	}
	if err != nil {
		t.Fatal(err)
	}
	if s.coll, err = ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: s.h.xdpReplacements(spec)}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.coll.Close() })
	s.cg = cgtest.New(t)
	s.attach(t)
	t.Cleanup(s.detach)
	for _, proto := range []uint8{6, 17} {
		s.h.service(1, sockVIP4, proto)
		s.h.service(2, sockVIP6, proto)
	}
	for i, vm := range s.vms {
		s.h.backend(uint32(1+i), 1, netip.AddrPortFrom(vm.Addr4, 8080), BackendReady, 0)
		s.h.backend(uint32(11+i), 2, netip.AddrPortFrom(vm.Addr6, 8080), BackendReady, 0)
	}
	s.h.table(1, s.h.weighted(map[uint32]int{1: 1, 2: 1, 3: 1}))
	s.h.table(2, s.h.weighted(map[uint32]int{11: 1, 12: 1, 13: 1}))
	// The VM-edge TC programs on the VMs' node-side interfaces, as on a
	// node: the socket hooks' packets must pass them untouched.
	edges := s.vms
	if client != nil {
		edges = append([]*lab.VM{client}, edges...)
	}
	s.h.attachEdges(t, l, edges...)
	ns := l.Node.Handle()
	if client != nil {
		ns = client.NS.Handle()
	}
	s.child = cgtest.Start(t, s.cg, ns)
	return s
}

func (s *sockLab) attach(t testing.TB) {
	t.Helper()
	for _, h := range CgroupHooks {
		if slices.Contains(strings.Split(os.Getenv("FLUXVM_BENCH_SOCK_SKIP"), ","), string(h)) {
			continue // BenchmarkSocketConnect's ablations
		}
		l, err := link.AttachCgroup(link.CgroupOptions{Path: s.cg.Path, Attach: h.attachType(), Program: s.coll.Programs[h.program()]})
		if err != nil {
			t.Fatalf("attach %s: %v", h, err)
		}
		s.links = append(s.links, l)
	}
}

func (s *sockLab) detach() {
	for _, l := range s.links {
		l.Close()
	}
	s.links = nil
}

// vmOf names the VM that answered (the servers start replies with it).
func vmOf(r cgtest.Result) string {
	name, _, _ := strings.Cut(r.Data, "\n")
	return name
}

func (s *sockLab) ok(t *testing.T, what string, r cgtest.Result) {
	t.Helper()
	if r.Stage != "" {
		t.Fatalf("%s: %s failed: %s %s", what, r.Stage, r.Errno, r.Err)
	}
}

// TestSocketLB: processes on the node reach VIPs through the socket hooks
// with real sockets: TCP and UDP, connected and not, IPv4, IPv6 and
// IPv4-mapped IPv6; the application sees the VIP as its peer and as the
// source of what it receives, never the backend.
func TestSocketLB(t *testing.T) {
	s := newSockLab(t)
	for _, tc := range []struct {
		name, op, addr string
	}{
		{"tcp ipv4", cgtest.OpTCP, sockVIP4.String()},
		{"tcp ipv6", cgtest.OpTCP, sockVIP6.String()},
		{"tcp ipv4-mapped", cgtest.OpTCP, "[::ffff:10.96.0.10]:80"},
		{"udp ipv4", cgtest.OpUDP, sockVIP4.String()},
		{"udp ipv6", cgtest.OpUDP, sockVIP6.String()},
		{"udp ipv4-mapped", cgtest.OpUDP, "[::ffff:10.96.0.10]:80"},
		{"connected udp ipv4", cgtest.OpUDPConnected, sockVIP4.String()},
		{"connected udp ipv6", cgtest.OpUDPConnected, sockVIP6.String()},
		{"connected udp ipv4-mapped", cgtest.OpUDPConnected, "[::ffff:10.96.0.10]:80"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := s.h.counters()
			r := s.child.Do(cgtest.Request{Op: tc.op, Addr: tc.addr, Send: "hello"})
			s.ok(t, tc.name, r)
			if !strings.HasPrefix(vmOf(r), "vm") {
				t.Errorf("reply %q: not from a backend VM", r.Data)
			}
			if tc.op != cgtest.OpUDP && r.Peer != tc.addr {
				t.Errorf("getpeername %s, want the VIP %s", r.Peer, tc.addr)
			}
			if tc.op != cgtest.OpTCP && r.From != tc.addr {
				t.Errorf("recvfrom source %s, want the VIP %s", r.From, tc.addr)
			}
			c := s.h.counters()
			if n := c[CounterSockRewritten] - before[CounterSockRewritten]; n < 1 {
				t.Errorf("sock_rewritten +%d, want at least 1", n)
			}
			// The TC programs on the way saw packets to and from a
			// backend (their parser counted them), no VIP: nothing
			// translated, no flow learned.
			if n := c[CounterTCP] + c[CounterUDP] - before[CounterTCP] - before[CounterUDP]; n < 2 {
				t.Errorf("the TC programs parsed %d TCP/UDP packets: not on the path", n)
			}
			for _, sid := range []uint32{1, 2} {
				if st := s.h.stats(sid); st != (ServiceStats{}) {
					t.Errorf("service %d stats %+v: TC translated socket-LB traffic", sid, st)
				}
			}
			for _, m := range []*ebpf.Map{s.h.objs.FluxvmFct4, s.h.objs.FluxvmFct6} {
				if n, err := countEntries(m); err != nil || n != 0 {
					t.Errorf("conntrack holds %d entries (%v): TC learned socket-LB traffic", n, err)
				}
			}
			if n := c[CounterSockReversed] - before[CounterSockReversed]; n < 1 {
				t.Errorf("sock_reversed +%d, want at least 1", n)
			}
		})
	}
}

// TestSocketLBSelection: a socket keeps its backend for its later sends,
// also while that backend drains; Unhealthy moves it at its next send;
// new sockets spread over the backends by their weights.
func TestSocketLBSelection(t *testing.T) {
	s := newSockLab(t)
	first := s.child.Do(cgtest.Request{Op: cgtest.OpUDP, Addr: sockVIP4.String(), Send: "0", Keep: true})
	s.ok(t, "first send", first)
	vm := vmOf(first)
	bid := uint32(0)
	for i, v := range s.vms {
		if v.Name == vm {
			bid = uint32(1 + i)
		}
	}
	if bid == 0 {
		t.Fatalf("first reply from %q, not a backend", vm)
	}
	send := func(what string) cgtest.Result {
		t.Helper()
		r := s.child.Do(cgtest.Request{Op: cgtest.OpSend, Sock: first.Sock, Addr: sockVIP4.String(), Send: what})
		s.ok(t, what, r)
		if r.From != sockVIP4.String() {
			t.Errorf("%s: reply from %s, want the VIP", what, r.From)
		}
		return r
	}
	for i := range 5 {
		if got := vmOf(send(fmt.Sprint("again ", i))); got != vm {
			t.Fatalf("send %d went to %s, want %s (the socket's backend)", i, got, vm)
		}
	}
	ap := netip.AddrPortFrom(s.vms[bid-1].Addr4, 8080)
	now, err := monotonicCoarse()
	if err != nil {
		t.Fatal(err)
	}
	s.h.backend(bid, 1, ap, BackendDraining, now+uint64(time.Minute))
	if got := vmOf(send("draining")); got != vm {
		t.Errorf("draining: sent to %s, want %s (kept while draining)", got, vm)
	}
	before := s.h.counters()
	s.h.backend(bid, 1, ap, BackendUnhealthy, 0)
	s.h.table(1, s.h.weighted(map[uint32]int{1: 1, 2: 1, 3: 1, bid: 0}))
	if got := vmOf(send("unhealthy")); got == vm {
		t.Errorf("unhealthy: still sent to %s", got)
	}
	if n := s.h.counters()[CounterSockRepicked] - before[CounterSockRepicked]; n != 1 {
		t.Errorf("sock_repicked +%d, want 1", n)
	}
	s.h.backend(bid, 1, ap, BackendReady, 0)

	// Weights 2:1:1 over 400 new sockets.
	s.h.table(1, s.h.weighted(map[uint32]int{1: 2, 2: 1, 3: 1}))
	count := map[string]int{}
	const n = 400
	for range n {
		r := s.child.Do(cgtest.Request{Op: cgtest.OpTCP, Addr: sockVIP4.String()})
		s.ok(t, "weighted connect", r)
		count[vmOf(r)]++
	}
	for i, w := range []float64{0.5, 0.25, 0.25} {
		got := float64(count[s.vms[i].Name]) / n
		if got < w-0.08 || got > w+0.08 {
			t.Errorf("%s got %.2f of the connections, want %.2f ± 0.08 (counts %v)", s.vms[i].Name, got, w, count)
		}
	}
}

// TestSocketLBFailOpen: what the hooks cannot serve they leave as the
// application gave it, counted by reason: no service, the guard closed,
// no Ready backend; and with the hooks detached nothing is rewritten.
func TestSocketLBFailOpen(t *testing.T) {
	s := newSockLab(t)
	unchanged := func(what, addr string, reasons ...Counter) {
		t.Helper()
		before := s.h.counters()
		r := s.child.Do(cgtest.Request{Op: cgtest.OpUDPConnected, Addr: addr, NoRecv: true, TimeoutMS: 300})
		c := s.h.counters()
		if n := c[CounterSockRewritten] - before[CounterSockRewritten]; n != 0 {
			t.Errorf("%s: sock_rewritten +%d, want 0", what, n)
		}
		if r.Stage == "" && r.Peer != addr {
			t.Errorf("%s: connected to %s, want the address as given (%s)", what, r.Peer, addr)
		}
		for _, reason := range reasons {
			if n := c[reason] - before[reason]; n != 1 {
				t.Errorf("%s: %s +%d, want 1", what, reason, n)
			}
		}
	}
	unchanged("no service", "10.96.0.99:80")
	unchanged("another port", "10.96.0.10:81")
	s.h.guard(1, GuardClosed)
	unchanged("guard closed", sockVIP4.String(), CounterSockOpenGuard)
	s.h.guard(1, GuardOpen)
	s.h.noTable(1)
	unchanged("no backend", sockVIP4.String(), CounterSockOpenNoBackend)
	s.h.table(1, s.h.weighted(map[uint32]int{1: 1, 2: 1, 3: 1}))
	r := s.child.Do(cgtest.Request{Op: cgtest.OpUDPConnected, Addr: sockVIP4.String(), Send: "x"})
	s.ok(t, "served again", r)
	s.detach()
	unchanged("hooks detached", sockVIP4.String())
}

// TestSocketLBDestroysStaleConnectedUDP: a connected UDP socket's sends
// carry no address, so no hook can move it off a backend that went away:
// the socket iterator terminates it (its next send fails), and the
// application's next connect gets a live backend. Sockets on live
// backends are left alone.
func TestSocketLBDestroysStaleConnectedUDP(t *testing.T) {
	s := newSockLab(t)
	dspec, err := loadSockDestroy()
	if err != nil {
		t.Fatal(err)
	}
	dcoll, err := ebpf.NewCollectionWithOptions(dspec, ebpf.CollectionOptions{MapReplacements: s.h.xdpReplacements(dspec)})
	if err != nil {
		t.Fatalf("load the socket iterator (needs Linux 6.5): %v", err)
	}
	defer dcoll.Close()
	destroy := func() int {
		t.Helper()
		var n int64
		err := s.node.Node.Do(func() error {
			l, err := link.AttachIter(link.IterOptions{Program: dcoll.Programs["fluxvm_sock_destroy_udp"]})
			if err != nil {
				return err
			}
			defer l.Close()
			r, err := l.Open()
			if err != nil {
				return err
			}
			defer r.Close()
			n, err = io.Copy(io.Discard, r)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return int(n)
	}

	// Sockets on every backend (new sockets hash over all three).
	socks := map[string][]int{}
	for i := 0; i < 30 && len(socks) < 3; i++ {
		r := s.child.Do(cgtest.Request{Op: cgtest.OpUDPConnected, Addr: sockVIP4.String(), Send: "hi", Keep: true})
		s.ok(t, "connect", r)
		socks[vmOf(r)] = append(socks[vmOf(r)], r.Sock)
	}
	if len(socks) < 2 {
		t.Fatalf("sockets on %v only", socks)
	}
	if n := destroy(); n != 0 {
		t.Fatalf("every backend Ready: %d sockets destroyed", n)
	}
	gone := s.vms[0]
	s.h.backend(1, 1, netip.AddrPortFrom(gone.Addr4, 8080), BackendUnhealthy, 0)
	s.h.table(1, s.h.weighted(map[uint32]int{2: 1, 3: 1}))
	if n := destroy(); n != len(socks[gone.Name]) {
		t.Errorf("destroyed %d sockets, want the %d on %s", n, len(socks[gone.Name]), gone.Name)
	}
	for vm, ids := range socks {
		for _, id := range ids {
			r := s.child.Do(cgtest.Request{Op: cgtest.OpSend, Sock: id, Send: "still there?", TimeoutMS: 500})
			if vm == gone.Name && r.Stage == "" {
				t.Errorf("socket %d on %s (Unhealthy) still works: %q", id, vm, r.Data)
			}
			if vm != gone.Name && (r.Stage != "" || vmOf(r) != vm) {
				t.Errorf("socket %d on %s (Ready): %+v", id, vm, r)
			}
		}
	}
	r := s.child.Do(cgtest.Request{Op: cgtest.OpUDPConnected, Addr: sockVIP4.String(), Send: "again"})
	s.ok(t, "reconnect", r)
	if vmOf(r) == gone.Name {
		t.Errorf("a new connect went to the Unhealthy %s", gone.Name)
	}
}

// TestSocketLBForgetsClosedSockets: a connected socket's association (its
// way back to the VIP, and a UDP socket's backend) goes when the socket
// closes (sock_release), so the LRU maps hold live sockets only.
func TestSocketLBForgetsClosedSockets(t *testing.T) {
	s := newSockLab(t)
	entries := func() (fwd, rev int) {
		t.Helper()
		var err error
		if fwd, err = countEntries(s.h.objs.FluxvmSockFwd); err != nil {
			t.Fatal(err)
		}
		if rev, err = countEntries(s.h.objs.FluxvmSockRev); err != nil {
			t.Fatal(err)
		}
		return fwd, rev
	}
	for _, tc := range []struct {
		name, op, addr string
		fwd            int // entries of fluxvm_sock_fwd the socket holds
	}{
		{"tcp ipv4", cgtest.OpTCP, sockVIP4.String(), 0},
		{"tcp ipv6", cgtest.OpTCP, sockVIP6.String(), 0},
		{"connected udp ipv4", cgtest.OpUDPConnected, sockVIP4.String(), 1},
		{"connected udp ipv4-mapped", cgtest.OpUDPConnected, "[::ffff:10.96.0.10]:80", 1},
		{"connected udp ipv6", cgtest.OpUDPConnected, sockVIP6.String(), 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f0, r0 := entries()
			r := s.child.Do(cgtest.Request{Op: tc.op, Addr: tc.addr, Send: "hi", Keep: true})
			s.ok(t, "open", r)
			if f, rv := entries(); f != f0+tc.fwd || rv != r0+1 {
				t.Fatalf("open: fwd %d -> %d, rev %d -> %d; want +%d, +1", f0, f, r0, rv, tc.fwd)
			}
			s.ok(t, "close", s.child.Close(r.Sock))
			if f, rv := entries(); f != f0 || rv != r0 {
				t.Errorf("closed: fwd %d, rev %d; want %d, %d", f, rv, f0, r0)
			}
		})
	}
}

// TestSocketLBFallsBackToTC: a client in a VM (a process in a cgroup with
// the hooks, in the VM's network namespace) is served by the socket hooks,
// the VM-edge TC programs passing its packets untouched; with the hooks
// detached, the same connect to the VIP is served by TC, per packet.
func TestSocketLBFallsBackToTC(t *testing.T) {
	s := newSockLabIn(t, true)
	connect := func(what string) (rewritten uint64, st ServiceStats) {
		t.Helper()
		before, st0 := s.h.counters(), s.h.stats(1)
		r := s.child.Do(cgtest.Request{Op: cgtest.OpTCP, Addr: sockVIP4.String(), Send: "hi"})
		s.ok(t, what, r)
		if r.Peer != sockVIP4.String() || !strings.HasPrefix(vmOf(r), "vm") {
			t.Errorf("%s: peer %s, reply %q; want the VIP, a backend", what, r.Peer, r.Data)
		}
		st = s.h.stats(1)
		st.NewFlows -= st0.NewFlows
		st.Packets -= st0.Packets
		return s.h.counters()[CounterSockRewritten] - before[CounterSockRewritten], st
	}
	if n, st := connect("socket hooks"); n != 1 || st.NewFlows != 0 || st.Packets != 0 {
		t.Errorf("socket hooks: sock_rewritten +%d, TC new flows +%d, packets +%d; want 1, 0, 0", n, st.NewFlows, st.Packets)
	}
	s.detach()
	if n, st := connect("TC"); n != 0 || st.NewFlows != 1 || st.Packets == 0 {
		t.Errorf("hooks detached: sock_rewritten +%d, TC new flows +%d, packets +%d; want 0, 1, some", n, st.NewFlows, st.Packets)
	}
}

// TestSocketLBAssociations: one socket reaching one backend through two
// VIPs sees each reply from the VIP it sent to last; a service deleted
// leaves the socket seeing the backend it talks to, not a VIP that no
// longer leads there; a DSR service is left alone (its backends serve the
// VIP itself); a backend past its drain deadline moves the socket.
func TestSocketLBAssociations(t *testing.T) {
	s := newSockLab(t)
	vm := s.vms[0]
	be := netip.AddrPortFrom(vm.Addr4, 8080)
	vipB := netip.MustParseAddrPort("10.96.0.11:80")
	s.h.table(1, s.h.weighted(map[uint32]int{1: 1}))
	s.h.service(3, vipB, 17)
	s.h.backend(21, 3, be, BackendReady, 0)
	s.h.table(3, s.h.weighted(map[uint32]int{21: 1}))

	open := s.child.Do(cgtest.Request{Op: cgtest.OpUDP, Addr: sockVIP4.String(), Send: "a", Keep: true})
	s.ok(t, "to A", open)
	send := func(what string, to netip.AddrPort, wantFrom string) {
		t.Helper()
		r := s.child.Do(cgtest.Request{Op: cgtest.OpSend, Sock: open.Sock, Addr: to.String(), Send: what})
		s.ok(t, what, r)
		if r.From != wantFrom || vmOf(r) != vm.Name {
			t.Errorf("%s: reply from %s (%s), want %s (%s)", what, r.From, vmOf(r), wantFrom, vm.Name)
		}
	}
	send("to B", vipB, vipB.String())
	send("to A again", sockVIP4, sockVIP4.String())

	// Service A deleted: the socket talks to the backend's address.
	w := AddrWords(sockVIP4.Addr())
	s.h.must(s.h.fe.Delete(SvcKey4{Vip: w[0], Port: Port(sockVIP4.Port()), Proto: 17}))
	send("to the backend itself", be, be.String())
	s.h.service(1, sockVIP4, 17)

	// DSR: left as the application gave it.
	before := s.h.counters()[CounterSockRewritten]
	s.h.svcFlags(1, sockVIP4, 6, SvcFlagDSR)
	r := s.child.Do(cgtest.Request{Op: cgtest.OpTCP, Addr: sockVIP4.String(), TimeoutMS: 300})
	if n := s.h.counters()[CounterSockRewritten] - before; n != 0 {
		t.Errorf("DSR service: sock_rewritten +%d (%+v), want 0", n, r)
	}
	s.h.svcFlags(1, sockVIP4, 6, 0)

	// A service with an identity policy: left to TC (which decides by
	// the source's identity), for a connect and for a send of a socket
	// associated before the policy (its association goes).
	c0 := s.h.counters()
	s.h.svcFlags(1, sockVIP4, 6, SvcFlagPolicy)
	s.child.Do(cgtest.Request{Op: cgtest.OpTCP, Addr: sockVIP4.String(), TimeoutMS: 300})
	s.h.svcFlags(1, sockVIP4, 6, 0)
	s.h.svcFlags(3, vipB, 17, SvcFlagPolicy)
	s.child.Do(cgtest.Request{Op: cgtest.OpSend, Sock: open.Sock, Addr: vipB.String(), Send: "policy", TimeoutMS: 300})
	s.h.svcFlags(3, vipB, 17, 0)
	c1 := s.h.counters()
	if n, rw := c1[CounterSockOpenPolicy]-c0[CounterSockOpenPolicy], c1[CounterSockRewritten]-c0[CounterSockRewritten]; n != 2 || rw != 0 {
		t.Errorf("services with a policy: sock_fail_open_policy +%d, sock_rewritten +%d; want 2 and 0", n, rw)
	}
	if n := count(t, s.h.objs.FluxvmSockFwd); n != 1 {
		t.Errorf("%d socket associations; want 1 (the one to VIP B gone, the kept one to A)", n)
	}

	// Draining past its deadline: moved at the next send.
	s.h.table(1, s.h.weighted(map[uint32]int{1: 1, 2: 1, 3: 1}))
	kept := s.child.Do(cgtest.Request{Op: cgtest.OpUDP, Addr: sockVIP4.String(), Send: "x", Keep: true})
	s.ok(t, "kept", kept)
	bid := uint32(0)
	for i, v := range s.vms {
		if v.Name == vmOf(kept) {
			bid = uint32(1 + i)
		}
	}
	now, err := monotonicCoarse()
	if err != nil {
		t.Fatal(err)
	}
	// Draining, as the control plane writes it: out of the table.
	s.h.backend(bid, 1, netip.AddrPortFrom(s.vms[bid-1].Addr4, 8080), BackendDraining, now-1)
	s.h.table(1, s.h.weighted(map[uint32]int{1: 1, 2: 1, 3: 1, bid: 0}))
	r = s.child.Do(cgtest.Request{Op: cgtest.OpSend, Sock: kept.Sock, Addr: sockVIP4.String(), Send: "y"})
	s.ok(t, "past the drain", r)
	if vmOf(r) == vmOf(kept) {
		t.Errorf("past its drain deadline %s still serves the socket", vmOf(r))
	}
}
