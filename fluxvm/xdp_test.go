//go:build linux

package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// xdpOnUplink returns the id and mode ("native", "generic") of the XDP
// program on the interface of the node namespace (0, "" when none).
func (e *env) xdpOnUplink(t *testing.T, ifname string) (ebpf.ProgramID, string) {
	t.Helper()
	var (
		id   ebpf.ProgramID
		mode string
	)
	err := e.lab.Node.Do(func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		if x := l.Attrs().Xdp; x != nil && x.Attached && x.ProgId != 0 {
			id = ebpf.ProgramID(x.ProgId)
			mode = map[uint32]string{1: "native", 2: "generic"}[x.AttachMode]
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return id, mode
}

// attachForeignXDP puts prog, another product's XDP program, on the
// uplink in native mode, as that product would.
func (e *env) attachForeignXDP(t *testing.T, prog *ebpf.Program) {
	t.Helper()
	err := e.lab.Node.Do(func() error {
		l, err := netlink.LinkByName(nsUplink)
		if err != nil {
			return err
		}
		return netlink.LinkSetXdpFdWithFlags(l, prog.FD(), 1<<2 /* XDP_FLAGS_DRV_MODE */)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func xdpProgID(t *testing.T, d *Dataplane) ebpf.ProgramID {
	t.Helper()
	info, err := d.dp.XDPPrograms().FluxvmXdpNs.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return id
}

// ifaceStatus is the status of the named interface, or fails.
func ifaceStatus(t *testing.T, d *Dataplane, name string) InterfaceStatus {
	t.Helper()
	for _, st := range d.Status().Interfaces {
		if st.Name == name {
			return st
		}
	}
	t.Fatalf("no interface %s in the status", name)
	return InterfaceStatus{}
}

// TestDataplaneXDP: xdp_mode puts the XDP program on the uplink (a veth,
// which has native XDP) in the mode asked; the status reports it; a
// restart keeps it, running the new program; RemoveInterface and
// xdp_mode off leave no XDP program; VM edges never get one.
func TestDataplaneXDP(t *testing.T) {
	e := newNSEnv(t)
	e.plainExternal(t)

	// off (the default): nothing.
	d := e.open(t)
	if st := ifaceStatus(t, d, nsUplink); st.XDP != "off" {
		t.Errorf("xdp_mode off: status xdp %q, want off", st.XDP)
	}
	if id, _ := e.xdpOnUplink(t, nsUplink); id != 0 {
		t.Fatalf("xdp_mode off: program %d on the uplink", id)
	}
	d.Close()

	for _, tc := range []struct{ mode, want bpf.XDPMode }{
		{bpf.XDPNative, bpf.XDPNative}, {bpf.XDPGeneric, bpf.XDPGeneric}, {bpf.XDPOff, bpf.XDPOff}, {bpf.XDPAuto, bpf.XDPNative},
	} {
		e.opts.NorthSouth.XDPMode = tc.mode
		d = e.open(t)
		st := ifaceStatus(t, d, nsUplink)
		id, mode := e.xdpOnUplink(t, nsUplink)
		if st.XDP != string(tc.want) {
			t.Errorf("xdp_mode %s: status xdp %q, want %s", tc.mode, st.XDP, tc.want)
		}
		if tc.want == bpf.XDPOff {
			if id != 0 {
				t.Errorf("xdp_mode off after %s: program %d still on the uplink", bpf.XDPGeneric, id)
			}
		} else if id != xdpProgID(t, d) || mode != string(tc.want) {
			t.Errorf("xdp_mode %s: the uplink runs %d in %q, want %d in %s", tc.mode, id, mode, xdpProgID(t, d), tc.want)
		}
		// TC hooks as before.
		if len(st.Hooks) != 2 {
			t.Errorf("xdp_mode %s: hooks %+v", tc.mode, st.Hooks)
		}
		for _, vi := range d.Status().Interfaces {
			if vi.Kind == InterfaceVMEdge && vi.XDP != "" {
				t.Errorf("VM edge %s reports xdp %q", vi.Name, vi.XDP)
			}
		}
		d.Close()
	}

	// A restart with auto keeps the mode in force and runs the new program.
	id, _ := e.xdpOnUplink(t, nsUplink)
	d = e.open(t)
	nid, mode := e.xdpOnUplink(t, nsUplink)
	if nid == id || nid != xdpProgID(t, d) || mode != "native" || ifaceStatus(t, d, nsUplink).XDP != "native" {
		t.Errorf("restart: the uplink runs %d in %q (was %d), want the new program %d native", nid, mode, id, xdpProgID(t, d))
	}

	// RemoveInterface takes XDP and TC away; adding it again attaches
	// both.
	if err := d.RemoveInterface(context.Background(), nsUplink); err != nil {
		t.Fatal(err)
	}
	if id, _ := e.xdpOnUplink(t, nsUplink); id != 0 {
		t.Errorf("program %d on the uplink after RemoveInterface", id)
	}
	if n := len(e.tcxPrograms(t, nsUplink, ebpf.AttachTCXIngress)); n != 0 {
		t.Errorf("%d TC ingress programs after RemoveInterface", n)
	}
	st, err := d.AddNorthSouthInterface(context.Background(), nsUplink)
	if err != nil {
		t.Fatal(err)
	}
	if id, _ := e.xdpOnUplink(t, nsUplink); st.XDP != "native" || id != xdpProgID(t, d) {
		t.Errorf("added again: status %+v, uplink runs %d", st, id)
	}

	// Cleanup removes it with the rest.
	if err := d.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}
	if id, _ := e.xdpOnUplink(t, nsUplink); id != 0 {
		t.Errorf("program %d on the uplink after Cleanup", id)
	}
}

// TestDataplaneXDPRefusesForeign: an XDP program of another product on
// the uplink fails Open and AddNorthSouthInterface with an error naming
// it, before anything is attached; it stays attached. xdp_mode off
// leaves it alone.
func TestDataplaneXDPRefusesForeign(t *testing.T) {
	e := newNSEnv(t)
	foreign, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "not_fluxvm", Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2), asm.Return()}, // XDP_PASS
	})
	if err != nil {
		t.Fatal(err)
	}
	defer foreign.Close()
	info, _ := foreign.Info()
	fid, _ := info.ID()
	e.attachForeignXDP(t, foreign)
	refused := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, bpf.ErrForeignProgram) || !strings.Contains(err.Error(), "not_fluxvm") || !strings.Contains(err.Error(), nsUplink) {
			t.Errorf("%s: %v; want ErrForeignProgram naming not_fluxvm on %s", what, err, nsUplink)
		}
		if id, _ := e.xdpOnUplink(t, nsUplink); id != fid {
			t.Errorf("%s: the uplink runs %d, want the foreign program %d", what, id, fid)
		}
		if n := len(e.tcxPrograms(t, nsUplink, ebpf.AttachTCXIngress)); n != 0 {
			t.Errorf("%s: %d TC ingress programs attached to a refused uplink", what, n)
		}
	}

	e.opts.NorthSouth.XDPMode = bpf.XDPAuto
	d, err := Open(context.Background(), e.opts)
	if err == nil {
		d.Close()
	}
	refused("Open", err)

	e.opts.NorthSouth.Interfaces = nil
	d = e.open(t)
	_, err = d.AddNorthSouthInterface(context.Background(), nsUplink)
	refused("AddNorthSouthInterface", err)
	for _, st := range d.Status().Interfaces {
		if st.Name == nsUplink {
			t.Errorf("a refused uplink is in the status: %+v", st)
		}
	}
	d.Close()

	e.opts.NorthSouth.XDPMode = bpf.XDPOff
	d = e.open(t)
	st, err := d.AddNorthSouthInterface(context.Background(), nsUplink)
	if err != nil || st.XDP != "off" {
		t.Fatalf("xdp_mode off: %+v, %v", st, err)
	}
	if id, _ := e.xdpOnUplink(t, nsUplink); id != fid {
		t.Errorf("xdp_mode off: the uplink runs %d, want the foreign program %d left alone", id, fid)
	}
	if err := d.RemoveInterface(context.Background(), nsUplink); err != nil {
		t.Fatal(err)
	}
	if id, _ := e.xdpOnUplink(t, nsUplink); id != fid {
		t.Errorf("RemoveInterface: the uplink runs %d, want the foreign program %d left alone", id, fid)
	}
}

