//go:build linux

package scenario

// The north-south paths of Perf: the external client "ext" behind the
// node's uplink reaches a backend VM of its own (vm3, so that what the
// XDP path needs there changes nothing on the east-west paths' vm2)
// directly, through a north-south VIP served by the TC programs alone
// (xdp_mode off), and through the same VIP with the XDP program native
// on the uplink (xdp_mode native). One dataplane has one XDP mode, so
// Perf switches it between measurements by reopening the dataplane (Close,
// then Open with the other mode: the SDK's restart, which keeps flows,
// services and the TC links, and attaches or removes the XDP link).

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// The north-south paths Perf compares (see PerfOptions.Paths).
const (
	// PathNSDirect is the external client to the north-south backend's
	// own address, routed by the node with the TC programs on the
	// uplink and xdp_mode off: the north-south baseline.
	PathNSDirect PerfPath = "ns-direct"
	// PathNSTC is the external client to NSVIP4 with xdp_mode off: the
	// TC programs on the uplink translate (DNAT and SNAT), the node
	// routes.
	PathNSTC PerfPath = "ns-tc"
	// PathNSXDP is the external client to NSVIP4 with xdp_mode native:
	// the XDP program on the uplink translates and redirects to the
	// backend's VM edge itself (the datapath counts xdp_translated).
	PathNSXDP PerfPath = "ns-xdp"
)

// The path groups of PerfOptions.Paths, in table order.
var (
	EastWestPaths   = []PerfPath{PathBare, PathDirect, PathVIP, PathNFT}
	NorthSouthPaths = []PerfPath{PathNSDirect, PathNSTC, PathNSXDP}
)

// NSVIP4 is the north-south VIP of Perf (ports PerfEchoPort and
// PerfSinkPort, NAT, north-south only).
var NSVIP4 = netip.MustParseAddr("10.96.1.10")

// The north-south lab's SNAT addresses (no interface holds them: the
// backend's replies reach the node by its default route and are
// translated on its VM edge) and the external client's source
// addresses, one per path, on ext's eth0 next to 10.250.0.2.
var (
	perfNSSNAT4        = netip.MustParseAddr("10.254.0.1")
	perfNSSNAT6        = netip.MustParseAddr("fd00:254::1")
	perfSourceNSDirect = netip.MustParseAddr("10.250.0.3")
	perfSourceNSTC     = netip.MustParseAddr("10.250.0.4")
	perfSourceNSXDP    = netip.MustParseAddr("10.250.0.5")
)

// perfUplink is the node's north-south interface toward ext.
const perfUplink = "uplink"

// The datapath counters that tell XDP's work apart.
const (
	cntXDPTranslated = "xdp_translated"
	cntXDPPassEgress = "xdp_pass_egress"
)

var cntXDPPassed = []string{"xdp_pass_no_route", "xdp_pass_fragment", cntXDPPassEgress}

func (p PerfPath) northSouth() bool { return slices.Contains(NorthSouthPaths, p) }

// xdpWanted is the XDP mode a path is measured in; ok is false for the
// east-west paths, which the uplink's mode does not concern.
func (p PerfPath) xdpWanted() (on, ok bool) {
	switch p {
	case PathNSXDP:
		return true, true
	case PathNSDirect, PathNSTC:
		return false, true
	}
	return false, false
}

