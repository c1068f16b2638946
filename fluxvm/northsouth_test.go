package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// The north-south lab: the env's VMs plus the external client "ext"
// behind the node's uplink. The SNAT addresses are not assigned to the
// node: replies of the VM backends reach the from_vm hook first.
var (
	nsSNAT4 = netip.MustParseAddr("10.250.0.100")
	nsSNAT6 = netip.MustParseAddr("fd00:250::100")
)

const nsUplink = "uplink"

func newNSEnv(t *testing.T) *env {
	t.Helper()
	e := newEnv(t)
	if _, err := e.lab.AddExternal(); err != nil {
		t.Fatal(err)
	}
	e.opts.NorthSouth.Interfaces = []string{nsUplink}
	e.opts.NorthSouth.SNATAddress = nsSNAT4
	e.opts.NorthSouth.SNATAddressV6 = nsSNAT6
	e.opts.NorthSouth.SNATPortMin, e.opts.NorthSouth.SNATPortMax = 62000, 62999
	if err := e.opts.NorthSouth.Validate(); err != nil {
		t.Fatal(err)
	}
	return e
}

// tcxPrograms names the programs attached to a TCX hook of an interface
// of the node namespace, first to last.
func (e *env) tcxPrograms(t *testing.T, ifname string, at ebpf.AttachType) []string {
	t.Helper()
	var names []string
	err := e.lab.Node.Do(func() error {
		l, err := netInterfaceIndex(ifname)
		if err != nil {
			return err
		}
		names, err = testenv.TCXProgramNames(l, at)
		return err
	})
	if err != nil {
		t.Fatalf("programs on %s %v: %v", ifname, at, err)
	}
	return names
}

// svcEntry reads the frontend entry (vip, port, proto) from fluxvm_svc4/6.
func svcEntry(t *testing.T, d *Dataplane, vip netip.Addr, port uint16, proto Protocol) (bpf.SvcValue, bool) {
	t.Helper()
	var (
		v   bpf.SvcValue
		err error
	)
	if vip.Is4() {
		err = d.dp.Maps().FluxvmSvc4.Lookup(bpf.SvcKey4{Vip: bpf.AddrWords(vip)[0], Port: bpf.Port(port), Proto: proto.Number()}, &v)
	} else {
		err = d.dp.Maps().FluxvmSvc6.Lookup(bpf.SvcKey6{Vip: bpf.AddrWords(vip), Port: bpf.Port(port), Proto: proto.Number()}, &v)
	}
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return v, false
	}
	if err != nil {
		t.Fatalf("lookup %s/%d/%s: %v", vip, port, proto, err)
	}
	return v, true
}

func wantEntry(t *testing.T, d *Dataplane, what string, vip netip.Addr, port uint16, proto Protocol, flags uint32) bpf.SvcValue {
	t.Helper()
	v, ok := svcEntry(t, d, vip, port, proto)
	if !ok {
		t.Fatalf("%s: no entry %s/%d/%s", what, vip, port, proto)
	}
	if v.Flags != flags {
		t.Errorf("%s: %s/%d/%s flags %#x, want %#x", what, vip, port, proto, v.Flags, flags)
	}
	return v
}

func (e *env) nsService(name string, vip4, vip6 netip.Addr, exp Exposure, mode Mode, hostRouting bool) Service {
	port := uint16(80)
	if mode == ModeDSR {
		port = 8080
	}
	s := Service{Name: name, Exposure: exp, Mode: mode, HostRouting: hostRouting,
		VIPs: []netip.Addr{vip4, vip6}, Ports: []ServicePort{{Port: port, Protocol: TCP}}}
	for _, vm := range e.backends {
		s.Backends = append(s.Backends, Backend{Address: vm.Addr4, Port: 8080}, Backend{Address: vm.Addr6, Port: 8080})
	}
	return s
}

const (
	fNS   = bpf.SvcFlagNorthSouth
	fNoEW = bpf.SvcFlagNoEastWest
	fDSR  = bpf.SvcFlagDSR
	fHR   = bpf.SvcFlagHostRouting
	fMark = bpf.SvcFlagVIPMarker
)