// xdpLabEnv is the north-south lab prepared for XDP on the uplink: the
// backend edges listed in xdp_egress_interfaces, and an XDP_PASS program
// on each backend VM's side of its veth. xdp_mode is left off and the
// external client's offloads at the veth defaults.
func xdpLabEnv(t *testing.T) *env {
	t.Helper()
	e := newNSEnv(t)
	// The backend VMs' edges take XDP frames (see below): XDP may send
	// to them (xdp_egress_interfaces); to any other interface it leaves
	// the packet to TC.
	for _, vm := range e.backends {
		e.opts.NorthSouth.XDPEgress = append(e.opts.NorthSouth.XDPEgress, vm.NodeIf)
	}
	// A veth sends redirected XDP frames on only when its peer can take
	// them (an XDP program there, or GRO, which needs ethtool); otherwise
	// the kernel drops them (xdp_devmap_xmit reports the drops). Each
	// backend VM's side of its veth gets an XDP_PASS program.
	pass := passXDPProgram(t)
	for _, vm := range e.backends {
		vm.NS.Do(func() error {
			return forVeths(t, func(l netlink.Link) error {
				return netlink.LinkSetXdpFdWithFlags(l, pass.FD(), 1<<2 /* XDP_FLAGS_DRV_MODE */)
			})
		})
	}
	return e
}

