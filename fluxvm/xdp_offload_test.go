//go:build linux

package fluxvm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/ethtool"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// taggedPort is the VIP port whose traffic the external client tags.
const taggedPort = 81

// tagOnEgress puts a TC egress program on the external client's eth0
// that pushes the 802.1Q tag 100 onto every IPv4 packet to port
// taggedPort (bpf_skb_vlan_push, as a VLAN device above eth0 would tag
// it): the node gets that traffic tagged, on an uplink with no VLAN
// device, as a trunk would deliver it. Where the tag travels depends on
// eth0's tx-vlan-hw-insert: on (a veth's default), beside the frame, in
// the skb, which a veth passes to its peer as it is; off, inside the
// frame.
func tagOnEgress(t *testing.T, vm *lab.VM) {
	t.Helper()
	be16 := func(v uint16) int32 { return int32(v>>8 | v<<8&0xff00) } // network order, as a little-endian load sees it
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "tag_port81", Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Reg(asm.R6, asm.R1),
			asm.LoadMem(asm.R2, asm.R6, 16, asm.Word), // skb->protocol
			asm.JNE.Imm(asm.R2, be16(0x0800), "out"),
			// The destination port of a TCP or UDP header after a
			// 20-byte IPv4 header (the client sends no options).
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.Mov.Imm(asm.R2, 14+20+2),
			asm.Mov.Reg(asm.R3, asm.RFP),
			asm.Add.Imm(asm.R3, -8),
			asm.Mov.Imm(asm.R4, 2),
			asm.FnSkbLoadBytes.Call(),
			asm.JNE.Imm(asm.R0, 0, "out"),
			asm.LoadMem(asm.R2, asm.RFP, -8, asm.Half),
			asm.JNE.Imm(asm.R2, be16(taggedPort), "out"),
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.Mov.Imm(asm.R2, be16(0x8100)),
			asm.Mov.Imm(asm.R3, 100),
			asm.FnSkbVlanPush.Call(),
			asm.Mov.Imm(asm.R0, 0).WithSymbol("out"), // TCX_PASS
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	err = vm.NS.Do(func() error {
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		tl, err := link.AttachTCX(link.TCXOptions{Interface: l.Attrs().Index, Program: prog, Attach: ebpf.AttachTCXEgress})
		if err != nil {
			return err
		}
		t.Cleanup(func() { tl.Close() })
		return nil
	})
	if err != nil {
		t.Fatalf("tagging program on %s: %v", vm.Name, err)
	}
}

