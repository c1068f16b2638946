//go:build linux

package scenario

// End-to-end tests of the north-south edge: the external client "ext"
// behind the node's "uplink" reaches the service's VIPs through the
// fluxvm_ns_in/fluxvm_ns_out programs, by NAT with SNAT (the backend sees
// the node's SNAT address, replies come back through the node) and by
// routed DSR (the backend holds the VIP and answers the client directly).

import (
	"context"
	"net/netip"
	"slices"
	"testing"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// The lab's SNAT addresses. No interface holds them: the VM backends'
// replies reach the node by their default route and are translated on the
// VM edge before the node would route them.
var (
	nsSNAT4 = netip.MustParseAddr("10.254.0.1")
	nsSNAT6 = netip.MustParseAddr("fd00:254::1")
)

// nsNewEnv is an Env whose "uplink" is a north-south interface, with the
// lab's SNAT addresses.
func nsNewEnv(t *testing.T, backends int) *Env {
	t.Helper()
	return e2eNewEnvConfig(t, backends, func(c *fluxvm.Config) {
		c.NorthSouthInterfaces = []string{"uplink"}
		c.SNATAddress = nsSNAT4
		c.SNATAddressV6 = nsSNAT6
	})
}

// nsTraffic sends TCP and UDP from vm to vip:80 until every backend in
// want answered at least once (bounded attempts), with an echo over each
// TCP connection, and returns who answered.
func nsTraffic(t *testing.T, vm *lab.VM, vip netip.Addr, want []string) {
	t.Helper()
	dst := netip.AddrPortFrom(vip, 80)
	seen := map[string]bool{}
	for i := 0; i < 60 && len(seen) < 2*len(want); i++ {
		c, err := vm.DialTCP(dst, e2eOK)
		if err != nil {
			t.Fatalf("tcp %s -> %s: %v", vm.Name, dst, err)
		}
		if !slices.Contains(want, c.Backend) {
			t.Fatalf("tcp %s -> %s answered by %q, want one of %v", vm.Name, dst, c.Backend, want)
		}
		if err := c.Echo([]byte("north-south"), e2eOK); err != nil {
			t.Fatalf("tcp echo via %s: %v", c.Backend, err)
		}
		c.Close()
		seen["tcp/"+c.Backend] = true

		u, err := e2eDialUDP(vm, dst, 0)
		if err != nil {
			t.Fatal(err)
		}
		name, err := u.Ask(e2eOK)
		u.Close()
		if err != nil {
			t.Fatalf("udp %s -> %s: %v", vm.Name, dst, err)
		}
		if !slices.Contains(want, name) {
			t.Fatalf("udp %s -> %s answered by %q, want one of %v", vm.Name, dst, name, want)
		}
		seen["udp/"+name] = true
	}
	if len(seen) < 2*len(want) {
		t.Errorf("%s -> %s: answered %v, want TCP and UDP from each of %v", vm.Name, dst, seen, want)
	}
}

// nsPeers is what the backends saw as clients, by address.
func nsPeers(e *Env) map[netip.Addr][]netip.AddrPort {
	out := map[netip.Addr][]netip.AddrPort{}
	for _, s := range e.servers {
		for _, p := range s.Peers() {
			out[p.Addr()] = append(out[p.Addr()], p)
		}
	}
	return out
}

// nsCounters reads the datapath's event counters by name.
func nsCounters(t *testing.T, e *Env) map[string]uint64 {
	t.Helper()
	st, err := e.DP.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return st.Parser
}

// TestE2ENorthSouthNAT: a service exposed both ways. The external client
// reaches it by DNAT + SNAT (the backends see the SNAT address and a port
// in the configured range, never the client), a client VM reaches it
// east-west with its own address, over IPv4 and IPv6, TCP and UDP. A
// north-south-only service is not served on the VM edge.
func TestE2ENorthSouthNAT(t *testing.T) {
	e := nsNewEnv(t, 2)
	svc := e.Service("web", nil)
	svc.Exposure = fluxvm.ExposureBoth
	e2eApply(t, e, svc)
	names := []string{e.Backends[0].Name, e.Backends[1].Name}
	cfg := fluxvm.DefaultConfig()

	for _, fam := range e2eFamilies {
		t.Run(fam.name, func(t *testing.T) {
			snat := nsSNAT4
			ext, client := e.Lab.External.Addr4, e.Client.Addr4
			if fam.vip.Is6() {
				snat, ext, client = nsSNAT6, e.Lab.External.Addr6, e.Client.Addr6
			}
			nsTraffic(t, e.Lab.External, fam.vip, names)
			nsTraffic(t, e.Client, fam.vip, names)
			peers := nsPeers(e)
			if len(peers[ext]) != 0 {
				t.Errorf("backends saw the external client itself: %v", peers[ext])
			}
			if len(peers[snat]) == 0 {
				t.Fatalf("backends never saw the SNAT address %s; peers %v", snat, peers)
			}
			for _, p := range peers[snat] {
				if int(p.Port()) < cfg.SNATPortMin || int(p.Port()) > cfg.SNATPortMax {
					t.Errorf("SNAT port %d outside %d-%d", p.Port(), cfg.SNATPortMin, cfg.SNATPortMax)
				}
			}
			if len(peers[client]) == 0 {
				t.Errorf("east-west flows were translated at the source too: peers %v", peers)
			}
		})
	}

	// North-south only: the VM edge leaves the VIP alone (nothing routes
	// it, so the VM's connection fails), the external client still works.
	svc.Exposure = fluxvm.ExposureNorthSouth
	e2eApply(t, e, svc)
	for _, fam := range e2eFamilies {
		if c, err := e.Client.DialTCP(netip.AddrPortFrom(fam.vip, 80), e2eFail); err == nil {
			c.Close()
			t.Errorf("%s: a VM reached a north-south-only VIP (answered by %s)", fam.name, c.Backend)
		}
		nsTraffic(t, e.Lab.External, fam.vip, names)
	}
}

// TestE2ENorthSouthDSR: routed DSR. The backends hold the VIPs on their
// loopback and serve port 80 on them; the node forwards the client's
// packets unchanged (FIB lookup on the backend address) and the backends
// answer the client directly from the VIP: they see the client's own
// address.
func TestE2ENorthSouthDSR(t *testing.T) {
	e := nsNewEnv(t, 2)
	for _, vm := range e.Backends {
		for _, vip := range []netip.Addr{VIP4, VIP6} {
			if err := vm.AddLocalAddress(vip); err != nil {
				t.Fatal(err)
			}
			srv, err := vm.ServeOn(netip.AddrPortFrom(vip, 80))
			if err != nil {
				t.Fatal(err)
			}
			e.servers = append(e.servers, srv)
		}
	}
	svc := e.Service("web", nil)
	svc.Exposure = fluxvm.ExposureNorthSouth
	svc.Mode = fluxvm.ModeDSR
	for i := range svc.Backends {
		svc.Backends[i].Port = 80
	}
	e2eApply(t, e, svc)
	before := nsCounters(t, e)

	names := []string{e.Backends[0].Name, e.Backends[1].Name}
	for _, fam := range e2eFamilies {
		t.Run(fam.name, func(t *testing.T) {
			ext := e.Lab.External.Addr4
			if fam.vip.Is6() {
				ext = e.Lab.External.Addr6
			}
			nsTraffic(t, e.Lab.External, fam.vip, names)
			if peers := nsPeers(e); len(peers[ext]) == 0 {
				t.Errorf("backends did not see the client %s itself: %v", ext, peers)
			}
		})
	}
	if n := nsCounters(t, e)["dsr_forwarded"] - before["dsr_forwarded"]; n == 0 {
		t.Error("dsr_forwarded did not move")
	}
}

// TestE2ENorthSouthHostRouting: with host_routing the node forwards
// translated packets itself (FIB lookup + redirect) in both directions,
// and traffic works exactly as through the host stack.
func TestE2ENorthSouthHostRouting(t *testing.T) {
	e := nsNewEnv(t, 2)
	svc := e.Service("web", nil)
	svc.Exposure = fluxvm.ExposureNorthSouth
	svc.HostRouting = true
	e2eApply(t, e, svc)
	before := nsCounters(t, e)
	names := []string{e.Backends[0].Name, e.Backends[1].Name}
	for _, fam := range e2eFamilies {
		nsTraffic(t, e.Lab.External, fam.vip, names)
	}
	after := nsCounters(t, e)
	if n := after["host_routed_packets"] - before["host_routed_packets"]; n == 0 {
		t.Errorf("host_routed_packets did not move (fallbacks +%d)", after["host_route_fallbacks"]-before["host_route_fallbacks"])
	}
}

// TestE2ERemoteBackend: a backend that is not a VM of the node ("far",
// behind a second north-south interface). Its replies reach the node
// through that interface, so they are translated there: for the external
// client's north-south NAT flows on fluxvm_ns_in (the SNAT reply path; the
// backend sees the SNAT address), and for a client VM's east-west flows on
// the VM edge's egress after the node routed them (the backend sees the
// VM).
func TestE2ERemoteBackend(t *testing.T) {
	e := nsNewEnv(t, 1)
	// The second uplink is created after the dataplane opened: attach it
	// the way an embedder adds an interface at run time.
	far, err := e.Lab.AddRemote()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.DP.AddNorthSouthInterface(context.Background(), "uplink2"); err != nil {
		t.Fatal(err)
	}
	srv, err := far.Serve(BackendPort)
	if err != nil {
		t.Fatal(err)
	}
	e.servers = append(e.servers, srv)

	svc := e.Service("web", nil)
	svc.Exposure = fluxvm.ExposureBoth
	svc.Backends = nil
	for _, a := range []netip.Addr{far.Addr4, far.Addr6} {
		svc.Backends = append(svc.Backends, fluxvm.Backend{Address: a, Port: BackendPort})
	}
	e2eApply(t, e, svc)

	for _, fam := range e2eFamilies {
		t.Run(fam.name, func(t *testing.T) {
			snat, ext, client := nsSNAT4, e.Lab.External.Addr4, e.Client.Addr4
			if fam.vip.Is6() {
				snat, ext, client = nsSNAT6, e.Lab.External.Addr6, e.Client.Addr6
			}
			nsTraffic(t, e.Lab.External, fam.vip, []string{"far"})
			nsTraffic(t, e.Client, fam.vip, []string{"far"})
			var sawSNAT, sawClient bool
			for _, p := range srv.Peers() {
				switch p.Addr() {
				case snat:
					sawSNAT = true
				case client:
					sawClient = true
				case ext:
					t.Errorf("the remote backend saw the external client itself: %s", p)
				}
			}
			if !sawSNAT || !sawClient {
				t.Errorf("remote backend peers %v: want the SNAT address %s and the VM %s", srv.Peers(), snat, client)
			}
		})
	}
}