// plainExternal turns off the offloads of the external client's veth
// that keep state beside its frames: its packets' checksums are complete
// (no CHECKSUM_PARTIAL, which holds only the pseudo-header sum and which
// XDP cannot see), and a VLAN tag would be in the frame. The loader
// attaches XDP to the uplink, its peer, only then (bpf.ErrXDPOffload). A
// real NIC delivers complete checksums.
func (e *env) plainExternal(t *testing.T) {
	t.Helper()
	if err := lab.SendPlainFrames(e.lab.External.NS, "eth0"); err != nil {
		t.Fatal(err)
	}
}

// TestDataplaneXDPTraffic: with native XDP on the uplink, an external
// client's real TCP and UDP sockets reach the VM backends through an IPv4
// and an IPv6 VIP, and the datapath counts packets XDP translated.
// xdpLab is xdpLabEnv opened with native XDP, the external client's
// offloads off (plainExternal), and a north-south NAT service "edge" (TCP
// and UDP on port 80) at vip4 and vip6.
func xdpLab(t *testing.T) (e *env, d *Dataplane, vip4, vip6 netip.Addr) {
	t.Helper()
	e = xdpLabEnv(t)
	e.opts.NorthSouth.XDPMode = bpf.XDPNative
	e.plainExternal(t)
	d = e.open(t)
	vip4, vip6 = netip.MustParseAddr("10.96.3.1"), netip.MustParseAddr("fd00:96:3::1")
	svc := e.nsService("edge", vip4, vip6, ExposureNorthSouth, ModeNAT, false)
	svc.Ports = append(svc.Ports, ServicePort{Port: 80, Protocol: UDP})
	if _, err := d.ApplyService(context.Background(), svc); err != nil {
		t.Fatal(err)
	}
	return e, d, vip4, vip6
}