// ParsePerfPaths parses a comma-separated list of paths and groups
// ("east-west" or "ew", "north-south" or "ns", "socket" or "sock": the
// SocketPaths, "socket-diag": the SocketDiagPaths, "attach-diag": the
// AttachDiagPaths, "all": every path but the diagnostic ones) into paths in table order, without repeats.
func ParsePerfPaths(s string) ([]PerfPath, error) {
	want := map[PerfPath]bool{}
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		switch f {
		case "all":
			for _, p := range allPerfPaths() {
				if !p.diagnostic() {
					want[p] = true
				}
			}
		case "socket", "sock":
			for _, p := range SocketPaths {
				want[p] = true
			}
		case "socket-diag":
			for _, p := range SocketDiagPaths {
				want[p] = true
			}
		case "attach-diag":
			for _, p := range AttachDiagPaths {
				want[p] = true
			}
		case "east-west", "ew":
			for _, p := range EastWestPaths {
				want[p] = true
			}
		case "north-south", "ns":
			for _, p := range NorthSouthPaths {
				want[p] = true
			}
		default:
			p := PerfPath(f)
			if !slices.Contains(allPerfPaths(), p) {
				return nil, fmt.Errorf("scenario: perf: unknown path %q (want %s, or east-west, north-south, socket, socket-diag, attach-diag, all)", f, strings.Join(pathNames(allPerfPaths()), ", "))
			}
			want[p] = true
		}
	}
	var out []PerfPath
	for _, p := range allPerfPaths() {
		if want[p] {
			out = append(out, p)
		}
	}
	return out, nil
}

func pathNames(ps []PerfPath) []string {
	var s []string
	for _, p := range ps {
		s = append(s, string(p))
	}
	return s
}

// perfNSConfig makes "uplink" a north-south interface with the lab's
// SNAT addresses. Every short connection through the north-south VIP
// takes an SNAT port toward the one backend tuple, and its mapping is
// held until the GC removes the closed flow: with the defaults (4536
// ports, tcp_fin_timeout 30s, a GC every 30s) the range runs dry within
// a measurement and new flows drop as snat_failed (the client's SYN then
// waits a second to be sent again), which measures the port range, not
// the path. So the lab takes the widest range, the shortest FIN and RST
// timeouts (conntrack.MinTimeout), and Perf runs the GC before each
// north-south measurement (perfRun.nsGC). The backends never hold a
// closed flow's port (the client closes first and keeps TIME_WAIT), so
// reusing it after 2s is safe.
func perfNSConfig(c *fluxvm.Config) {
	c.NorthSouthInterfaces = []string{perfUplink}
	c.SNATAddress = perfNSSNAT4
	c.SNATAddressV6 = perfNSSNAT6
	c.SNATPortMin, c.SNATPortMax = fluxvm.MinSNATPort, fluxvm.MaxSNATPort
	c.TCPFinTimeout = fluxvm.Duration{Duration: conntrack.MinTimeout}
	c.TCPRstTimeout = fluxvm.Duration{Duration: conntrack.MinTimeout}
}

// nsGC runs the dataplane's GC before a north-south measurement, outside
// its time and CPU accounting: it removes the flows (and frees the SNAT
// ports) that closed more than tcp_fin_timeout ago. The GC timer cannot
// be relied on: every switch of xdp_mode reopens the dataplane, which
// starts the timer afresh.
func (p *perfRun) nsGC(ctx context.Context) error {
	r, err := p.env.DP.GC(ctx)
	if err != nil {
		return fmt.Errorf("GC before a north-south measurement: %w", err)
	}
	p.ns.gcRuns++
	p.ns.gcExpired += r.Expired
	return nil
}

// perfNS is the north-south part of a perfRun.
type perfNS struct {
	backend *lab.VM
	ext     *lab.VM
	sink    *perfSink
	dialer  *perfDialer
	pass    *ebpf.Program
	// xdp is the XDP mode in force on the uplink; reopens counts the
	// switches, reopenTime their total time.
	xdp        bool
	reopens    int
	reopenTime time.Duration
	// gcRuns and gcExpired count nsGC's runs and the flows they removed.
	gcRuns, gcExpired int
}

func (n *perfNS) close() {
	if n.sink != nil {
		n.sink.close()
	}
	if n.dialer != nil {
		n.dialer.close()
	}
	if n.pass != nil {
		n.pass.Close()
	}
}

