package main

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestDaemonRestartKeepsXDPFlows runs the real binary with native XDP on
// the north-south uplink (issue 17): a north-south NAT service applied
// over REST carries an external client's long-lived TCP connection and
// its UDP requests from a fixed port through XDP, while the daemon is
// restarted twice, once by SIGTERM and once by kill -9.
//
// Traffic runs all the time, also while no daemon runs: an echo every few
// milliseconds on the TCP connection and a UDP request every few
// milliseconds. It passes when
//   - no echo fails and no UDP request goes unanswered, and every UDP
//     answer comes from the backend of the first one (the TCP connection
//     itself would be reset by any other backend);
//   - the status reports xdp "native" on the uplink before and after each
//     restart;
//   - the XDP program on the uplink is FluxVM's own: the one in the link
//     pinned under the pin root (links/xdp_<ifindex>), which keeps its id
//     through the restarts (the program in it is replaced in place), runs
//     the old daemon's program while no daemon runs, and the new daemon's
//     (one it holds open) after the start;
//   - fluxvm_datapath_events_total{event="xdp_translated"} in /metrics
//     rises, after each restart by at least one per echo and UDP request
//     made meanwhile: their packets went through XDP, not TC.
//
// Counters XDP passes to TC with (xdp_pass_*), datapath drops and the
// slowest echo (a TCP retransmission takes 200 ms or more) are logged for
// each phase.
func TestDaemonRestartKeepsXDPFlows(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	l := lab.NewForTest(t)
	var backends []*lab.VM
	for i := 1; i <= 2; i++ {
		vm := l.AddVMForTest(t, i)
		srv, err := vm.Serve(8080)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Close() })
		backends = append(backends, vm)
	}
	ext, err := l.AddExternal()
	if err != nil {
		t.Fatal(err)
	}
	// What makes XDP work on veths (see fluxvm's xdpLab): the backend VMs'
	// ends of their veths run an XDP program, so that frames redirected
	// to the node's ends are delivered; the external client computes its
	// checksums, as a physical NIC delivers complete ones.
	pass, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "xdp_pass", Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2), asm.Return()}, // XDP_PASS
	})
	if err != nil {
		t.Fatal(err)
	}
	defer pass.Close()
	var egress []string
	for _, vm := range backends {
		egress = append(egress, strconv.Quote(vm.NodeIf))
		err := vm.NS.Do(func() error {
			eth0, err := netlink.LinkByName("eth0")
			if err != nil {
				return err
			}
			return netlink.LinkSetXdpFdWithFlags(eth0, pass.FD(), 1<<2 /* XDP_FLAGS_DRV_MODE */)
		})
		if err != nil {
			t.Fatalf("XDP_PASS on %s: %v", vm.Name, err)
		}
	}
	// The loader attaches XDP to the uplink only while its veth peer
	// sends complete checksums and tags in the frame (bpf.ErrXDPOffload).
	if err := lab.SendPlainFrames(ext.NS, "eth0"); err != nil {
		t.Fatal(err)
	}

	pinRoot := filepath.Join(testenv.PinRoot(t), "service")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "fluxvmd.toml")
	conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = "S"