func TestDataplaneXDPTraffic(t *testing.T) {
	e, d, vip4n, vip6n := xdpLab(t)
	ext := e.lab.External
	read := func() Stats {
		t.Helper()
		st, err := d.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	// The counters once the connections' last packets (FIN, ACK) are
	// through: two reads 100 ms apart that agree.
	stats := func() Stats {
		t.Helper()
		prev := read()
		for range 50 {
			time.Sleep(100 * time.Millisecond)
			st := read()
			if st.Services["edge"] == prev.Services["edge"] && st.Parser["xdp_translated"] == prev.Parser["xdp_translated"] {
				return st
			}
			prev = st
		}
		t.Fatal("the counters did not settle")
		return Stats{}
	}
	traffic := func() {
		t.Helper()
		for _, vip := range []netip.Addr{vip4n, vip6n} {
			c, err := ext.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
			if err != nil {
				st := read()
				t.Fatalf("external client to %s:80: %v\nparser %v\ndrops %v", vip, err, st.Parser, st.Drops)
			}
			if err := c.Echo([]byte("north-south over XDP"), 3*time.Second); err != nil {
				t.Errorf("%s: echo: %v", vip, err)
			}
			c.Close()
			if name, err := ext.AskUDP(netip.AddrPortFrom(vip, 80), 2*time.Second); err != nil || name == "" {
				t.Errorf("%s udp from outside: %q %v", vip, name, err)
			}
		}
	}
	// The first packet toward each backend finds no neighbour yet: XDP
	// leaves it to the stack, which resolves it (and TC translates it).
	traffic()
	first := stats()
	if first.Parser["xdp_translated"] == 0 {
		t.Errorf("xdp_translated is 0: XDP translated nothing (counters %v)", first.Parser)
	}
	if first.Parser["xdp_pass_egress"] != 0 {
		t.Errorf("xdp_pass_egress is %d: a backend edge was not listed", first.Parser["xdp_pass_egress"])
	}
	// Once the node knows every backend's neighbour (new flows may pick
	// a backend the first round did not reach: a few rounds), every
	// forward packet is translated once, by XDP alone: the service
	// counts as many packets as XDP translated, and none went on to TC (a
	// packet TC translated, first or again, would count in the service's
	// packets but not in xdp_translated).
	for round := 2; ; round++ {
		traffic()
		last := stats()
		fwd := last.Services["edge"].Packets - first.Services["edge"].Packets
		xdp := last.Parser["xdp_translated"] - first.Parser["xdp_translated"]
		passed := 0
		for _, r := range []string{"xdp_pass_no_route", "xdp_pass_fragment", "xdp_pass_egress"} {
			passed += int(last.Parser[r] - first.Parser[r])
		}
		if passed == 0 {
			if fwd == 0 || fwd != xdp {
				t.Errorf("round %d: the service counted %d forward packets, XDP translated %d: want the same, every one by XDP alone", round, fwd, xdp)
			}
			break
		}
		if round == 8 {
			t.Fatalf("round %d: still %d VIP packets passed to TC (parser %v)", round, passed, last.Parser)
		}
		first = last
	}
}

// passXDPProgram is a trivial XDP program that passes every packet.
func passXDPProgram(t *testing.T) *ebpf.Program {
	t.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "xdp_pass", Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2), asm.Return()}, // XDP_PASS
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// forVeths calls f for every veth of the calling thread's namespace and
// fails the test on an error.
func forVeths(t *testing.T, f func(netlink.Link) error) error {
	t.Helper()
	links, err := netlink.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range links {
		if l.Type() == "veth" {
			if err := f(l); err != nil {
				t.Fatalf("%s: %v", l.Attrs().Name, err)
			}
		}
	}
	return nil
}

// TestDataplaneXDPRestartKeepsConnections: established connections through
// XDP survive a restart of the dataplane: while no dataplane runs the
// pinned XDP link keeps forwarding, and the next Open replaces its program
// in place (same mode), with no gap and on the same flow state.
func TestDataplaneXDPRestartKeepsConnections(t *testing.T) {
	e, d, vip4, vip6 := xdpLab(t)
	ext := e.lab.External
	var conns []*lab.Conn
	for _, vip := range []netip.Addr{vip4, vip6} {
		c, err := ext.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
		if err != nil {
			t.Fatalf("external client to %s:80: %v", vip, err)
		}
		t.Cleanup(func() { c.Close() })
		conns = append(conns, c)
	}
	echo := func(when string) {
		t.Helper()
		for i, c := range conns {
			if err := c.Echo([]byte("through XDP "+when), 3*time.Second); err != nil {
				t.Fatalf("connection %d %s: %v", i, when, err)
			}
		}
	}
	echo("before the restart")
	before, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	echo("while no dataplane runs")
	d = e.open(t)
	echo("after the restart")
	after, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if after.Parser["xdp_translated"] <= before.Parser["xdp_translated"] {
		t.Errorf("xdp_translated %d -> %d: XDP did not carry the connections after the restart",
			before.Parser["xdp_translated"], after.Parser["xdp_translated"])
	}
	for _, ifc := range d.Status().Interfaces {
		if ifc.Kind == InterfaceNorthSouth && ifc.XDP != string(bpf.XDPNative) {
			t.Errorf("%s: XDP mode %q after the restart, want native", ifc.Name, ifc.XDP)
		}
	}
}

// countingXDPProgram is another product's XDP program: it passes every
// packet and counts the packets it sees in slot 0 of the array map it
// returns (read with foreignCount).
func countingXDPProgram(t *testing.T) (*ebpf.Program, *ebpf.Map) {
	t.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Name: "foreign_count", Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "foreign_count", Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{
			// key = 0 on the stack; r0 = lookup(map, &key)
			asm.StoreImm(asm.RFP, -4, 0, asm.Word),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -4),
			asm.LoadMapPtr(asm.R1, m.FD()),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, "pass"),
			// __sync_fetch_and_add(value, 1)
			asm.Mov.Imm(asm.R1, 1),
			asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
			asm.Mov.Imm(asm.R0, 2).WithSymbol("pass"), // XDP_PASS
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, m
}

