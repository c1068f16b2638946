//go:build linux

package fluxvm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/internal/testutils/daemontest"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// httpBackend is an HTTP server in a lab VM that answers "<vm> <path>" and
// remembers the peers it saw.
type httpBackend struct {
	vm    *lab.VM
	srv   *http.Server
	mu    sync.Mutex
	peers map[netip.Addr]int // requests by peer address
}

func serveHTTP(t *testing.T, vm *lab.VM, port uint16) *httpBackend {
	t.Helper()
	b := &httpBackend{vm: vm, peers: map[netip.Addr]int{}}
	var ln net.Listener
	if err := vm.NS.Do(func() (err error) {
		ln, err = net.Listen("tcp", fmt.Sprintf(":%d", port))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	b.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if ap, err := netip.ParseAddrPort(r.RemoteAddr); err == nil {
			b.mu.Lock()
			b.peers[ap.Addr().Unmap()]++
			b.mu.Unlock()
		}
		fmt.Fprintf(w, "%s %s", vm.Name, r.URL.Path)
	}), ReadHeaderTimeout: 5 * time.Second}
	go b.srv.Serve(ln)
	t.Cleanup(func() { b.srv.Close() })
	return b
}

func (b *httpBackend) seen() map[netip.Addr]int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return maps.Clone(b.peers)
}

// httpClient makes requests from inside a lab VM, one connection each.
func httpClient(vm *lab.VM, timeout time.Duration) *http.Client {
	dial := func(ctx context.Context, network, addr string) (c net.Conn, err error) {
		err = vm.NS.Do(func() error {
			c, err = (&net.Dialer{Timeout: timeout}).DialContext(ctx, network, addr)
			return err
		})
		return c, err
	}
	return &http.Client{Timeout: timeout, Transport: &http.Transport{DisableKeepAlives: true, DialContext: dial}}
}

// get returns the status, body and proxy header of GET url.
func get(c *http.Client, url string) (int, string, string, error) {
	resp, err := c.Get(url)
	if err != nil {
		return 0, "", "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), resp.Header.Get("X-Fluxvm-L7-Proxy"), err
}

// proxyNamespace makes vm's namespace take packets addressed to vips that
// come in on eth0 (the node hands them over untranslated) while its own
// connections to the vips still leave for the node: the vips are local in
// a routing table that only packets from eth0 consult.
func proxyNamespace(t *testing.T, vm *lab.VM, vips ...netip.Addr) {
	t.Helper()
	h, err := netlink.NewHandleAt(vm.NS.Handle())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	const table = 100
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		r := netlink.NewRule()
		r.Family, r.IifName, r.Table, r.Priority = fam, "eth0", table, 100
		if err := h.RuleAdd(r); err != nil {
			t.Fatalf("proxy namespace: rule: %v", err)
		}
	}
	for _, v := range vips {
		dst := &net.IPNet{IP: v.AsSlice(), Mask: net.CIDRMask(v.BitLen(), v.BitLen())}
		rt := &netlink.Route{Dst: dst, LinkIndex: lo.Attrs().Index, Table: table, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST}
		if err := h.RouteAdd(rt); err != nil {
			t.Fatalf("proxy namespace: local route for %s: %v", v, err)
		}
	}
}

// startProxy runs the l7proxy example in vm's namespace on the document.
func startProxy(t *testing.T, bin string, vm *lab.VM, doc EnvoyDocument) {
	t.Helper()
	raw, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "envoy.json")
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", vm.NS.Name, bin, "-doc", path)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(unix.SIGTERM)
		cmd.Wait()
	})
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "l7proxy: serving") {
				ready <- sc.Text()
			}
		}
		io.Copy(io.Discard, out)
	}()
	select {
	case line := <-ready:
		t.Log(line)
	case <-time.After(10 * time.Second):
		t.Fatalf("the proxy did not start: %s", stderr.String())
	}
}

// vipURL is the URL of path on port 80 of vip.
func vipURL(vip netip.Addr, path string) string {
	return "http://" + netip.AddrPortFrom(vip, 80).String() + path
}