// TestDataplaneNorthSouth checks the north-south control plane on a real
// datapath: the uplink gets ns_in and ns_out, fluxvm_snat holds the
// configured addresses and ports, and every frontend and VIP marker
// carries the flags of its services' exposure, mode and host_routing
// across apply, update and delete.
func TestDataplaneNorthSouth(t *testing.T) {
	e := newNSEnv(t)
	d := e.open(t)
	ctx := context.Background()

	// Attachments: both north-south programs on the uplink, the VM-edge
	// ones on the VM interfaces, reported with their kinds.
	if got := e.tcxPrograms(t, nsUplink, ebpf.AttachTCXIngress); !slices.Equal(got, []string{"fluxvm_ns_in"}) {
		t.Errorf("uplink ingress programs %v", got)
	}
	if got := e.tcxPrograms(t, nsUplink, ebpf.AttachTCXEgress); !slices.Equal(got, []string{"fluxvm_ns_out"}) {
		t.Errorf("uplink egress programs %v", got)
	}
	if got := e.tcxPrograms(t, e.cli.NodeIf, ebpf.AttachTCXIngress); !slices.Equal(got, []string{"fluxvm_from_vm"}) {
		t.Errorf("VM edge ingress programs %v", got)
	}
	st := d.Status()
	kinds := map[string]string{}
	for _, ifc := range st.Interfaces {
		kinds[ifc.Name] = ifc.Kind
		if ifc.Name == nsUplink {
			if len(ifc.Hooks) != 2 || ifc.Hooks[0].Hook != "ns_in" || ifc.Hooks[1].Hook != "ns_out" || ifc.VMID != "" || ifc.Index == 0 {
				t.Errorf("uplink status %+v", ifc)
			}
		}
	}
	if kinds[nsUplink] != InterfaceNorthSouth || kinds[e.cli.NodeIf] != InterfaceVMEdge || len(kinds) != 5 {
		t.Errorf("interface kinds %v", kinds)
	}
	if want := (SNATStatus{Address4: nsSNAT4, Address6: nsSNAT6, PortMin: 62000, PortMax: 62999}); !reflect.DeepEqual(st.SNAT, want) {
		t.Errorf("status SNAT %+v, want %+v", st.SNAT, want)
	}

	// fluxvm_snat holds the configuration.
	var snat bpf.SNATConfig
	if err := d.dp.Maps().FluxvmSnat.Lookup(uint32(0), &snat); err != nil {
		t.Fatal(err)
	}
	if snat.Flags != bpf.SNATFlagV4|bpf.SNATFlagV6 || bpf.Addr([4]uint32{snat.Addr4}, bpf.FamilyIPv4) != nsSNAT4 ||
		bpf.Addr(snat.Addr6, bpf.FamilyIPv6) != nsSNAT6 || snat.PortMin != 62000 || snat.PortMax != 62999 {
		t.Errorf("fluxvm_snat %+v", snat)
	}

	// Every exposure x mode: frontend and marker flags, one VIP each.
	type combo struct {
		exp        Exposure
		mode       Mode
		hr         bool
		fe, marker uint32
	}
	var combos []combo
	for _, x := range []struct {
		exp    Exposure
		fe, mk uint32
	}{{ExposureEastWest, 0, 0}, {"", 0, 0}, {ExposureNorthSouth, fNS | fNoEW, fNS | fNoEW}, {ExposureBoth, fNS, fNS}} {
		combos = append(combos,
			combo{x.exp, ModeNAT, false, x.fe, fMark | x.mk},
			combo{x.exp, ModeDSR, false, x.fe | fDSR, fMark | x.mk},
			combo{x.exp, "", true, x.fe | fHR, fMark | x.mk})
	}
	// Every combo lists the same backends; the east-west NAT frontends
	// among them take the slots of the reverse translation index in
	// order, and those past its slots store reverse-NAT halves (be2fe.go).
	listed := 0
	for i, c := range combos {
		if c.fe&(fNoEW|fDSR) == 0 {
			if listed++; listed > bpf.Be2feSlots {
				c.fe |= bpf.SvcFlagRevStored
			}
		}
		v4 := netip.AddrFrom4([4]byte{10, 96, 1, byte(i + 1)})
		v6 := netip.MustParseAddr(fmt.Sprintf("fd00:96:1::%x", i+1))
		name := fmt.Sprintf("m%d", i)
		svc := e.nsService(name, v4, v6, c.exp, c.mode, c.hr)
		ss, err := d.ApplyService(ctx, svc)
		if err != nil {
			t.Fatalf("%+v: %v", c, err)
		}
		what := fmt.Sprintf("exposure %q mode %q host_routing %v", c.exp, c.mode, c.hr)
		for _, vip := range []netip.Addr{v4, v6} {
			v := wantEntry(t, d, what, vip, svc.Ports[0].Port, TCP, c.fe)
			if v.ServiceId == 0 || v.Revision != uint32(ss.Revision) {
				t.Errorf("%s: %s entry %+v", what, vip, v)
			}
			wantEntry(t, d, what+" marker", vip, 0, TCP, c.marker)
		}
	}
	for i := range combos {
		if err := d.DeleteService(ctx, fmt.Sprintf("m%d", i)); err != nil {
			t.Fatal(err)
		}
	}

	// Services sharing a VIP share its marker: north-south if any of them
	// is, off the VM edges only if all of them are.
	shared := netip.MustParseAddr("10.96.2.1")
	shared6 := netip.MustParseAddr("fd00:96:2::1")
	a := e.nsService("a", shared, shared6, ExposureEastWest, ModeNAT, false)
	b := e.nsService("b", shared, shared6, ExposureNorthSouth, ModeNAT, false)
	b.Ports = []ServicePort{{Port: 8080, Protocol: TCP}}
	if _, err := d.ApplyService(ctx, a); err != nil {
		t.Fatal(err)
	}
	wantEntry(t, d, "a alone", shared, 0, TCP, fMark)
	sb, err := d.ApplyService(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	for _, vip := range []netip.Addr{shared, shared6} {
		wantEntry(t, d, "a east-west + b north-south", vip, 0, TCP, fMark|fNS)
		wantEntry(t, d, "b north-south", vip, 8080, TCP, fNS|fNoEW)
		wantEntry(t, d, "a east-west", vip, 80, TCP, 0)
	}
	if err := d.DeleteService(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	for _, vip := range []netip.Addr{shared, shared6} {
		m := wantEntry(t, d, "b alone", vip, 0, TCP, fMark|fNS|fNoEW)
		var sid uint32
		for _, fe := range sb.Frontends {
			if fe.VIP.Addr() == vip {
				sid = fe.ServiceID
			}
		}
		if m.ServiceId != sid {
			t.Errorf("marker of %s names service id %d, want b's %d", vip, m.ServiceId, sid)
		}
		if _, ok := svcEntry(t, d, vip, 80, TCP); ok {
			t.Errorf("a's frontend on %s left after delete", vip)
		}
	}
	// Re-applying with another exposure, then another mode, rewrites the
	// flags of the frontends and of the marker.
	b.Exposure = ExposureBoth
	if _, err := d.ApplyService(ctx, b); err != nil {
		t.Fatal(err)
	}
	wantEntry(t, d, "b both", shared, 8080, TCP, fNS)
	wantEntry(t, d, "b both marker", shared, 0, TCP, fMark|fNS)
	b.Mode = ModeDSR
	if _, err := d.ApplyService(ctx, b); err != nil {
		t.Fatal(err)
	}
	wantEntry(t, d, "b both dsr", shared6, 8080, TCP, fNS|fDSR)
	b.Mode, b.HostRouting, b.Exposure = ModeNAT, true, ExposureNorthSouth
	if _, err := d.ApplyService(ctx, b); err != nil {
		t.Fatal(err)
	}
	wantEntry(t, d, "b north-south host_routing", shared6, 8080, TCP, fNS|fNoEW|fHR)
	wantEntry(t, d, "b north-south host_routing marker", shared6, 0, TCP, fMark|fNS|fNoEW)

	// A rejected request changes nothing: DSR with a rewritten port.
	bad := b
	bad.Mode, bad.HostRouting = ModeDSR, false
	bad.Ports = []ServicePort{{Port: 80, Protocol: TCP}}
	if _, err := d.ApplyService(ctx, bad); !errors.Is(err, ErrInvalid) || !containsField(err, "backends[0].port") {
		t.Errorf("DSR with another backend port: %v", err)
	}
	wantEntry(t, d, "after a rejected request", shared6, 8080, TCP, fNS|fNoEW|fHR)
	if err := d.DeleteService(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	for _, vip := range []netip.Addr{shared, shared6} {
		if _, ok := svcEntry(t, d, vip, 0, TCP); ok {
			t.Errorf("marker of %s left after its last service", vip)
		}
	}

	// Interfaces: adding again is idempotent, names are checked, the two
	// kinds do not mix, and RemoveInterface detaches either kind.
	if st, err := d.AddNorthSouthInterface(context.Background(), nsUplink); err != nil || st.Kind != InterfaceNorthSouth || len(st.Hooks) != 2 {
		t.Errorf("adding the uplink again: %+v %v", st, err)
	}
	if got := e.tcxPrograms(t, nsUplink, ebpf.AttachTCXIngress); len(got) != 1 {
		t.Errorf("uplink ingress after a second add: %v", got)
	}
	if _, err := d.AddNorthSouthInterface(context.Background(), e.cli.NodeIf); !errors.Is(err, ErrConflict) {
		t.Errorf("a VM edge as north-south interface: %v", err)
	}
	if _, err := d.AddInterface(context.Background(), VMEdgeInterface{Name: nsUplink, VMID: "x"}); !errors.Is(err, ErrConflict) {
		t.Errorf("the uplink as VM edge: %v", err)
	}
	if _, err := d.AddNorthSouthInterface(context.Background(), "bad/name"); !errors.Is(err, ErrInvalid) || !containsField(err, "name") {
		t.Errorf("invalid name: %v", err)
	}
	if _, err := d.AddNorthSouthInterface(context.Background(), "nosuch0"); err == nil {
		t.Error("attached to an interface that does not exist")
	}
	if _, err := d.VMStats(context.Background(), ""); !errors.Is(err, ErrNotFound) {
		t.Errorf("VMStats of the empty VM id (north-south interfaces have none): %v", err)
	}
	if err := d.RemoveInterface(context.Background(), nsUplink); err != nil {
		t.Fatal(err)
	}
	if got := e.tcxPrograms(t, nsUplink, ebpf.AttachTCXIngress); len(got) != 0 {
		t.Errorf("uplink ingress after remove: %v", got)
	}
	if got := e.tcxPrograms(t, nsUplink, ebpf.AttachTCXEgress); len(got) != 0 {
		t.Errorf("uplink egress after remove: %v", got)
	}
	for _, ifc := range d.Status().Interfaces {
		if ifc.Name == nsUplink {
			t.Errorf("removed uplink still in status: %+v", ifc)
		}
	}
	if _, err := d.AddNorthSouthInterface(context.Background(), nsUplink); err != nil {
		t.Fatal(err)
	}

	// Opened again with another configuration, fluxvm_snat follows it.
	d.Close()
	e.opts.NorthSouth.SNATAddress, e.opts.NorthSouth.SNATAddressV6 = netip.MustParseAddr("fd00:250::200"), netip.Addr{}
	e.opts.NorthSouth.SNATPortMin, e.opts.NorthSouth.SNATPortMax = 1024, 1024
	d = e.open(t)
	if err := d.dp.Maps().FluxvmSnat.Lookup(uint32(0), &snat); err != nil {
		t.Fatal(err)
	}
	if snat.Flags != bpf.SNATFlagV6 || snat.Addr4 != 0 || bpf.Addr(snat.Addr6, bpf.FamilyIPv6) != netip.MustParseAddr("fd00:250::200") ||
		snat.PortMin != 1024 || snat.PortMax != 1024 {
		t.Errorf("fluxvm_snat after reopening %+v", snat)
	}
	// An IPv4 north-south NAT service is now refused: no IPv4 SNAT address.
	if _, err := d.ApplyService(ctx, e.nsService("v4", shared, shared6, ExposureNorthSouth, ModeNAT, false)); !errors.Is(err, ErrPrerequisite) || !containsField(err, "vips[0]") {
		t.Errorf("north-south NAT without an IPv4 SNAT address: %v", err)
	}

	// Cleanup detaches both kinds.
	if err := d.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, ifc := range []string{nsUplink, e.cli.NodeIf} {
		for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
			if got := e.tcxPrograms(t, ifc, at); len(got) != 0 {
				t.Errorf("%s %v after cleanup: %v", ifc, at, got)
			}
		}
	}
}

// TestDataplaneNorthSouthNAT sends real connections from the external
// client through the uplink to a north-south NAT VIP (IPv4 and IPv6, TCP
// and UDP), and checks that VM clients do not get the north-south-only
// VIP while both-exposure VIPs serve them.
func TestDataplaneNorthSouthNAT(t *testing.T) {
	e := newNSEnv(t)
	d := e.open(t)
	ctx := context.Background()
	ext := e.lab.External
	vip4n, vip6n := netip.MustParseAddr("10.96.3.1"), netip.MustParseAddr("fd00:96:3::1")
	svc := e.nsService("edge", vip4n, vip6n, ExposureNorthSouth, ModeNAT, false)
	svc.Ports = append(svc.Ports, ServicePort{Port: 80, Protocol: UDP})
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	for _, vip := range []netip.Addr{vip4n, vip6n} {
		c, err := ext.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
		if err != nil {
			t.Fatalf("external client to %s:80: %v", vip, err)
		}
		if err := c.Echo([]byte("north-south"), 3*time.Second); err != nil {
			t.Errorf("%s: echo: %v", vip, err)
		}
		c.Close()
		if name, err := ext.AskUDP(netip.AddrPortFrom(vip, 80), 2*time.Second); err != nil || name == "" {
			t.Errorf("%s udp from outside: %q %v", vip, name, err)
		}
		if c, err := e.cli.DialTCP(netip.AddrPortFrom(vip, 80), 500*time.Millisecond); err == nil {
			c.Close()
			t.Errorf("a VM reached the north-south-only VIP %s", vip)
		}
	}
	// The flows were source-NATed: their reverse-NAT halves are keyed by
	// the SNAT address and a port of the configured range, and remember
	// the external client.
	var (
		k4    bpf.Tuple4
		v     bpf.NATValue
		snats int
	)
	it := d.dp.Maps().FluxvmNat4.Iterate()
	for it.Next(&k4, &v) {
		if v.Flags&bpf.NATFlagSNAT == 0 {
			continue
		}
		snats++
		port := bpf.Port(k4.Dport)
		if bpf.Addr([4]uint32{k4.Daddr}, bpf.FamilyIPv4) != nsSNAT4 || port < 62000 || port > 62999 ||
			bpf.Addr(v.Client, bpf.FamilyIPv4) != ext.Addr4 {
			t.Errorf("SNAT mapping %+v -> %+v (port %d)", k4, v, port)
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	if snats == 0 {
		t.Error("no IPv4 SNAT mapping in fluxvm_nat4")
	}
	stats, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if c := stats.Services["edge"]; c.NewFlows < 4 || c.ReplyPackets == 0 {
		t.Errorf("service stats %+v", c)
	}
	for _, k := range []string{"host_routed_packets", "host_route_fallbacks", "snat_retries", "dsr_forwarded", "snat_conflicts"} {
		if _, ok := stats.Parser[k]; !ok {
			t.Errorf("stats lack the counter %s", k)
		}
	}
	for _, k := range []string{"snat_failed", "dsr_no_route"} {
		if _, ok := stats.Drops[k]; !ok {
			t.Errorf("stats lack the drop reason %s", k)
		}
	}

	svc.Exposure = ExposureBoth
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	for _, vip := range []netip.Addr{vip4n, vip6n} {
		for _, vm := range []struct {
			name string
			dial func(netip.AddrPort, time.Duration) (interface{ Close() error }, error)
		}{
			{"VM client", func(a netip.AddrPort, to time.Duration) (interface{ Close() error }, error) {
				return e.cli.DialTCP(a, to)
			}},
			{"external client", func(a netip.AddrPort, to time.Duration) (interface{ Close() error }, error) {
				return ext.DialTCP(a, to)
			}},
		} {
			c, err := vm.dial(netip.AddrPortFrom(vip, 80), 3*time.Second)
			if err != nil {
				t.Errorf("%s to the both-exposure VIP %s: %v", vm.name, vip, err)
				continue
			}
			c.Close()
		}
	}
}

func netInterfaceIndex(name string) (int, error) {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		return 0, err
	}
	return ifc.Index, nil
}

func containsField(err error, field string) bool {
	var ve *ValidationError
	return errors.As(err, &ve) && ve.Field == field
}