// setupNS prepares the north-south paths: vm3 (env.Backends[1]) gets a
// sink and an XDP_PASS program on its eth0, ext its sysctls, source
// addresses and software TX checksums, and the dataplane the north-south
// services at NSVIP4.
func (p *perfRun) setupNS(ctx context.Context) error {
	n := &perfNS{backend: p.env.Backends[1], ext: p.env.Lab.External}
	p.ns = n
	err := n.ext.NS.Do(func() error {
		return errors.Join(
			os.WriteFile("/proc/sys/net/ipv4/ip_local_port_range", []byte("1024 65535"), 0o644),
			os.WriteFile("/proc/sys/net/ipv4/tcp_tw_reuse", []byte("1"), 0o644))
	})
	if err != nil {
		return fmt.Errorf("ext sysctls: %w", err)
	}
	if err := perfAddAddrs(n.ext, perfSourceNSDirect, perfSourceNSTC, perfSourceNSXDP); err != nil {
		return err
	}
	// ext's veth leaves the TCP checksum of what it sends to the
	// receiver (CHECKSUM_PARTIAL: only the pseudo-header sum is in the
	// packet) and would keep a VLAN tag beside the frame. XDP sees the
	// bytes, not that skb state, so the loader refuses XDP on the uplink
	// while ext's veth does either (bpf.ErrXDPOffload); a real NIC
	// delivers complete checksums. ext computes them itself, on all
	// three paths alike.
	if err := lab.SendPlainFrames(n.ext.NS, "eth0"); err != nil {
		return err
	}
	// A veth hands redirected XDP frames on only when its peer can take
	// them (an XDP program there, or GRO); otherwise the kernel drops
	// them. vm3's eth0 gets an XDP_PASS program, for all three paths.
	if n.pass, err = ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "perf_xdp_pass", Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2), asm.Return()}, // XDP_PASS
	}); err != nil {
		return fmt.Errorf("XDP_PASS program: %w", err)
	}
	err = n.backend.NS.Do(func() error {
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		return netlink.LinkSetXdpFdWithFlags(l, n.pass.FD(), 1<<2 /* XDP_FLAGS_DRV_MODE */)
	})
	if err != nil {
		return fmt.Errorf("XDP_PASS on %s eth0: %w", n.backend.Name, err)
	}
	if n.sink, err = startPerfSink(n.backend, SinkPort); err != nil {
		return err
	}
	if n.dialer, err = newPerfDialer(n.ext.NS); err != nil {
		return err
	}
	one := uint32(1)
	for _, s := range []fluxvm.Service{
		{Name: "perf-ns", VIPs: []netip.Addr{NSVIP4}, Exposure: fluxvm.ExposureNorthSouth, Mode: fluxvm.ModeNAT,
			Ports:    []fluxvm.ServicePort{{Port: PerfEchoPort, Protocol: fluxvm.TCP}},
			Backends: []fluxvm.Backend{{Address: n.backend.Addr4, Port: BackendPort, Weight: &one}}},
		{Name: "perf-ns-sink", VIPs: []netip.Addr{NSVIP4}, Exposure: fluxvm.ExposureNorthSouth, Mode: fluxvm.ModeNAT,
			Ports:    []fluxvm.ServicePort{{Port: PerfSinkPort, Protocol: fluxvm.TCP}},
			Backends: []fluxvm.Backend{{Address: n.backend.Addr4, Port: SinkPort, Weight: &one}}},
	} {
		if _, err := p.env.DP.ApplyService(ctx, s); err != nil {
			return err
		}
	}
	return p.checkXDPMode()
}

