package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/daemontest"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// requireBIRD returns the paths of bird and birdc (Debian package bird2).
// Without them the test skips, or fails under FLUXVM_REQUIRE_PRIVILEGED=1.
func requireBIRD(t *testing.T) (bird, birdc string) {
	t.Helper()
	find := func(name string) string {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
		for _, dir := range []string{"/usr/sbin", "/usr/local/sbin", "/sbin"} {
			if p := filepath.Join(dir, name); isExecutable(p) {
				return p
			}
		}
		return ""
	}
	bird, birdc = find("bird"), find("birdc")
	if bird != "" && birdc != "" {
		return bird, birdc
	}
	const msg = "BIRD 2 (bird and birdc, Debian package bird2) is not installed"
	if testenv.Required() {
		t.Fatalf("%s (%s=1 is set, so this fails instead of skipping; apt-get install bird2)", msg, testenv.RequireEnv)
	}
	t.Skipf("skipping: %s", msg)
	return "", ""
}

func isExecutable(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o111 != 0
}

// syncBuffer is a bytes.Buffer safe for a process and the test at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// birdDaemon is a BIRD running in a namespace with its own configuration
// and control socket.
type birdDaemon struct {
	name, birdc, socket string
	out                 *syncBuffer
}

// startBIRD runs bird in ns with conf, in the foreground, logging to its
// output, with its control socket at socket (in a temporary directory
// when empty); it is stopped when the test ends, and killed if the test
// process dies first. Started from a thread inside the namespace, it
// keeps the test's mount namespace, so its control socket is a file of
// the test's temporary directory.
func startBIRD(t *testing.T, ns *nsutil.NS, bird, birdc, name, conf, socket string) *birdDaemon {
	t.Helper()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "bird.conf")
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	if socket == "" {
		socket = filepath.Join(dir, "bird.ctl")
	}
	b := &birdDaemon{name: name, birdc: birdc, socket: socket, out: &syncBuffer{}}
	cmd := exec.Command(bird, "-f", "-c", cfg, "-s", b.socket, "-P", filepath.Join(dir, "bird.pid"))
	cmd.Stdout, cmd.Stderr = b.out, b.out
	// Killed by the kernel if the test process dies without its cleanup
	// (a SIGKILL, a timeout's panic). The parent-death signal fires when
	// the thread that started bird exits, so bird is started from a
	// thread of its own, locked for good, that waits for it: it lives as
	// long as bird. The thread enters ns, so bird lives there but keeps
	// the test's mount namespace.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	started, done := make(chan error, 1), make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
		if err := netns.Set(ns.Handle()); err != nil {
			started <- err
			return
		}
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		done <- cmd.Wait()
	}()
	if err := <-started; err != nil {
		t.Fatalf("start %s bird: %v", name, err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Errorf("%s bird did not stop on SIGTERM", name)
		}
		if t.Failed() {
			t.Logf("%s bird output:\n%s", name, b.out)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, err := b.cmd("show status")
		if err == nil && strings.Contains(out, "Daemon is up and running") {
			return b
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s bird did not come up: %v %s\n%s", name, err, out, b.out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (b *birdDaemon) cmd(command string) (string, error) {
	out, err := exec.Command(b.birdc, append([]string{"-s", b.socket}, strings.Fields(command)...)...).CombinedOutput()
	return string(out), err
}

// The lab's addresses: the node's uplink faces the router ("ext").
var (
	nodeUp4, nodeUp6     = netip.MustParseAddr("10.250.0.1"), netip.MustParseAddr("fd00:250::1")
	routerUp4, routerUp6 = netip.MustParseAddr("10.250.0.2"), netip.MustParseAddr("fd00:250::2")
)

const (
	nodeAS, routerAS = 65001, 65000
	labToken         = "test-admin-token-0123456789"
)

// nodeBIRDConf is the node's bird.conf: the adapter's include file, and
// eBGP sessions to the router that export only its static protocols. No
// kernel protocol: the blackhole routes stay out of the node's table.
func nodeBIRDConf(include string) string {
	return fmt.Sprintf(`log stderr all;
router id %[1]s;
protocol device { }
include %[3]q;
template bgp uplink {
	local as %[4]d;
	connect delay time 1;
	connect retry time 1;
	error wait time 1, 2;
}
protocol bgp router4 from uplink {
	neighbor %[5]s as %[7]d;
	source address %[1]s;
	ipv4 { import none; export where proto = "fluxvm_vips4"; };
}
protocol bgp router6 from uplink {
	neighbor %[6]s as %[7]d;
	source address %[2]s;
	ipv6 { import none; export where proto = "fluxvm_vips6"; };
}
`, nodeUp4, nodeUp6, include, nodeAS, routerUp4, routerUp6, routerAS)
}

// routerBIRDConf is the upstream router: it learns from the node over
// eBGP and installs what it learns in its kernel table.
func routerBIRDConf() string {
	return fmt.Sprintf(`log stderr all;
router id %[1]s;
protocol device { }
protocol kernel { ipv4 { export all; }; }
protocol kernel { ipv6 { export all; }; }
template bgp node {
	local as %[3]d;
	connect delay time 1;
	connect retry time 1;
	error wait time 1, 2;
}
protocol bgp node4 from node {
	neighbor %[4]s as %[6]d;
	source address %[1]s;
	ipv4 { import all; export none; };
}
protocol bgp node6 from node {
	neighbor %[5]s as %[6]d;
	source address %[2]s;
	ipv6 { import all; export none; };
}
`, routerUp4, routerUp6, routerAS, nodeUp4, nodeUp6, nodeAS)
}

// routerRoutes returns the host routes of want present in the router's
// kernel table, with their gateways.
func routerRoutes(t *testing.T, h *netlink.Handle, want []netip.Prefix) map[netip.Prefix]net.IP {
	t.Helper()
	got := map[netip.Prefix]net.IP{}
	routes, err := h.RouteList(nil, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatalf("router routes: %v", err)
	}
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		a, ok := netip.AddrFromSlice(r.Dst.IP)
		if !ok {
			continue
		}
		ones, _ := r.Dst.Mask.Size()
		p := netip.PrefixFrom(a.Unmap(), ones)
		for _, w := range want {
			if p == w {
				got[p] = r.Gw
			}
		}
	}
	return got
}

// TestBIRDLab announces FluxVM's VIPs over real eBGP: fluxvmd in the lab's
// node namespace publishes the snapshot, the adapter turns it into the
// node BIRD's static routes, and a second BIRD, the upstream router in
// the "ext" namespace behind the north-south interface, installs what it
// learns in its kernel table. The test measures how long the router keeps
// routing a VIP to the node after the VIP's only backend stops listening.
func TestBIRDLab(t *testing.T) {
	testenv.RequirePrivileged(t)
	birdBin, birdcBin := requireBIRD(t)
	daemonBin := daemontest.Build(t)
	l := lab.NewForTest(t)
	be := l.AddVMForTest(t, 1)
	router, err := l.AddExternal()
	if err != nil {
		t.Fatal(err)
	}
	// Two services on the one backend VM, each with its own port, so
	// that one can fail while the other stays advertised.
	web, err := be.Serve(8080)
	if err != nil {
		t.Fatal(err)
	}
	api, err := be.Serve(9090)
	if err != nil {
		web.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { web.Close(); api.Close() })

	dir := t.TempDir()
	advPath := filepath.Join(dir, "run", "service-advertisements.json")
	include := filepath.Join(dir, "etc", "fluxvm-vips.conf")
	cfg := filepath.Join(dir, "fluxvmd.toml")
	conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = "S"
pin_root = %q
catalog_path = %q
advertisements_path = %q
node_name = "bird-lab"
vm_edge_interfaces = [ { name = "vm1", vm_id = "backend" } ]
north_south_interfaces = ["uplink"]
snat_address = "10.250.0.100"
snat_address_v6 = "fd00:250::100"
snat_port_min = 62000
snat_port_max = 62999
`, filepath.Join(testenv.PinRoot(t), "service"), filepath.Join(dir, "catalog.json"), advPath)
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	d := daemontest.Start(t, daemonBin, cfg, l, labToken)

	// The adapter, started before BIRD as at boot: it writes the include
	// file (no routes yet) and configures BIRD once BIRD answers. It runs
	// in the test process (run, as main calls it): it needs only the two
	// files and BIRD's control socket, none of them tied to a network
	// namespace.
	const pollEvery, retryEvery = 200 * time.Millisecond, 500 * time.Millisecond
	nodeSock := filepath.Join(t.TempDir(), "node-bird.ctl")
	adapterOut := &syncBuffer{}
	ctx, cancel := context.WithCancel(context.Background())
	adapterDone := make(chan int, 1)
	go func() {
		adapterDone <- run(ctx, []string{"-snapshot", advPath, "-output", include, "-birdc", birdcBin,
			"-socket", nodeSock, "-interval", pollEvery.String(), "-retry", retryEvery.String()}, adapterOut)
	}()
	t.Cleanup(func() {
		cancel()
		if code := <-adapterDone; code != 0 {
			t.Errorf("adapter exited %d", code)
		}
		if t.Failed() {
			t.Logf("adapter output:\n%s", adapterOut)
		}
	})
	waitFor(t, 10*time.Second, "the adapter's include file", func() bool { _, err := os.Stat(include); return err == nil })

	nodeBird := startBIRD(t, l.Node, birdBin, birdcBin, "node", nodeBIRDConf(include), nodeSock)
	routerBird := startBIRD(t, router.NS, birdBin, birdcBin, "router", routerBIRDConf(), "")
	rh, err := netlink.NewHandleAt(router.NS.Handle())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rh.Close)

	// Health checks every 500 ms with a 200 ms timeout; two failures in
	// a row make a backend unhealthy.
	hc := &fluxvm.HealthCheck{Kind: "tcp", TimeoutMs: 200, IntervalMs: 500, UnhealthyThreshold: 2, HealthyThreshold: 2}
	service := func(name string, vip4, vip6 string, port uint16, advertise bool) fluxvm.Service {
		return fluxvm.Service{
			Name: name, Exposure: fluxvm.ExposureNorthSouth, Advertise: advertise, HealthCheck: hc,
			VIPs:     []netip.Addr{netip.MustParseAddr(vip4), netip.MustParseAddr(vip6)},
			Ports:    []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
			Backends: []fluxvm.Backend{{Address: be.Addr4, Port: port}, {Address: be.Addr6, Port: port}},
		}
	}
	webSvc := service("web", "10.96.0.10", "fd00:96::10", 8080, true)
	apiSvc := service("api", "10.96.0.20", "fd00:96::20", 9090, true)
	for _, s := range []fluxvm.Service{webSvc, apiSvc} {
		if _, err := d.Request("POST", "/v1/network/services", s); err != nil {
			t.Fatal(err)
		}
	}
	webPfx := []netip.Prefix{netip.MustParsePrefix("10.96.0.10/32"), netip.MustParsePrefix("fd00:96::10/128")}
	apiPfx := []netip.Prefix{netip.MustParsePrefix("10.96.0.20/32"), netip.MustParsePrefix("fd00:96::20/128")}
	all := append(append([]netip.Prefix{}, webPfx...), apiPfx...)

	// The router learns every advertised VIP (BGP sessions come up
	// first, so the bound is generous).
	start := time.Now()
	waitFor(t, 30*time.Second, "the router to learn the four VIPs", func() bool { return len(routerRoutes(t, rh, all)) == 4 })
	t.Logf("router learned %v within %v of the apply (BGP sessions starting)", all, time.Since(start).Round(time.Millisecond))
	// Every route goes via the node: its uplink address, or for IPv6
	// the uplink's link-local address (BIRD installs the link-local next
	// hop an eBGP neighbour on the link sends along with the global one).
	nodeLL := uplinkLinkLocal(t, l.Node)
	got := routerRoutes(t, rh, all)
	for _, p := range all {
		switch gw := got[p]; {
		case p.Addr().Is4() && !gw.Equal(nodeUp4.AsSlice()):
			t.Errorf("router routes %s via %v, want the node %s", p, gw, nodeUp4)
		case p.Addr().Is6() && !gw.Equal(nodeUp6.AsSlice()) && (nodeLL == nil || !gw.Equal(nodeLL)):
			t.Errorf("router routes %s via %v, want the node %s or %v", p, gw, nodeUp6, nodeLL)
		}
	}
	out, _ := routerBird.cmd("show route all 10.96.0.10/32")
	if !strings.Contains(out, fmt.Sprintf("BGP.as_path: %d", nodeAS)) {
		t.Errorf("router's BIRD: %s", out)
	}
	if out, _ := nodeBird.cmd("show route protocol fluxvm_vips6"); !strings.Contains(out, "fd00:96::10/128") || !strings.Contains(out, "fd00:96::20/128") {
		t.Errorf("node's BIRD: %s", out)
	}

	// Backend failure: web's listener closes; its health check fails
	// and the snapshot withdraws web's VIPs; the adapter reconfigures the
	// node's BIRD, which withdraws them from the router.
	failed := time.Now()
	if err := web.Close(); err != nil {
		t.Fatal(err)
	}
	snapAt, fileAt, routerAt := waitWithdrawn(t, rh, advPath, include, "web", webPfx, apiPfx, failed)
	// What dominates: up to UnhealthyThreshold intervals until the
	// second failed check (a connect to a closed port fails at once, the
	// timeout is the worst case), then one adapter poll; publish, birdc
	// configure and the BGP UPDATE take milliseconds. The bound is twice
	// that plus 1 s for a loaded machine.
	expected := time.Duration(hc.UnhealthyThreshold)*time.Duration(hc.IntervalMs)*time.Millisecond + time.Duration(hc.TimeoutMs)*time.Millisecond + pollEvery
	bound := 2*expected + time.Second
	t.Logf("backend failure -> snapshot withdrawn %v, include file rewritten %v, route gone from the router %v (health check interval %dms, timeout %dms, unhealthy threshold %d, adapter poll %v: expected about %v or less; bound %v)",
		snapAt.Round(time.Millisecond), fileAt.Round(time.Millisecond), routerAt.Round(time.Millisecond), hc.IntervalMs, hc.TimeoutMs, hc.UnhealthyThreshold, pollEvery, expected, bound)
	if routerAt > bound {
		t.Errorf("route left the router %v after the backend failed, bound %v (2 × expected %v + 1s)", routerAt, bound, expected)
	}

	// The backend comes back: advertised again.
	web, err = be.Serve(8080)
	if err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	waitFor(t, 15*time.Second, "the router to learn web's VIPs again", func() bool { return len(routerRoutes(t, rh, all)) == 4 })
	t.Logf("backend back -> router learned web's VIPs again after %v", time.Since(back).Round(time.Millisecond))

	// advertise: false withdraws too, with the backend healthy.
	webSvc.Advertise = false
	asked := time.Now()
	if _, err := d.Request("POST", "/v1/network/services", webSvc); err != nil {
		t.Fatal(err)
	}
	snapAt, fileAt, routerAt = waitWithdrawn(t, rh, advPath, include, "web", webPfx, apiPfx, asked)
	// No health check to wait for: the next adapter poll withdraws it.
	bound = pollEvery + time.Second
	t.Logf("advertise=false -> snapshot withdrawn %v, include file rewritten %v, route gone from the router %v (adapter poll %v; bound %v)",
		snapAt.Round(time.Millisecond), fileAt.Round(time.Millisecond), routerAt.Round(time.Millisecond), pollEvery, bound)
	if routerAt > bound {
		t.Errorf("route left the router %v after advertise=false, bound %v (poll + 1s)", routerAt, bound)
	}
	if s, err := advert.Read(advPath); err != nil || !hasReason(s, "web", advert.ReasonAdvertiseFalse) {
		t.Errorf("snapshot after advertise=false: %+v (%v)", s, err)
	}
	if strings.Contains(adapterOut.String(), "level=ERROR") && !strings.Contains(adapterOut.String(), "not reachable") {
		t.Errorf("adapter reported errors other than BIRD not running yet:\n%s", adapterOut)
	}
}

// uplinkLinkLocal is the IPv6 link-local address of the node's uplink
// (nil when it has none).
func uplinkLinkLocal(t *testing.T, node *nsutil.NS) net.IP {
	t.Helper()
	h, err := netlink.NewHandleAt(node.Handle())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	link, err := h.LinkByName("uplink")
	if err != nil {
		t.Fatal(err)
	}
	addrs, err := h.AddrList(link, netlink.FAMILY_V6)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if a.IP.IsLinkLocalUnicast() {
			return a.IP
		}
	}
	return nil
}

// waitWithdrawn polls the snapshot and the router's table every 10 ms
// until service's prefixes are withdrawn in the first and gone from the
// second, and returns both delays from since, and when the adapter last
// wrote include (its mtime). The other prefixes must stay on the router
// meanwhile.
func waitWithdrawn(t *testing.T, rh *netlink.Handle, advPath, include, service string, gone, stay []netip.Prefix, since time.Time) (snapAt, fileAt, routerAt time.Duration) {
	t.Helper()
	deadline := since.Add(30 * time.Second)
	for snapAt == 0 || routerAt == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%s not withdrawn within 30s (snapshot after %v, router after %v)", service, snapAt, routerAt)
		}
		if snapAt == 0 {
			if s, err := advert.Read(advPath); err == nil && !advertises(s, service) {
				snapAt = time.Since(since)
			}
		}
		if routerAt == 0 && len(routerRoutes(t, rh, gone)) == 0 {
			routerAt = time.Since(since)
		}
		if got := routerRoutes(t, rh, stay); len(got) != len(stay) {
			t.Fatalf("withdrawing %s took %v from the router too (left %v)", service, stay, got)
		}
		time.Sleep(10 * time.Millisecond)
	}
	st, err := os.Stat(include)
	if err != nil {
		t.Fatal(err)
	}
	return snapAt, st.ModTime().Sub(since), routerAt
}

func advertises(s advert.Snapshot, service string) bool {
	for _, e := range s.Entries {
		if e.Service == service && e.Advertised {
			return true
		}
	}
	return false
}

func hasReason(s advert.Snapshot, service string, r advert.Reason) bool {
	n := 0
	for _, e := range s.Entries {
		if e.Service == service {
			if e.Reason != r {
				return false
			}
			n++
		}
	}
	return n > 0
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