pin_root = %q
catalog_path = %q
advertisements_path = %q
vm_edge_interfaces = [ { name = "vm1", vm_id = "vm1" }, { name = "vm2", vm_id = "vm2" } ]
north_south_interfaces = ["uplink"]
xdp_mode = "native"
xdp_egress_interfaces = [ %s ]
snat_address = "10.250.0.100"
snat_port_min = 62000
snat_port_max = 62999
`, pinRoot, filepath.Join(dir, "catalog.json"), filepath.Join(dir, "adv.json"), strings.Join(egress, ", "))
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}

	d := startDaemon(t, bin, cfg, l)
	var xdpNative func(string)
	statusNative := func(when string) {
		t.Helper()
		for _, ifc := range daemonStatus(t, d).Interfaces {
			if ifc.Name == "uplink" {
				if ifc.Kind != fluxvm.InterfaceNorthSouth || ifc.XDP != "native" {
					t.Errorf("%s: status of the uplink %+v, want north-south with xdp native", when, ifc)
				}
				return
			}
		}
		t.Errorf("%s: no uplink in the status", when)
	}
	xdpNative = func(when string) {
		t.Helper()
		statusNative(when)
		if v := metrics(t, d)[`fluxvm_xdp_mode{interface="uplink",mode="native"}`]; v != 1 {
			t.Errorf("%s: /metrics fluxvm_xdp_mode of the uplink native is %v, want 1", when, v)
		}
	}
	xdpNative("first start")

	vip := netip.MustParseAddr("10.96.3.1")
	svc := fluxvm.Service{
		Name: "edge", Exposure: fluxvm.ExposureNorthSouth, VIPs: []netip.Addr{vip},
		Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}, {Port: 80, Protocol: fluxvm.UDP}},
	}
	for _, vm := range backends {
		svc.Backends = append(svc.Backends, fluxvm.Backend{Address: vm.Addr4, Port: 8080})
	}
	if _, err := d.Request("POST", "/v1/network/services", svc); err != nil {
		t.Fatal(err)
	}
	dst := netip.AddrPortFrom(vip, 80)
	c, err := ext.DialTCP(dst, 3*time.Second)
	if err != nil {
		t.Fatalf("external client to %s: %v\n%s", dst, err, d.Out)
	}
	t.Cleanup(func() { c.Close() })
	var uc *net.UDPConn
	err = ext.NS.Do(func() (err error) {
		uc, err = net.DialUDP("udp", &net.UDPAddr{IP: ext.Addr4.AsSlice(), Port: 40080}, net.UDPAddrFromAddrPort(dst))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { uc.Close() })
	tr := &xdpTraffic{tcp: c, udp: uc, stop: make(chan struct{})}
	if tr.udpBackend, err = tr.ask(-1, 2*time.Second); err != nil {
		t.Fatalf("UDP from outside to %s: %v", dst, err)
	}
	t.Logf("TCP connection on %s, UDP flow from port 40080 on %s", c.Backend, tr.udpBackend)
	tr.start()
	t.Cleanup(func() { tr.finish() })

	uplink := ext.NodeIfIndex
	// The first packets of a flow may pass to TC while the node resolves
	// the backend's neighbour; then XDP carries it.
	if !waitUntil(10*time.Second, func() bool { return metric(t, d, xdpTranslated) > 20 && tr.echoes.Load() > 20 }) {
		t.Fatalf("xdp_translated %v after %d echoes: XDP does not carry the flows\n%s", metric(t, d, xdpTranslated), tr.echoes.Load(), tr.report())
	}
	linkID, prog := ourXDP(t, l, pinRoot, uplink, d.Cmd.Process.Pid)

	for _, kill := range []bool{false, true} {
		how := "SIGTERM"
		if kill {
			how = "kill -9"
		}
		before := phaseStart(t, d, tr)
		if kill {
			if err := d.Cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			d.Cmd.Wait()
		} else {
			d.Stop()
			if !bytes.Contains(d.Out.Bytes(), []byte("the datapath keeps forwarding")) {
				t.Errorf("%s: the daemon did not stop by its SIGTERM path:\n%s", how, d.Out)
			}
		}
		// No daemon runs: the pinned link keeps running the old program.
		if id, p := ourXDP(t, l, pinRoot, uplink, 0); id != linkID || p != prog {
			t.Errorf("%s, no daemon: link %d running program %d, want link %d still running %d", how, id, p, linkID, prog)
		}
		tr.progress(t, how+", no daemon running")
		began, e0, u0 := time.Now(), tr.echoes.Load(), tr.answers.Load()
		d = startDaemon(t, bin, cfg, l)
		t.Logf("%s: %d echoes and %d UDP answers while the daemon started (%v)",
			how, tr.echoes.Load()-e0, tr.answers.Load()-u0, time.Since(began).Round(time.Millisecond))
		xdpNative("after " + how)
		id, p := ourXDP(t, l, pinRoot, uplink, d.Cmd.Process.Pid)
		if id != linkID || p == prog {
			t.Errorf("%s, restarted: link %d running program %d, want link %d running a new program (not %d)", how, id, p, linkID, prog)
		}
		prog = p
		// The traffic since the start went through XDP: at least one
		// translated packet per echo and UDP request (the two reads
		// bracket the counts but for the one in flight each).
		x0, e0, u0 := metric(t, d, xdpTranslated), tr.echoes.Load(), tr.answers.Load()
		tr.progress(t, how+", restarted")
		e1, u1 := tr.echoes.Load(), tr.answers.Load()
		x1 := metric(t, d, xdpTranslated)
		if x1-x0 < float64(e1-e0+u1-u0-2) {
			t.Errorf("%s, restarted: xdp_translated rose by %v over %d echoes and %d UDP requests: the traffic went (partly) through TC",
				how, x1-x0, e1-e0, u1-u0)
		}
		phaseEnd(t, d, tr, how, before)
	}
	res := tr.finish()
	t.Logf("in all: %s", res)
	if tr.failed.Load() != 0 || tr.lost.Load() != 0 || tr.wrong.Load() != 0 {
		t.Errorf("traffic through the restarts failed:\n%s", res)
	}
	d.Stop()
	// The daemon left its pins; the test's pin root goes with them.
}

var xdpTranslated = `fluxvm_datapath_events_total{event="xdp_translated"}`

var metricLine = regexp.MustCompile(`(?m)^(fluxvm_[a-z_]+(?:\{[^}]*\})?) (\S+)$`)

// metrics reads /metrics: every fluxvm_ sample by its name and labels.
func metrics(t *testing.T, d *daemon) map[string]float64 {
	t.Helper()
	body, err := d.Request("GET", "/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, m := range metricLine.FindAllStringSubmatch(string(body), -1) {
		v, err := strconv.ParseFloat(m[2], 64)
		if err != nil {
			t.Fatalf("/metrics: %q: %v", m[0], err)
		}
		out[m[1]] = v
	}
	return out
}

// metric is one sample of /metrics; a missing one fails the test.
func metric(t *testing.T, d *daemon, name string) float64 {
	t.Helper()
	v, ok := metrics(t, d)[name]
	if !ok {
		t.Fatalf("/metrics lacks %s", name)
	}
	return v
}

// phaseCounters are the counters a restart is judged by.
type phaseCounters struct {
	at              time.Time
	m               map[string]float64
	echoes, answers int64
	failed, lost    int64
	retrans         uint32
}

func phaseStart(t *testing.T, d *daemon, tr *xdpTraffic) phaseCounters {
	t.Helper()
	tr.slowest.Store(0)
	return phaseCounters{at: time.Now(), m: metrics(t, d), echoes: tr.echoes.Load(), answers: tr.answers.Load(),
		failed: tr.failed.Load(), lost: tr.lost.Load(), retrans: retransmissions(t, tr.tcp)}
}

// retransmissions is the number of segments the client's TCP stack sent
// again on c (tcpi_total_retrans): each is a packet of the connection, or
// its acknowledgement, that was lost on the way.
func retransmissions(t *testing.T, c *lab.Conn) uint32 {
	t.Helper()
	rc, err := c.Conn.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var (
		info *unix.TCPInfo
		gerr error
	)
	if err := rc.Control(func(fd uintptr) { info, gerr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil {
		t.Fatal(err)
	}
	if gerr != nil {
		t.Fatal(gerr)
	}
	return info.Total_retrans
}

// phaseEnd logs what happened to the traffic since phaseStart and what
// the datapath counted meanwhile (packets XDP left to TC, drops), and
// fails the test on a gap: a datapath drop, or a TCP retransmission on
// the client's connection (a packet lost anywhere, also where no counter
// sees it, as a redirect to a device that refuses XDP frames).
func phaseEnd(t *testing.T, d *daemon, tr *xdpTraffic, what string, p phaseCounters) {
	t.Helper()
	now := metrics(t, d)
	var delta []string
	drops := 0.0
	for k, v := range now {
		isDrop := strings.HasPrefix(k, "fluxvm_datapath_drops_total")
		if isDrop {
			drops += v - p.m[k]
		}
		if v-p.m[k] != 0 && (strings.Contains(k, "xdp_pass") || isDrop || k == xdpTranslated) {
			delta = append(delta, fmt.Sprintf("%s +%v", strings.TrimPrefix(k, "fluxvm_datapath_"), v-p.m[k]))
		}
	}
	retrans := retransmissions(t, tr.tcp) - p.retrans
	t.Logf("%s: %v: %d echoes (slowest %v, %d TCP retransmissions), %d UDP answers; %d echoes failed, %d UDP requests lost; counters: %s",
		what, time.Since(p.at).Round(time.Millisecond), tr.echoes.Load()-p.echoes, time.Duration(tr.slowest.Load()).Round(time.Millisecond), retrans,
		tr.answers.Load()-p.answers, tr.failed.Load()-p.failed, tr.lost.Load()-p.lost, strings.Join(delta, ", "))
	if drops != 0 || retrans != 0 {
		t.Errorf("%s: a gap: %v datapath drops, %d TCP retransmissions", what, drops, retrans)
	}
}

// ourXDP checks that the XDP program on the uplink (ifindex, in the lab's
// node) is FluxVM's: the link pinned under the pin root for that
// interface runs it, in native mode, and it is fluxvm_xdp_ns. With pid
// set, that process holds the program open (it is the daemon's). It
// returns the link's and the program's ids.
func ourXDP(t *testing.T, l *lab.Lab, pinRoot string, ifindex, pid int) (link.ID, ebpf.ProgramID) {
	t.Helper()
	pin := filepath.Join(pinRoot, "links", fmt.Sprintf("xdp_%d", ifindex))
	pl, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		t.Fatalf("the XDP link pin: %v", err)
	}
	defer pl.Close()
	info, err := pl.Info()
	if err != nil {
		t.Fatal(err)
	}
	if x := info.XDP(); x == nil || int(x.Ifindex) != ifindex {
		t.Errorf("%s is not an XDP link on ifindex %d: %+v", pin, ifindex, info)
	}
	var attached netlink.LinkXdp
	err = l.Node.Do(func() error {
		up, err := netlink.LinkByIndex(ifindex)
		if err == nil && up.Attrs().Xdp != nil {
			attached = *up.Attrs().Xdp
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if !attached.Attached || ebpf.ProgramID(attached.ProgId) != info.Program || attached.AttachMode != 1 /* XDP_ATTACHED_DRV */ {
		t.Errorf("the uplink runs XDP %+v, want the pinned link's program %d in native mode", attached, info.Program)
	}
	p, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if pi, err := p.Info(); err != nil || pi.Name != "fluxvm_xdp_ns" {
		t.Errorf("the pinned XDP link runs %+v (%v), want fluxvm_xdp_ns", pi, err)
	}
	if pid != 0 && !holdsProgram(t, pid, info.Program) {
		t.Errorf("the daemon (pid %d) does not hold the program %d that runs on the uplink", pid, info.Program)
	}
	return info.ID, info.Program
}

// holdsProgram reports whether process pid has the BPF program id open.
func holdsProgram(t *testing.T, pid int, id ebpf.ProgramID) bool {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fdinfo", pid)
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("\nprog_id:\t%d\n", id)
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err == nil && bytes.Contains(b, []byte(want)) {
			return true
		}
	}
	return false
}

// waitUntil polls cond every 10 ms until it holds or the timeout passes.
func waitUntil(timeout time.Duration, cond func() bool) bool {
	for end := time.Now().Add(timeout); ; time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(end) {
			return false
		}
	}
}

// xdpTraffic is the external client's traffic through the VIP: echoes on
// one long-lived TCP connection and UDP requests from one client port,
// each in a loop of its own, and what became of them.
type xdpTraffic struct {
	tcp        *lab.Conn
	udp        *net.UDPConn
	udpBackend string
	stop       chan struct{}
	wg         sync.WaitGroup
	once       sync.Once
	res        string

	echoes, failed, answers, lost, wrong atomic.Int64
	// slowest is the longest echo since it was last reset: a TCP
	// retransmission (a packet lost on the way) shows as 200 ms or more.
	slowest atomic.Int64

	mu     sync.Mutex
	errors []string
}

func (tr *xdpTraffic) fail(format string, args ...any) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if len(tr.errors) < 20 {
		tr.errors = append(tr.errors, time.Now().Format("15:04:05.000 ")+fmt.Sprintf(format, args...))
	}
}

func (tr *xdpTraffic) start() {
	tr.wg.Add(2)
	go tr.tcpLoop()
	go tr.udpLoop()
}

func (tr *xdpTraffic) stopped() bool {
	select {
	case <-tr.stop:
		return true
	default:
		return false
	}
}

func (tr *xdpTraffic) tcpLoop() {
	defer tr.wg.Done()
	for n := 0; !tr.stopped(); n++ {
		began := time.Now()
		if err := tr.tcp.Echo([]byte(fmt.Sprintf("echo %d\n", n)), 3*time.Second); err != nil {
			tr.failed.Add(1)
			tr.fail("echo %d on the connection to %s: %v", n, tr.tcp.Backend, err)
			return // the connection is broken
		}
		tr.echoes.Add(1)
		if d := int64(time.Since(began)); d > tr.slowest.Load() {
			tr.slowest.Store(d)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ask sends request n (-1: a first one, outside the loop) and returns the
// name of the backend that answered it; answers to earlier requests that
// come late are skipped.
func (tr *xdpTraffic) ask(n int, timeout time.Duration) (string, error) {
	msg := fmt.Sprintf("req %d", n)
	tr.udp.SetDeadline(time.Now().Add(timeout))
	if _, err := tr.udp.Write([]byte(msg)); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	for {
		k, err := tr.udp.Read(buf)
		if err != nil {
			return "", err
		}
		if name, got, _ := strings.Cut(string(buf[:k]), "\n"); got == msg {
			return name, nil
		}
	}
}

func (tr *xdpTraffic) udpLoop() {
	defer tr.wg.Done()
	for n := 0; !tr.stopped(); n++ {
		name, err := tr.ask(n, time.Second)
		switch {
		case err != nil:
			tr.lost.Add(1)
			tr.fail("UDP request %d: %v", n, err)
		case name != tr.udpBackend:
			tr.wrong.Add(1)
			tr.fail("UDP request %d answered by %s, want %s", n, name, tr.udpBackend)
		default:
			tr.answers.Add(1)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// progress waits until both loops moved on by a few rounds from now, and
// fails the test when they do not within 10 s or traffic failed.
func (tr *xdpTraffic) progress(t *testing.T, when string) {
	t.Helper()
	e, u := tr.echoes.Load(), tr.answers.Load()
	if !waitUntil(10*time.Second, func() bool {
		return tr.echoes.Load() >= e+50 && tr.answers.Load() >= u+20 || tr.failed.Load() > 0
	}) || tr.failed.Load() > 0 {
		t.Fatalf("%s: traffic stalled or failed: echoes %d -> %d, UDP answers %d -> %d\n%s", when, e, tr.echoes.Load(), u, tr.answers.Load(), tr.report())
	}
}

func (tr *xdpTraffic) report() string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return fmt.Sprintf("%d echoes, %d failed; %d UDP answers, %d lost, %d from another backend\n%s",
		tr.echoes.Load(), tr.failed.Load(), tr.answers.Load(), tr.lost.Load(), tr.wrong.Load(), strings.Join(tr.errors, "\n"))
}

// finish stops the loops (once) and returns the report.
func (tr *xdpTraffic) finish() string {
	tr.once.Do(func() {
		close(tr.stop)
		tr.wg.Wait()
		tr.res = tr.report()
	})
	return tr.res
}