// setXDP switches the uplink's XDP mode by reopening the dataplane: Close
// (the pinned TC links keep forwarding, flows and services stay), then
// Open with xdp_mode native (the backend's VM edge listed in
// xdp_egress_interfaces) or off (which removes our XDP link).
func (p *perfRun) setXDP(on bool) error {
	n := p.ns
	if n.xdp == on {
		return nil
	}
	t0 := time.Now()
	if err := p.env.DP.Close(); err != nil {
		return fmt.Errorf("reopen for xdp_mode: close: %w", err)
	}
	o := p.env.Options
	o.NorthSouth.XDPMode, o.NorthSouth.XDPEgress = bpf.XDPOff, nil
	if on {
		o.NorthSouth.XDPMode, o.NorthSouth.XDPEgress = bpf.XDPNative, []string{n.backend.NodeIf}
	}
	dp, err := fluxvm.Open(context.Background(), o)
	if err != nil {
		p.env.DP = nil // closed; Env.Close removes the pins
		return fmt.Errorf("reopen with xdp_mode %s: %w", o.NorthSouth.XDPMode, err)
	}
	p.env.DP, p.env.Options = dp, o
	n.xdp = on
	n.reopens++
	n.reopenTime += time.Since(t0)
	p.printf("%-11s xdp_mode %s: dataplane reopened in %s\n", "", o.NorthSouth.XDPMode, time.Since(t0).Round(time.Millisecond))
	if err := p.checkXDPMode(); err != nil {
		return err
	}
	// The reopened dataplane runs new program objects.
	if p.o.BPFStats {
		if err := p.openBPFProgs(); err != nil {
			return err
		}
		p.printf("%-11s BPF statistics now over: %s\n", "", strings.Join(p.progNames, ", "))
	}
	return nil
}

// checkXDPMode verifies that the uplink runs the XDP mode perf believes
// in force, both by the dataplane's status and by the kernel's view of
// the interface.
func (p *perfRun) checkXDPMode() error {
	want := bpf.XDPOff
	if p.ns.xdp {
		want = bpf.XDPNative
	}
	var got string
	for _, st := range p.env.DP.Status().Interfaces {
		if st.Name == perfUplink {
			got = st.XDP
		}
	}
	if got != string(want) {
		return fmt.Errorf("uplink XDP mode %q in the status, want %q", got, want)
	}
	var id uint32
	var mode uint32
	err := p.env.Lab.Node.Do(func() error {
		l, err := netlink.LinkByName(perfUplink)
		if err != nil {
			return err
		}
		if x := l.Attrs().Xdp; x != nil && x.Attached {
			id, mode = x.ProgId, x.AttachMode
		}
		return nil
	})
	if err != nil {
		return err
	}
	if on := id != 0; on != p.ns.xdp || (on && mode != 1 /* XDP_ATTACHED_DRV */) {
		return fmt.Errorf("uplink: kernel reports XDP program %d in attach mode %d, want xdp_mode %s", id, mode, want)
	}
	return nil
}

// nsChecks proves, with a short burst of both workloads per north-south
// path, that ns-direct is translated by nothing, ns-tc by the TC programs
// alone (XDP off, xdp_translated does not move) and ns-xdp by the XDP
// program (xdp_translated at least once per connection, nothing left to
// TC for want of an egress).
func (p *perfRun) nsChecks(ctx context.Context, burst time.Duration, burstConns int) error {
	for _, path := range NorthSouthPaths {
		b, err := p.checkBurst(ctx, path, burst, burstConns)
		if err != nil {
			return err
		}
		flows, okConns, xdp, passEgress := b.flows, b.ok, b.xdp, b.passEgress
		mode := "off"
		if p.ns.xdp {
			mode = "native"
		}
		var c PerfCheck
		switch path {
		case PathNSDirect:
			c = PerfCheck{Name: "ns-direct is translated by neither TC nor XDP",
				OK: flows == 0 && xdp == 0 && !p.ns.xdp}
		case PathNSTC:
			c = PerfCheck{Name: "ns-tc is translated by the TC programs, XDP off",
				OK: flows >= okConns && xdp == 0 && !p.ns.xdp}
		case PathNSXDP:
			c = PerfCheck{Name: "ns-xdp is translated by XDP native on the uplink",
				OK: flows >= okConns && xdp >= okConns && passEgress == 0 && p.ns.xdp}
		}
		c.Detail = fmt.Sprintf("%d connections; xdp_mode %s; datapath new flows %d; xdp_translated +%d; xdp_pass_egress +%d",
			okConns, mode, flows, xdp, passEgress)
		p.rep.Checks = append(p.rep.Checks, c)
	}
	return nil
}