// TestL7EnforceLab: L7 enforce end to end with a real proxy process (the
// l7proxy example, configured from the service's Envoy document) in its
// own namespace behind the proxy interface, real clients and HTTP
// backends. Allowed paths reach a backend through the VIP — the proxy
// sends them on to the VIP, and the node load-balances them (the bypass);
// other paths get the proxy's 403; a denied identity never reaches the
// proxy; the counters show one redirected flow per client connection (no
// loop), also while the control plane churns; back in observe mode new
// connections go straight to the backends.
func TestL7EnforceLab(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := daemontest.BuildCommand(t, "./examples/l7proxy")
	l := lab.NewForTest(t)
	cli := l.AddVMForTest(t, 1)
	var backends []*httpBackend
	for i := 2; i <= 3; i++ {
		backends = append(backends, serveHTTP(t, l.AddVMForTest(t, i), 8080))
	}
	denied := l.AddVMForTest(t, 4)
	px := l.AddVMForTest(t, 9)
	proxyNamespace(t, px, vip4, vip6)
	var ifs []VMEdgeInterface
	for _, vm := range l.VMs {
		ifs = append(ifs, VMEdgeInterface{Name: vm.NodeIf, VMID: vm.Name})
	}
	d, err := Open(context.Background(), Options{
		Loader:              bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierS},
		CatalogPath:         filepath.Join(t.TempDir(), "catalog.json"),
		ConntrackGCInterval: -1,
		VMEdgeInterfaces:    ifs,
		InNamespace:         l.Node.Do,
		FlowSampleRate:      1,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	ctx := context.Background()
	svc := Service{Name: "web", VIPs: []netip.Addr{vip4, vip6}, Ports: []ServicePort{{Port: 80, Protocol: TCP}}}
	for _, b := range backends {
		for _, a := range []netip.Addr{b.vm.Addr4, b.vm.Addr6} {
			svc.Backends = append(svc.Backends, Backend{Address: a, Port: 8080, Weight: u32(1)})
		}
	}
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	ipc := IPCache{Entries: []IPCacheEntry{
		{Prefix: netip.PrefixFrom(cli.Addr4, 32), Identity: 1001}, {Prefix: netip.PrefixFrom(cli.Addr6, 128), Identity: 1001},
		{Prefix: netip.PrefixFrom(denied.Addr4, 32), Identity: 2001}, {Prefix: netip.PrefixFrom(denied.Addr6, 128), Identity: 2001},
	}}
	// Default deny, the client allowed: the proxy's own address has no
	// identity (unknown, denied) and still reaches the backends through
	// the VIP (the bypass).
	pol := Policy{Service: "web", DefaultAction: PolicyDeny, AllowIdentities: []Identity{1001},
		L7: &L7Policy{Mode: L7Enforce, Protocol: L7HTTP, ProxyInterface: px.NodeIf, PathPrefixes: []string{"/api/"}}}
	if _, err := d.ReconcilePolicies(ctx, ipc, []Policy{pol}); err != nil {
		t.Fatal(err)
	}
	doc, err := d.Envoy("web")
	if err != nil {
		t.Fatal(err)
	}
	startProxy(t, bin, px, doc)

	c := httpClient(cli, 3*time.Second)
	counters := func() PolicyCounters {
		t.Helper()
		st, err := d.Policies(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return st.Counters
	}
	c0 := counters()
	conns, served := 0, 0
	request := func(vip netip.Addr, path string, want int) {
		t.Helper()
		conns++
		code, body, via, err := get(c, vipURL(vip, path))
		if err != nil || code != want {
			t.Fatalf("GET %s: %d %q, %v; want %d", vipURL(vip, path), code, body, err, want)
		}
		if want == http.StatusOK {
			served++
			if via != "web" || !strings.HasSuffix(body, " "+path) {
				t.Fatalf("GET %s: body %q, proxy header %q: want a backend's answer through the proxy", vipURL(vip, path), body, via)
			}
		}
	}
	for _, vip := range []netip.Addr{vip4, vip6} {
		for i := 0; i < 5; i++ {
			request(vip, fmt.Sprintf("/api/items/%d", i), http.StatusOK)
			request(vip, "/admin", http.StatusForbidden)
		}
	}
	// A denied identity's connection drops before the proxy sees it.
	if _, _, _, err := get(httpClient(denied, 700*time.Millisecond), vipURL(vip4, "/api/x")); err == nil {
		t.Error("a denied identity reached the service")
	}

	// The control plane churns while requests run: the policy's revision
	// moves (an ipcache change rechecks every flow), the backends'
	// weights change. Every allowed request still goes through.
	stop := make(chan struct{})
	churned := make(chan error, 1)
	go func() {
		var err error
		for i := 0; err == nil; i++ {
			select {
			case <-stop:
				churned <- nil
				return
			default:
			}
			next := ipc
			next.Entries = append(slices.Clone(ipc.Entries), IPCacheEntry{Prefix: netip.MustParsePrefix(fmt.Sprintf("10.77.%d.0/24", i%200)), Identity: 3001})
			if _, err = d.SetIPCache(ctx, next); err == nil {
				s := svc.Clone()
				s.Backends[i%len(s.Backends)].Weight = u32(uint32(1 + i%3))
				_, err = d.ApplyService(ctx, s)
			}
			time.Sleep(20 * time.Millisecond)
		}
		churned <- err
	}()
	for i := 0; i < 30; i++ {
		request([]netip.Addr{vip4, vip6}[i%2], fmt.Sprintf("/api/churn/%d", i), http.StatusOK)
	}
	close(stop)
	if err := <-churned; err != nil {
		t.Fatalf("churn: %v", err)
	}

	// No loop: one redirected flow per client connection; the backends
	// saw the proxy only, once per allowed request.
	c1 := counters()
	if n := c1.L7Redirected - c0.L7Redirected; n != uint64(conns) {
		t.Errorf("l7_redirected +%d for %d client connections", n, conns)
	}
	if p, err := d.Policy(context.Background(), "web"); err != nil || p.Counters.L7Redirected != uint64(conns) || p.Counters.Denied == 0 {
		t.Errorf("the service's policy counters %+v (%v): want %d redirected and the denied identity's SYNs", p.Counters, err, conns)
	}
	if c1.L7Bypass == c0.L7Bypass {
		t.Error("l7_bypass did not move: the proxy's requests did not come in on the proxy interface")
	}
	total := 0
	for _, b := range backends {
		for peer, n := range b.seen() {
			if peer != px.Addr4 && peer != px.Addr6 {
				t.Errorf("backend %s saw %s: want the proxy only", b.vm.Name, peer)
			}
			total += n
		}
	}
	if total != served {
		t.Errorf("backends served %d requests, the client got %d answers", total, served)
	}
	// FluxScope records the client's flows as redirected.
	recs, err := d.Flows(context.Background(), 4096, flows.Filter{Service: "web", Verdict: flows.Redirected})
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != conns {
		t.Errorf("%d flow records with verdict redirected, want %d", len(recs), conns)
	}

	// Observe: nothing redirected any more; new connections reach the
	// backends straight from the client.
	pol.L7.Mode = L7Observe
	if _, err := d.ApplyPolicies(ctx, pol); err != nil {
		t.Fatal(err)
	}
	code, _, via, err := get(c, vipURL(vip4, "/admin"))
	if err != nil || code != http.StatusOK || via != "" {
		t.Errorf("under observe: %d (proxy header %q), %v; want the backend's 200 straight", code, via, err)
	}
	if n := counters().L7Redirected - c1.L7Redirected; n != 0 {
		t.Errorf("observe redirected %d flows", n)
	}
	direct := false
	for _, b := range backends {
		if b.seen()[cli.Addr4] > 0 {
			direct = true
		}
	}
	if !direct {
		t.Error("under observe no backend saw the client")
	}
}

// TestL7ProxyInterfaceLifecycle: a proxy interface that goes away does not
// block other policy changes, a service's delete, or a restart; its
// services' new flows drop meanwhile (index 0, fail closed); attached
// again with a new index, the policy names it. And the interface must be
// a VM-edge veth whose peer is in another namespace.
func TestL7ProxyInterfaceLifecycle(t *testing.T) {
	e := newEnv(t)
	px := e.lab.AddVMForTest(t, 9)
	e.opts.VMEdgeInterfaces = append(e.opts.VMEdgeInterfaces, VMEdgeInterface{Name: px.NodeIf, VMID: px.Name})
	d := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 1, 1)
	svc.Ports = []ServicePort{{Port: 80, Protocol: TCP}}
	other := svc.Clone()
	other.Name, other.VIPs = "other", []netip.Addr{netip.MustParseAddr("10.96.0.11"), netip.MustParseAddr("fd00:96::11")}
	for _, s := range []Service{svc, other} {
		if _, err := d.ApplyService(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	web := Policy{Service: "web", DefaultAction: PolicyAllow, L7: &L7Policy{Mode: L7Enforce, Protocol: L7HTTP, ProxyInterface: px.NodeIf}}
	plain := Policy{Service: "other", DefaultAction: PolicyAllow}
	if _, err := d.ApplyPolicies(ctx, web, plain); err != nil {
		t.Fatal(err)
	}
	proxyIndex := func(d *Dataplane) uint32 {
		t.Helper()
		p, err := d.Policy(context.Background(), "web")
		if err != nil || p.ProxyIfindex == nil {
			t.Fatalf("policy %+v, %v: want a proxy index", p, err)
		}
		return *p.ProxyIfindex
	}
	if got := proxyIndex(d); got != uint32(px.NodeIfIndex) {
		t.Fatalf("proxy index %d, want %d", got, px.NodeIfIndex)
	}

	// A veth whose peer is in the node's namespace too cannot hand flows
	// over: refused, and nothing changes.
	nl, err := netlink.NewHandleAt(e.lab.Node.Handle())
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	if err := nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pxsame"}, PeerName: "pxsame-b"}); err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetUp(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pxsame"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.AddInterface(context.Background(), VMEdgeInterface{Name: "pxsame", VMID: "same"}); err != nil {
		t.Fatal(err)
	}
	bad := web
	bad.L7 = &L7Policy{Mode: L7Enforce, Protocol: L7HTTP, ProxyInterface: "pxsame"}
	if _, err := d.ApplyPolicies(ctx, bad); !errors.Is(err, ErrUnsupported) {
		t.Errorf("a proxy veth with its peer in the node's namespace: %v, want ErrUnsupported", err)
	}
	if got := proxyIndex(d); got != uint32(px.NodeIfIndex) {
		t.Errorf("proxy index %d after the refused apply, want %d", got, px.NodeIfIndex)
	}

	// The proxy's veth goes away.
	link, err := nl.LinkByName(px.NodeIf)
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkDel(link); err != nil {
		t.Fatal(err)
	}
	ipc := IPCache{Entries: []IPCacheEntry{{Prefix: netip.MustParsePrefix("10.200.1.0/24"), Identity: 1001}}}
	if _, err := d.SetIPCache(ctx, ipc); err != nil {
		t.Fatalf("an ipcache change with the proxy interface gone: %v", err)
	}
	if got := proxyIndex(d); got != 0 {
		t.Errorf("proxy index %d with the interface gone, want 0 (new flows drop)", got)
	}
	if err := d.DeleteService(ctx, "other"); err != nil {
		t.Fatalf("deleting another service with the proxy interface gone: %v", err)
	}
	// Applying the policy itself again names the interface: it must
	// resolve.
	if _, err := d.ApplyPolicies(ctx, web); !errors.Is(err, ErrPrerequisite) {
		t.Errorf("re-applying the policy with its interface gone: %v, want ErrPrerequisite", err)
	}
	// A new veth under the name, not attached: it has none of our
	// programs, so it is not the proxy interface yet.
	vh, err := netlink.NewHandleAt(px.NS.Handle())
	if err != nil {
		t.Fatal(err)
	}
	defer vh.Close()
	if err := nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: px.NodeIf}, PeerName: "eth1",
		PeerNamespace: netlink.NsFd(int(px.NS.Handle()))}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ApplyPolicies(ctx, web); !errors.Is(err, ErrPrerequisite) {
		t.Errorf("applying the policy toward a recreated veth not attached: %v, want ErrPrerequisite", err)
	}
	if _, err := d.SetIPCache(ctx, ipc); err != nil || proxyIndex(d) != 0 {
		t.Errorf("an ipcache change with the recreated veth not attached: %v, proxy index %d; want 0", err, proxyIndex(d))
	}
	// A restart without it: the policy is kept, failing closed, and
	// policy changes go on.
	d.Close()
	e.opts.VMEdgeInterfaces = e.opts.VMEdgeInterfaces[:len(e.opts.VMEdgeInterfaces)-1]
	d = e.open(t)
	if got := proxyIndex(d); got != 0 {
		t.Errorf("proxy index %d after a restart without the interface, want 0", got)
	}
	if _, err := d.SetIPCache(ctx, IPCache{}); err != nil {
		t.Fatalf("an ipcache change after the restart: %v", err)
	}
	// The new veth attached: the policy names it; detached, no more.
	st, err := d.AddInterface(context.Background(), VMEdgeInterface{Name: px.NodeIf, VMID: px.Name})
	if err != nil {
		t.Fatal(err)
	}
	if got := proxyIndex(d); got != uint32(st.Index) || st.Index == px.NodeIfIndex {
		t.Errorf("proxy index %d after the new veth was attached (index %d, the old one %d)", got, st.Index, px.NodeIfIndex)
	}
	if err := d.RemoveInterface(context.Background(), px.NodeIf); err != nil {
		t.Fatal(err)
	}
	if got := proxyIndex(d); got != 0 {
		t.Errorf("proxy index %d after the interface was detached, want 0", got)
	}
}