// TestDataplaneXDPTaggedTraffic: north-south VIP traffic that reaches a
// veth uplink VLAN-tagged (the external client tags what it sends to
// port 81; the node has no VLAN device there, so that traffic is not the
// uplink's and must not be served).
//
// With the client's veth keeping tags beside its frames (its default;
// its checksums complete), XDP on the uplink would see
// a tagged frame as an untagged one: xdp_mode native fails Open with
// ErrXDPOffload naming the uplink, its peer's offloads and the ethtool
// command, and attaches nothing; auto takes the uplink with TC alone
// (status xdp off, xdp_problem says why), serves untagged traffic, and no
// backend sees the tagged traffic. With those offloads off (the tag in
// the frame, checksums complete), native XDP attaches, translates the
// untagged traffic, and passes the tagged frames on with their tag: no
// backend sees them, and neither XDP nor TC counts them for the service.
// Tag insertion turned on again, adding the uplink again is refused and
// takes our XDP program off, the TC hooks kept.
func TestDataplaneXDPTaggedTraffic(t *testing.T) {
	e := xdpLabEnv(t)
	ext := e.lab.External
	tagOnEgress(t, ext)
	vip4, vip6 := netip.MustParseAddr("10.96.5.1"), netip.MustParseAddr("fd00:96:5::1")
	svc := e.nsService("edge", vip4, vip6, ExposureNorthSouth, ModeNAT, false)
	svc.Ports = append(svc.Ports, ServicePort{Port: taggedPort, Protocol: TCP})
	plain, tagged := netip.AddrPortFrom(vip4, 80), netip.AddrPortFrom(vip4, taggedPort)

	stats := func(d *Dataplane) Stats {
		t.Helper()
		st, err := d.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	peers := func() int {
		n := 0
		for _, s := range e.servers {
			n += len(s.Peers())
		}
		return n
	}
	// untagged: rounds of connections to the VIP's port 80 all echo;
	// returns how many packets XDP translated meanwhile.
	untagged := func(d *Dataplane, when string, rounds int) uint64 {
		t.Helper()
		before := stats(d).Parser["xdp_translated"]
		for i := range rounds {
			c, err := ext.DialTCP(plain, 3*time.Second)
			if err != nil {
				t.Fatalf("%s: untagged connection %d to %s: %v", when, i, plain, err)
			}
			if err := c.Echo([]byte("untagged\n"), 3*time.Second); err != nil {
				t.Errorf("%s: untagged echo %d: %v", when, i, err)
			}
			c.Close()
		}
		return stats(d).Parser["xdp_translated"] - before
	}
	// taggedNotServed: a connection to port 81 (tagged) reaches no
	// backend, and the service counts none of its packets.
	taggedNotServed := func(d *Dataplane, when string) {
		t.Helper()
		p0, st0 := peers(), settled(t, d)
		if c, err := ext.DialTCP(tagged, 2*time.Second); err == nil {
			t.Errorf("%s: the tagged connection to %s was served by %s", when, tagged, c.Backend)
			c.Close()
		}
		st := stats(d)
		if n := peers() - p0; n != 0 {
			t.Errorf("%s: %d backends saw the tagged connection", when, n)
		}
		if n := st.Services["edge"].Packets - st0.Services["edge"].Packets; n != 0 {
			t.Errorf("%s: the service counted %d packets of the tagged connection (xdp_translated +%d)", when, n,
				st.Parser["xdp_translated"]-st0.Parser["xdp_translated"])
		}
		if st.Parser["non_ip"] <= st0.Parser["non_ip"] {
			t.Errorf("%s: non_ip did not count the tagged frames (%d -> %d)", when, st0.Parser["non_ip"], st.Parser["non_ip"])
		}
	}

	// The client's veth keeps tags beside its frames (its default); its
	// checksums are complete, so that only the tags are in question.
	// native: refused, nothing attached.
	if err := ext.NS.Do(func() error {
		return ethtool.SetFeatures("eth0", map[string]bool{"tx-checksum-ip-generic": false})
	}); err != nil {
		t.Fatal(err)
	}
	e.opts.NorthSouth.XDPMode = bpf.XDPNative
	d, err := Open(context.Background(), e.opts)
	if err == nil {
		t.Errorf("Open with xdp_mode native over a peer that keeps tags beside its frames: no error")
		// What XDP does with the tagged traffic when it is attached
		// anyway.
		if _, err := d.ApplyService(context.Background(), svc); err != nil {
			t.Fatal(err)
		}
		untagged(d, "native XDP attached anyway", 6)
		taggedNotServed(d, "native XDP attached anyway")
		d.Close()
	} else {
		for _, w := range []string{nsUplink, "veth peer eth0", "tx-vlan-hw-insert, tx-vlan-stag-hw-insert on", "without its tag",
			"ethtool -K eth0 tx-vlan-hw-insert off tx-vlan-stag-hw-insert off in the peer's namespace", "xdp_mode off"} {
			if !errors.Is(err, bpf.ErrXDPOffload) || !strings.Contains(err.Error(), w) {
				t.Errorf("Open with xdp_mode native: %v; want ErrXDPOffload saying %q", err, w)
			}
		}
		if strings.Contains(err.Error(), "checksum") {
			t.Errorf("Open with xdp_mode native: %v; the checksums are complete", err)
		}
		if id, _ := e.xdpOnUplink(t, nsUplink); id != 0 {
			t.Errorf("refused: XDP program %d on the uplink", id)
		}
		if n := len(e.tcxPrograms(t, nsUplink, ebpf.AttachTCXIngress)); n != 0 {
			t.Errorf("refused: %d TC ingress programs on the uplink", n)
		}
	}

	// auto: TC alone, the reason in the status.
	e.opts.NorthSouth.XDPMode = bpf.XDPAuto
	d = e.open(t)
	st := ifaceStatus(t, d, nsUplink)
	if st.XDP != "off" || !strings.Contains(st.XDPProblem, "tx-vlan-hw-insert") || !strings.Contains(st.XDPProblem, "ethtool -K eth0 ") || len(st.Hooks) != 2 {
		t.Errorf("auto over a peer that keeps tags beside its frames: status %+v; want xdp off, TC hooks, and why in xdp_problem", st)
	}
	if id, _ := e.xdpOnUplink(t, nsUplink); id != 0 {
		t.Errorf("auto: XDP program %d on the uplink", id)
	}
	if _, err := d.ApplyService(context.Background(), svc); err != nil {
		t.Fatal(err)
	}
	if n := untagged(d, "auto, TC alone", 4); n != 0 {
		t.Errorf("auto, TC alone: xdp_translated +%d", n)
	}
	taggedNotServed(d, "auto, TC alone")
	d.Close()

	// The client's offloads off: the tag in the frame, checksums
	// complete. native attaches; XDP translates the untagged traffic and
	// passes the tagged frames with their tag.
	e.plainExternal(t)
	e.opts.NorthSouth.XDPMode = bpf.XDPNative
	d = e.open(t)
	if st := ifaceStatus(t, d, nsUplink); st.XDP != "native" || st.XDPProblem != "" {
		t.Errorf("native over a plain peer: status %+v", st)
	}
	// The first packets toward each backend find no neighbour and go to
	// TC; XDP translates the next ones.
	if n := untagged(d, "native XDP", 8); n == 0 {
		t.Errorf("native XDP: xdp_translated did not move")
	}
	taggedNotServed(d, "native XDP")

	// The client's tag insertion on again: adding the uplink again (as a
	// restart would) is refused and takes our XDP program off; its TC
	// hooks stay and serve it.
	if err := ext.NS.Do(func() error {
		return ethtool.SetFeatures("eth0", map[string]bool{"tx-vlan-hw-insert": true})
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.AddNorthSouthInterface(context.Background(), nsUplink); !errors.Is(err, bpf.ErrXDPOffload) || !strings.Contains(err.Error(), "tx-vlan-hw-insert on") {
		t.Errorf("AddNorthSouthInterface again with the tags beside the frames: %v; want ErrXDPOffload", err)
	}
	if id, _ := e.xdpOnUplink(t, nsUplink); id != 0 {
		t.Errorf("refused again: XDP program %d still on the uplink", id)
	}
	if st := ifaceStatus(t, d, nsUplink); st.XDP != "off" || len(st.Hooks) != 2 {
		t.Errorf("refused again: status %+v; want xdp off, the TC hooks kept", st)
	}
	untagged(d, "refused again, TC alone", 2)
	taggedNotServed(d, "refused again, TC alone")
}

// TestXDPChecksumPartialFrames proves why the loader keeps XDP off a veth
// whose peer leaves checksums to the receiver (tx-checksum-ip-generic, a
// veth's default): those frames are CHECKSUM_PARTIAL, their TCP checksum
// field holds only the pseudo-header sum, and XDP, which cannot see that
// state, patches it as a full checksum. With the XDP program attached to
// the uplink by hand (bypassing the loader's check), connections through
// the VIP that XDP translates fail, and the backends' TCP counts checksum
// errors; with the client's checksum offload off, they all work.
func TestXDPChecksumPartialFrames(t *testing.T) {
	e := xdpLabEnv(t)
	ext := e.lab.External
	// Tags are not the question here: only checksums are left to the
	// receiver.
	if err := ext.NS.Do(func() error {
		return ethtool.SetFeatures("eth0", map[string]bool{"tx-vlan-hw-insert": false, "tx-vlan-stag-hw-insert": false})
	}); err != nil {
		t.Fatal(err)
	}
	egress := e.opts.NorthSouth.XDPEgress
	e.opts.NorthSouth.XDPEgress = nil // xdp_mode off takes none
	d := e.open(t)
	if _, err := d.AddNorthSouthInterface(context.Background(), nsUplink); err != nil {
		t.Fatal(err)
	}
	vip := netip.MustParseAddr("10.96.6.1")
	svc := e.nsService("edge", vip, netip.MustParseAddr("fd00:96:6::1"), ExposureNorthSouth, ModeNAT, false)
	if _, err := d.ApplyService(context.Background(), svc); err != nil {
		t.Fatal(err)
	}
	// The loader refuses this uplink ...
	err := e.lab.Node.Do(func() error { return d.dp.CheckXDP(bpf.Interface{Name: nsUplink}) })
	if !errors.Is(err, bpf.ErrXDPOffload) || !strings.Contains(err.Error(), "CHECKSUM_PARTIAL") || strings.Contains(err.Error(), "tx-vlan") {
		t.Fatalf("CheckXDP: %v; want ErrXDPOffload for the checksums alone", err)
	}
	// ... so the program goes on by hand, as before the check.
	err = e.lab.Node.Do(func() error {
		up, err := netlink.LinkByName(nsUplink)
		if err != nil {
			return err
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: d.dp.XDPPrograms().FluxvmXdpNs, Interface: up.Attrs().Index, Flags: link.XDPDriverMode})
		if err != nil {
			return err
		}
		t.Cleanup(func() { l.Close() })
		for _, n := range append([]string{nsUplink}, egress...) {
			if err := d.dp.AllowXDPEgress(bpf.Interface{Name: n}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	csumErrors := func() (n uint64) {
		t.Helper()
		for _, vm := range e.backends {
			c, err := tcpInCsumErrors(vm)
			if err != nil {
				t.Fatal(err)
			}
			n += c
		}
		return n
	}
	round := func(n int) (ok int, translated, csum uint64) {
		t.Helper()
		c0 := csumErrors()
		x0 := d.mustStats(t).Parser["xdp_translated"]
		for range n {
			if c, err := ext.DialTCP(netip.AddrPortFrom(vip, 80), time.Second); err == nil {
				ok++
				c.Close()
			}
		}
		return ok, d.mustStats(t).Parser["xdp_translated"] - x0, csumErrors() - c0
	}
	// The first connection toward each backend goes through TC (no
	// neighbour yet), which completes CHECKSUM_PARTIAL correctly.
	round(6)
	ok, translated, csum := round(6)
	t.Logf("CHECKSUM_PARTIAL through XDP: %d of 6 connections, xdp_translated +%d, backend Tcp InCsumErrors +%d", ok, translated, csum)
	if translated == 0 || ok == 6 || csum == 0 {
		t.Errorf("CHECKSUM_PARTIAL frames through XDP: %d of 6 connections made it, XDP translated %d packets, the backends counted %d checksum errors; want failures, translations and checksum errors", ok, translated, csum)
	}
	if err := lab.SendPlainFrames(ext.NS, "eth0"); err != nil {
		t.Fatal(err)
	}
	ok, translated, csum = round(6)
	t.Logf("complete checksums through XDP: %d of 6 connections, xdp_translated +%d, backend Tcp InCsumErrors +%d", ok, translated, csum)
	if translated == 0 || ok != 6 || csum != 0 {
		t.Errorf("complete checksums through XDP: %d of 6 connections made it, XDP translated %d packets, %d checksum errors; want all, by XDP, none", ok, translated, csum)
	}
}

// settled returns the datapath's counters once the last packets of
// earlier connections (FIN, ACK) are through: two reads 100 ms apart
// that agree.
func settled(t *testing.T, d *Dataplane) Stats {
	t.Helper()
	prev := d.mustStats(t)
	for range 50 {
		time.Sleep(100 * time.Millisecond)
		st := d.mustStats(t)
		if fmt.Sprint(st.Services, st.Parser) == fmt.Sprint(prev.Services, prev.Parser) {
			return st
		}
		prev = st
	}
	t.Fatal("the counters did not settle")
	return Stats{}
}

func (d *Dataplane) mustStats(t *testing.T) Stats {
	t.Helper()
	st, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// tcpInCsumErrors reads Tcp InCsumErrors of the VM's namespace.
func tcpInCsumErrors(vm *lab.VM) (n uint64, err error) {
	err = vm.NS.Do(func() error {
		f, err := os.Open("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		defer f.Close()
		var head []string
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) == 0 || fields[0] != "Tcp:" {
				continue
			}
			if head == nil {
				head = fields
				continue
			}
			for i, h := range head {
				if h == "InCsumErrors" && i < len(fields) {
					n, err = strconv.ParseUint(fields[i], 10, 64)
					return err
				}
			}
		}
		return fmt.Errorf("no Tcp InCsumErrors in /proc/net/snmp")
	})
	return n, err
}