// checkNSSample fails the run when a north-south measurement did not go
// through the path it claims: ns-xdp must have XDP translate at least
// one packet per connection and, in bulk, one per 64 KiB sent (a segment
// is at most that); the other paths must leave xdp_translated alone.
func checkNSSample(s PerfSample) error {
	ok := uint64(s.OK)
	switch s.Path {
	case PathNSXDP:
		want := ok
		if s.Workload == WorkloadBulk {
			want = max(want, uint64(s.Bytes)>>16)
		}
		if s.DatapathFlows < ok || s.XDPTranslated < want {
			return fmt.Errorf("%s on %s: %d connections, %d bytes, but the datapath counted %d new flows and xdp_translated +%d (want at least %d)",
				s.Workload, s.Path, s.OK, s.Bytes, s.DatapathFlows, s.XDPTranslated, want)
		}
	case PathNSTC:
		if s.DatapathFlows < ok || s.XDPTranslated != 0 {
			return fmt.Errorf("%s on %s: %d connections, but the datapath counted %d new flows and xdp_translated +%d (want 0: XDP is off)",
				s.Workload, s.Path, s.OK, s.DatapathFlows, s.XDPTranslated)
		}
	default:
		if s.XDPTranslated != 0 {
			return fmt.Errorf("%s on %s: xdp_translated +%d, want 0", s.Workload, s.Path, s.XDPTranslated)
		}
	}
	return nil
}

// nsSummary is the report's account of the XDP counters per path.
func (p *perfRun) nsSummary() string {
	var b strings.Builder
	type acc struct {
		n           int
		sum, lo, hi uint64
		passed      uint64
		drops, snat uint64
	}
	per := map[PerfPath]*acc{}
	var order []PerfPath
	for _, s := range p.rep.Samples {
		if s.Round == 0 {
			continue
		}
		a := per[s.Path]
		if a == nil {
			a = &acc{lo: s.XDPTranslated}
			per[s.Path] = a
			order = append(order, s.Path)
		}
		a.n++
		a.sum += s.XDPTranslated
		a.lo, a.hi = min(a.lo, s.XDPTranslated), max(a.hi, s.XDPTranslated)
		a.passed += s.XDPPassed
		a.drops += s.Drops
		a.snat += s.SNATFailed
	}
	slices.SortFunc(order, func(x, y PerfPath) int { return slices.Index(p.rep.Paths, x) - slices.Index(p.rep.Paths, y) })
	fmt.Fprintf(&b, "xdp_translated per measurement (datapath counter through fluxvm.Stats), all rounds:")
	for _, path := range order {
		a := per[path]
		fmt.Fprintf(&b, "\n  %-9s %3d measurements: total +%d, min +%d, max +%d; xdp_pass_* +%d; datapath drops +%d (snat_failed +%d)",
			path, a.n, a.sum, a.lo, a.hi, a.passed, a.drops, a.snat)
	}
	fmt.Fprintf(&b, "\nxdp_mode switched %d times by reopening the dataplane (Close, Open with xdp_mode native/off): %s in all, between measurements\n",
		p.ns.reopens, p.ns.reopenTime.Round(time.Millisecond))
	fmt.Fprintf(&b, "GC run before each north-south measurement (%d runs, %d flows expired; tcp_fin_timeout and tcp_rst_timeout %s in this lab)\n",
		p.ns.gcRuns, p.ns.gcExpired, conntrack.MinTimeout)
	return b.String()
}