func foreignCount(t *testing.T, m *ebpf.Map) uint64 {
	t.Helper()
	var n uint64
	if err := m.Lookup(uint32(0), &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// echoLoop echoes on c until stop is closed, every few milliseconds, and
// counts the round trips that succeeded and those that failed (a failure
// ends the loop: the connection is then broken).
type echoLoop struct {
	ok, failed atomic.Int64
	firstErr   atomic.Pointer[error]
	stop       chan struct{}
	done       chan struct{}
}

func startEchoLoop(c *lab.Conn) *echoLoop {
	l := &echoLoop{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(l.done)
		for n := 0; ; n++ {
			select {
			case <-l.stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			if err := c.Echo([]byte(fmt.Sprintf("across the uplink %d\n", n)), 3*time.Second); err != nil {
				l.failed.Add(1)
				l.firstErr.CompareAndSwap(nil, &err)
				return
			}
			l.ok.Add(1)
		}
	}()
	return l
}

// finish stops the loop and returns its successes and failures.
func (l *echoLoop) finish() (ok, failed int64, err error) {
	close(l.stop)
	<-l.done
	if p := l.firstErr.Load(); p != nil {
		err = *p
	}
	return l.ok.Load(), l.failed.Load(), err
}

// waitFor polls cond every 10 ms until it holds or the timeout passes.
func waitFor(timeout time.Duration, cond func() bool) bool {
	for end := time.Now().Add(timeout); ; time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(end) {
			return false
		}
	}
}

// TestDataplaneXDPForeignKeepsTraffic: another product's XDP program on
// the uplink, which passes every packet and counts them, with traffic
// across the uplink (an external client's TCP connection to a backend VM's
// own address, through the node, echoing all along): FluxVM asked to take
// the interface with xdp_mode native or auto (Open, AddNorthSouthInterface)
// is refused with an error naming the program and the interface; the
// program stays attached (same id, native) and keeps counting the
// traffic, which is not disturbed (not one echo fails). With xdp_mode off
// FluxVM takes the uplink with TC only, in front of which the foreign
// program keeps running, and a north-south VIP works through TC:
// xdp_translated stays 0 while the service's counters show TC translated.
func TestDataplaneXDPForeignKeepsTraffic(t *testing.T) {
	e := newNSEnv(t)
	ext := e.lab.External
	foreign, counts := countingXDPProgram(t)
	info, err := foreign.Info()
	if err != nil {
		t.Fatal(err)
	}
	fid, _ := info.ID()
	e.attachForeignXDP(t, foreign)
	foreignStays := func(when string) {
		t.Helper()
		if id, mode := e.xdpOnUplink(t, nsUplink); id != fid || mode != "native" {
			t.Errorf("%s: the uplink runs %d (%q), want the foreign program %d native", when, id, mode, fid)
		}
	}

	// Traffic across the uplink that is no service's: the external
	// client to a backend VM's own address.
	direct := netip.AddrPortFrom(e.backends[0].Addr4, 8080)
	c, err := ext.DialTCP(direct, 3*time.Second)
	if err != nil {
		t.Fatalf("external client to %s: %v", direct, err)
	}
	t.Cleanup(func() { c.Close() })
	loop := startEchoLoop(c)
	t.Cleanup(func() {
		select {
		case <-loop.stop:
		default:
			loop.finish()
		}
	})
	// rising waits until the echo loop and the foreign counter both moved
	// on from now.
	rising := func(when string) {
		t.Helper()
		ok0, n0 := loop.ok.Load(), foreignCount(t, counts)
		if !waitFor(10*time.Second, func() bool {
			return loop.ok.Load() >= ok0+20 && foreignCount(t, counts) >= n0+20 || loop.failed.Load() > 0
		}) ||
			loop.failed.Load() > 0 {
			t.Fatalf("%s: echoes %d -> %d (%d failed), foreign program counted %d -> %d",
				when, ok0, loop.ok.Load(), loop.failed.Load(), n0, foreignCount(t, counts))
		}
	}
	rising("before FluxVM")

	for _, mode := range []bpf.XDPMode{bpf.XDPNative, bpf.XDPAuto} {
		refused := func(what string, err error) {
			t.Helper()
			if !errors.Is(err, bpf.ErrForeignProgram) || !strings.Contains(err.Error(), `"foreign_count"`) ||
				!strings.Contains(err.Error(), fmt.Sprintf("id %d", fid)) || !strings.Contains(err.Error(), nsUplink) {
				t.Errorf("%s with xdp_mode %s: %v; want ErrForeignProgram naming foreign_count (id %d) on %s", what, mode, err, fid, nsUplink)
			}
			foreignStays(what + " with xdp_mode " + string(mode))
			if n := len(e.tcxPrograms(t, nsUplink, ebpf.AttachTCXIngress)); n != 0 {
				t.Errorf("%s with xdp_mode %s: %d TC ingress programs attached to a refused uplink", what, mode, n)
			}
		}
		e.opts.NorthSouth.XDPMode = mode
		e.opts.NorthSouth.Interfaces = []string{nsUplink}
		d, err := Open(context.Background(), e.opts)
		if err == nil {
			d.Close()
		}
		refused("Open", err)

		e.opts.NorthSouth.Interfaces = nil
		d = e.open(t)
		_, err = d.AddNorthSouthInterface(context.Background(), nsUplink)
		refused("AddNorthSouthInterface", err)
		d.Close()
		rising("after the refusals with xdp_mode " + string(mode))
	}

	// xdp_mode off: TC only, behind the foreign program.
	e.opts.NorthSouth.XDPMode = bpf.XDPOff
	e.opts.NorthSouth.Interfaces = []string{nsUplink}
	d := e.open(t)
	if st := ifaceStatus(t, d, nsUplink); st.XDP != "off" || len(st.Hooks) != 2 {
		t.Errorf("xdp_mode off: uplink status %+v, want xdp off and both TC hooks", st)
	}
	foreignStays("xdp_mode off")
	if got := e.tcxPrograms(t, nsUplink, ebpf.AttachTCXIngress); len(got) != 1 || got[0] != "fluxvm_ns_in" {
		t.Errorf("xdp_mode off: uplink TC ingress %v, want fluxvm_ns_in", got)
	}
	vip4, vip6 := netip.MustParseAddr("10.96.3.1"), netip.MustParseAddr("fd00:96:3::1")
	svc := e.nsService("edge", vip4, vip6, ExposureNorthSouth, ModeNAT, false)
	svc.Ports = append(svc.Ports, ServicePort{Port: 80, Protocol: UDP})
	if _, err := d.ApplyService(context.Background(), svc); err != nil {
		t.Fatal(err)
	}
	seen := foreignCount(t, counts)
	for _, vip := range []netip.Addr{vip4, vip6} {
		vc, err := ext.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
		if err != nil {
			st, _ := d.Stats(context.Background())
			t.Fatalf("external client to %s:80 through TC: %v\nparser %v\ndrops %v", vip, err, st.Parser, st.Drops)
		}
		for i := range 5 {
			if err := vc.Echo([]byte(fmt.Sprintf("north-south over TC %d", i)), 3*time.Second); err != nil {
				t.Errorf("%s: echo: %v", vip, err)
			}
		}
		vc.Close()
		if name, err := ext.AskUDP(netip.AddrPortFrom(vip, 80), 2*time.Second); err != nil || name == "" {
			t.Errorf("%s udp from outside through TC: %q %v", vip, name, err)
		}
	}
	stats, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// Two TCP flows with a handshake and five echoes each, and two UDP
	// requests: at least 16 packets from the client that only TC can have
	// translated.
	if got := stats.Services["edge"]; got.Packets < 16 || got.NewFlows < 4 || got.ReplyPackets < 12 {
		t.Errorf("xdp_mode off: service counters %+v, want the TC path's translations", got)
	}
	if n := stats.Parser["xdp_translated"]; n != 0 {
		t.Errorf("xdp_mode off: xdp_translated %d, want 0", n)
	}
	if n := foreignCount(t, counts); n < seen+16 {
		t.Errorf("the foreign program counted %d -> %d during the VIP traffic: it did not see it", seen, n)
	}
	foreignStays("after the VIP traffic")
	rising("with FluxVM on TC")
	if ok, failed, err := loop.finish(); failed != 0 || err != nil {
		t.Errorf("the connection across the uplink: %d echoes, %d failed: %v", ok, failed, err)
	} else {
		t.Logf("the connection across the uplink: %d echoes, none failed; the foreign program counted %d packets", ok, foreignCount(t, counts))
	}
}
