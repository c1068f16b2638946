package fluxvm

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
	"github.com/fluxvm/servicefabric/nat"
)

// ewService4 is an IPv4-only east-west service (NAT mode) on backends that
// need not exist: memory does not depend on traffic.
func ewService4(name string, vip netip.Addr) Service {
	s := Service{Name: name, VIPs: []netip.Addr{vip}, Ports: []ServicePort{{Port: 80, Protocol: TCP}, {Port: 53, Protocol: UDP}}}
	for i := range 3 {
		s.Backends = append(s.Backends, Backend{Address: netip.AddrFrom4([4]byte{10, 1, 0, byte(10 + i)}), Port: 8080})
	}
	return s
}

// memlockBefore is the locked BPF memory of an IPv4-only east-west node
// at tier M before the maps were sized by need (TestMemlockIPv4EastWestTierM
// at 296965f: 163.9 MiB).
const memlockBefore = 164 << 20

// TestMemlockIPv4EastWestTierM: an IPv4-only east-west node (no north-south
// edge, no IPv6 frontend, socket LB off, flow records and HA off) at tier
// M holds at most half the locked BPF memory it held before the maps were
// sized by need: the figure is the kernel's memlock of every map, as
// status reports it (Status.Memory), after the first apply, after a
// restart on the same pins, and after a start on new pins with the same
// catalog (sized from the catalog at Open: nothing grows). It logs the
// per-map table (docs/benchmarks.md, "issue 34: maps sized by need").
func TestMemlockIPv4EastWestTierM(t *testing.T) {
	catalog := filepath.Join(t.TempDir(), "catalog.json")
	root := testenv.PinRoot(t)
	open := func(pins string) *Dataplane {
		t.Helper()
		d, err := Open(context.Background(), Options{
			Loader:      bpf.Options{PinRoot: filepath.Join(root, pins), Tier: bpf.TierM},
			CatalogPath: catalog, ConntrackGCInterval: -1,
		})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	check := func(what string, d *Dataplane, wantGrowth bool) {
		t.Helper()
		st := d.Status()
		mem := st.Memory
		if mem == nil || mem.Error != "" {
			t.Fatalf("%s: memory: %+v", what, mem)
		}
		names := make([]string, 0, len(mem.Maps))
		for n := range mem.Maps {
			names = append(names, n)
		}
		slices.Sort(names)
		t.Logf("%s:", what)
		for _, n := range names {
			if mem.Maps[n] >= 64<<10 {
				t.Logf("  %-18s %9.2f MiB", n, float64(mem.Maps[n])/(1<<20))
			}
		}
		t.Logf("  total %.1f MiB (Maglev tables %.2f MiB)", float64(mem.Total)/(1<<20), float64(mem.MaglevInner.Bytes)/(1<<20))
		if mem.Total > memlockBefore/2 {
			t.Errorf("%s: the IPv4-only east-west node at tier M holds %.1f MiB of BPF memory, more than half of %d MiB",
				what, float64(mem.Total)/(1<<20), memlockBefore>>20)
		}
		if st.MapSizes != nil && (st.MapSizes.LastGrowth != nil) != wantGrowth {
			t.Errorf("%s: last growth %+v, want one: %v", what, st.MapSizes.LastGrowth, wantGrowth)
		}
	}
	d := open("a")
	if _, err := d.ApplyService(context.Background(), ewService4("web", netip.MustParseAddr("10.96.0.10"))); err != nil {
		t.Fatal(err)
	}
	check("first apply", d, true)
	d.Close()
	d = open("a")
	check("restart", d, false)
	d.Close()
	d = open("b")
	check("new pins, same catalog", d, false)
	d.Close()

	// A node upgraded from objects without sizing: every map pinned at
	// the tier's capacity, a flow in fluxvm_fct4. The empty maps are
	// recreated at their token size; the flow stays.
	old, err := bpf.Open(bpf.Options{PinRoot: filepath.Join(root, "c"), Tier: bpf.TierM})
	if err != nil {
		t.Fatal(err)
	}
	flow := bpf.Tuple4{Saddr: 0x0a000001, Daddr: 0x0a60000a, Sport: bpf.Port(40000), Dport: bpf.Port(80), Proto: 6}
	if err := old.Maps().FluxvmFct4.Put(flow, bpf.CTValue{ServiceId: 1, BackendId: 1, State: uint8(bpf.CTTCPEstablished)}); err != nil {
		t.Fatal(err)
	}
	old.Close()
	d = open("c")
	check("upgraded node", d, false)
	var v bpf.CTValue
	if err := d.dp.Maps().FluxvmFct4.Lookup(flow, &v); err != nil || v.BackendId != 1 {
		t.Errorf("upgraded node: the flow's entry: %+v, %v", v, err)
	}
	d.Close()
}

// growForTest grows the flow maps names to their ceiling, as an apply
// that needs them would.
func growForTest(t *testing.T, d *Dataplane, names ...string) {
	t.Helper()
	d.flowMu.Lock() // growMaps lets it go
	reasons := map[string]sizeNeed{}
	for _, n := range names {
		reasons[n] = sizeNeed{full: true, reason: "test", code: "test"}
	}
	if err := d.growMaps("test", names, reasons, time.Now()); err != nil {
		t.Fatal(err)
	}
}

// udpFlow is a connected UDP socket of a lab VM: one flow, whose backend
// answers with its name.
type udpFlow struct{ c net.Conn }

func dialUDP(t *testing.T, vm *lab.VM, addr netip.AddrPort) *udpFlow {
	t.Helper()
	var c net.Conn
	if err := vm.NS.Do(func() (err error) { c, err = net.Dial("udp", addr.String()); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &udpFlow{c}
}

func (u *udpFlow) ask() (string, error) {
	u.c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := u.c.Write([]byte("who")); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	n, err := u.c.Read(buf)
	if err != nil {
		return "", err
	}
	name, _, _ := strings.Cut(string(buf[:n]), "\n")
	return name, nil
}

// sizeOf returns the MapSizeStatus of map name.
func sizeOf(t *testing.T, d *Dataplane, name string) MapSizeStatus {
	t.Helper()
	ms := d.Status().MapSizes
	if ms == nil {
		t.Fatal("no map sizes in status")
	}
	for _, s := range ms.Maps {
		if s.Map == name {
			return s
		}
	}
	t.Fatalf("%s not in map sizes %+v", name, ms.Maps)
	return MapSizeStatus{}
}

// TestGrowKeepsLiveFlows: the maps of a node start at their token sizes,
// and the applies of their first users grow them while TCP connections
// and UDP flows run through the lab: the first IPv6 frontend grows
// fluxvm_fct6, the fifth frontend listing the same backends (whose flows
// store reverse halves) grows fluxvm_nat4 and fluxvm_nat6. Every flow
// keeps working across each grow, on its backend, its conntrack entry in
// place; status says what each map is sized to and why.
func TestGrowKeepsLiveFlows(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	for _, name := range []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"} {
		if s := sizeOf(t, d, name); s.Size != SizeToken || s.MaxEntries != bpf.TokenFlowEntries || !strings.HasPrefix(s.Reason, "token: no IPv") {
			t.Errorf("empty catalog: %+v; want token", s)
		}
	}
	svc := func(name string, vips ...netip.Addr) Service {
		s := e.service(1, 1, 1)
		s.Name, s.VIPs = name, vips
		// The backends of the VIPs' families only.
		s.Backends = slices.DeleteFunc(s.Backends, func(b Backend) bool {
			return !slices.ContainsFunc(vips, func(v netip.Addr) bool { return v.Is4() == b.Address.Is4() })
		})
		return s
	}
	apply := func(s Service) {
		t.Helper()
		if _, err := d.ApplyService(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	apply(svc("web4", vip4))
	if s := sizeOf(t, d, "fluxvm_fct4"); s.Size != SizeFull || !strings.Contains(s.Reason, "service web4") {
		t.Errorf("after web4: %+v", s)
	}

	// The live flows: a TCP connection and a UDP flow per family, echoed
	// by a goroutine through every grow.
	type flow struct {
		tcp     *lab.Conn
		udp     *udpFlow
		udpName string
	}
	var live []*flow
	addFlow := func(vip netip.Addr) {
		t.Helper()
		f := &flow{tcp: e.dial(t, vip), udp: dialUDP(t, e.cli, netip.AddrPortFrom(vip, 80))}
		echo(t, f.tcp, "first echo")
		var err error
		if f.udpName, err = f.udp.ask(); err != nil || f.udpName == "" {
			t.Fatalf("udp to %s: %q %v", vip, f.udpName, err)
		}
		live = append(live, f)
	}
	entries := func() map[conntrack.Key]uint32 {
		t.Helper()
		es, err := d.ct.List(conntrack.Filter{})
		if err != nil {
			t.Fatal(err)
		}
		out := map[conntrack.Key]uint32{}
		for _, en := range es {
			out[en.Key] = en.BackendID
		}
		return out
	}
	// across runs the applies with the flows talking, then checks each
	// flow and its conntrack entry.
	across := func(what string, applies ...Service) {
		t.Helper()
		before := entries()
		stop, errs := make(chan struct{}), make(chan error, 1)
		var rounds atomic.Int64
		go func() {
			defer close(errs)
			for {
				select {
				case <-stop:
					return
				default:
				}
				for _, f := range live {
					if err := f.tcp.Echo([]byte("x"), 3*time.Second); err != nil {
						errs <- fmt.Errorf("tcp via %s: %w", f.tcp.Backend, err)
						return
					}
					if name, err := f.udp.ask(); err != nil || name != f.udpName {
						errs <- fmt.Errorf("udp: %q, %v; want %q", name, err, f.udpName)
						return
					}
				}
				rounds.Add(1)
			}
		}()
		for _, s := range applies {
			apply(s)
		}
		close(stop)
		if err := <-errs; err != nil {
			t.Fatalf("%s: a live flow broke: %v", what, err)
		}
		if rounds.Load() == 0 {
			t.Errorf("%s: no round of traffic ran", what)
		}
		after := entries()
		for k, bid := range before {
			if got, ok := after[k]; !ok || got != bid {
				t.Errorf("%s: conntrack entry %v: backend %d (present %v), was %d", what, k, got, ok, bid)
			}
		}
		for _, f := range live {
			echo(t, f.tcp, what+": after")
		}
	}
	addFlow(vip4)

	across("first IPv6 frontend", svc("web6", vip6))
	if s := sizeOf(t, d, "fluxvm_fct6"); s.Size != SizeFull || !strings.Contains(s.Reason, "IPv6 frontend of service web6") {
		t.Errorf("after web6: %+v", s)
	}
	g := d.Status().MapSizes.LastGrowth
	if g == nil || g.Cause != "apply of service web6" || len(g.Maps) != 1 || g.Maps[0].Map != "fluxvm_fct6" || g.Maps[0].Dropped != 0 {
		t.Errorf("last growth %+v", g)
	}
	for _, name := range []string{"fluxvm_nat4", "fluxvm_nat6"} {
		if s := sizeOf(t, d, name); s.Size != SizeToken {
			t.Errorf("after web6: %+v; want token", s)
		}
	}
	addFlow(vip6)

	// Five frontends per family and protocol listing the same backends:
	// the fifth's flows store reverse halves (web4 and web6 are the first
	// of theirs, s3 the fifth).
	var five []Service
	for i := range 5 {
		five = append(five, svc(fmt.Sprintf("s%d", i), ixVIP(byte(20+i)), ixVIP6(byte(20+i))))
	}
	across("frontends storing reverse halves", five...)
	for _, name := range []string{"fluxvm_nat4", "fluxvm_nat6"} {
		if s := sizeOf(t, d, name); s.Size != SizeFull || !strings.Contains(s.Reason, "listed by more than") ||
			!strings.Contains(s.Reason, "(service s3)") || !strings.HasSuffix(s.Reason, "(grown by apply of service s3)") {
			t.Errorf("after five: %+v", s)
		}
	}
	// The fifth frontend's flows work, replies translated by their halves.
	addFlow(ixVIP(23))
	addFlow(ixVIP6(23))
	across("nothing to grow", svc("web6", vip6, ixVIP(30)))

	// A restart sizes the maps from the catalog: all four at full from
	// Open, nothing grows, the flows keep working.
	reopen := func(what string) {
		t.Helper()
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		d = e.open(t)
		if g := d.Status().MapSizes.LastGrowth; g != nil {
			t.Errorf("%s: grew %+v", what, g)
		}
		for _, f := range live {
			echo(t, f.tcp, what)
			if name, err := f.udp.ask(); err != nil || name != f.udpName {
				t.Errorf("%s: udp %q %v, want %q", what, name, err, f.udpName)
			}
		}
	}
	reopen("restart")
	for _, name := range []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"} {
		if s := sizeOf(t, d, name); s.Size != SizeFull || !strings.HasPrefix(s.Reason, "full: ") || strings.Contains(s.Reason, "grown") {
			t.Errorf("restart: %+v; want full from the catalog", s)
		}
	}
	// Without the services that needed them, the maps stay full (no map
	// shrinks), and status says so.
	for _, name := range []string{"s0", "s1", "s2", "s3", "s4"} {
		if err := d.DeleteService(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	live = live[:2]
	reopen("restart without the shared backends")
	for _, name := range []string{"fluxvm_nat4", "fluxvm_nat6"} {
		if s := sizeOf(t, d, name); s.Size != SizeFull || !strings.HasPrefix(s.Reason, "kept: ") {
			t.Errorf("restart without the shared backends: %+v; want kept full", s)
		}
	}
}

// TestSizeNeeds: which inputs make each map sized by need full.
func TestSizeNeeds(t *testing.T) {
	v4, v6 := netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00:96::10")
	b4, b6 := netip.MustParseAddr("10.1.0.10"), netip.MustParseAddr("fd00:1::10")
	svc := func(name string, exp Exposure, mode Mode, vips ...netip.Addr) Service {
		s := Service{Name: name, VIPs: vips, Exposure: exp, Mode: mode, Ports: []ServicePort{{Port: 80, Protocol: TCP}}}
		for _, v := range vips {
			b := b4
			if v.Is6() {
				b = b6
			}
			s.Backends = append(s.Backends, Backend{Address: b, Port: 80})
		}
		return s
	}
	shared := func(n int) []Service {
		var out []Service
		for i := range n {
			out = append(out, svc(fmt.Sprintf("s%d", i), "", "", netip.AddrFrom4([4]byte{10, 96, 1, byte(i)})))
		}
		return out
	}
	for _, tc := range []struct {
		name string
		opts Options
		ha   bool
		svcs []Service
		full []string
	}{
		{name: "empty"},
		{name: "IPv4 east-west", svcs: []Service{svc("a", "", "", v4)}, full: []string{"fluxvm_fct4"}},
		{name: "IPv6 east-west", svcs: []Service{svc("a", ExposureEastWest, ModeNAT, v6)}, full: []string{"fluxvm_fct6"}},
		{name: "dual-stack north-south nat", svcs: []Service{svc("a", ExposureNorthSouth, "", v4, v6)},
			full: []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"}},
		{name: "both exposures nat", svcs: []Service{svc("a", ExposureBoth, ModeNAT, v6)}, full: []string{"fluxvm_fct6", "fluxvm_nat6"}},
		{name: "north-south dsr", svcs: []Service{svc("a", ExposureNorthSouth, ModeDSR, v4)}, full: []string{"fluxvm_fct4"}},
		{name: "four frontends share a backend", svcs: shared(4), full: []string{"fluxvm_fct4"}},
		{name: "five frontends share a backend", svcs: shared(5), full: []string{"fluxvm_fct4", "fluxvm_nat4"}},
		{name: "flow records", opts: Options{FlowSampleRate: 100}, full: []string{"fluxvm_sflows"}},
		{name: "HA", ha: true, full: []string{"fluxvm_haq"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			needs := sizeNeeds(&tc.opts, tc.ha, tc.svcs)
			if len(needs) != len(bpf.SizedMaps) {
				t.Errorf("needs of %d maps, want %d", len(needs), len(bpf.SizedMaps))
			}
			for _, name := range bpf.SizedMaps {
				n := needs[name]
				if n.full != slices.Contains(tc.full, name) || n.reason == "" || n.code == "" {
					t.Errorf("%s: full %v (%q), want %v", name, n.full, n.reason, slices.Contains(tc.full, name))
				}
			}
		})
	}
}

// TestPressureGrowsTokenMap: a map at its token size that fills anyway
// (here reverse-NAT halves that nothing in this east-west catalog writes)
// is grown to the tier's capacity by the pressure round, every entry kept,
// rather than shed or compacted.
func TestPressureGrowsTokenMap(t *testing.T) {
	e := newEnv(t)
	e.opts.Pressure.SoftPercent, e.opts.Pressure.HardPercent = 50, 90
	d := e.open(t)
	s := e.service(1, 1, 1)
	s.VIPs = []netip.Addr{vip4}
	s.Backends = slices.DeleteFunc(s.Backends, func(b Backend) bool { return b.Address.Is6() })
	if _, err := d.ApplyService(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	now, err := conntrack.Now()
	if err != nil {
		t.Fatal(err)
	}
	const n = 600 // 59% of the token map
	backend := netip.AddrPortFrom(e.backends[0].Addr4, 8080)
	for i := range n {
		client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{172, 18, byte(i >> 8), byte(i)}), 40000)
		if err := d.ct.NAT().Put(nat.Entry{Key: nat.Key{Backend: backend, Client: client, Proto: conntrack.ProtoTCP},
			VIP: netip.AddrPortFrom(vip4, 80), ServiceID: 1, BackendID: 1, LastSeen: now}); err != nil {
			t.Fatal(err)
		}
	}
	if s := sizeOf(t, d, "fluxvm_nat4"); s.Size != SizeToken || s.ReasonCode != "no_reverse_nat" {
		t.Fatalf("before: %+v", s)
	}
	r, err := d.ReconcilePressure(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	s4 := sizeOf(t, d, "fluxvm_nat4")
	if s4.Size != SizeFull || !strings.Contains(s4.Reason, "grown by map pressure") || s4.ReasonCode != "grown_by_pressure" || s4.Entries == nil || *s4.Entries < n {
		t.Errorf("after the round %+v: %+v; want grown, holding the %d halves", r, s4, n)
	}
	if g := d.Status().MapSizes.LastGrowth; g == nil || g.Cause != "map pressure" || len(g.Maps) != 1 || g.Maps[0].Kept != n {
		t.Errorf("last growth %+v; want fluxvm_nat4, %d kept", g, n)
	}
	got := 0
	if err := d.ct.NAT().Scan(nat.Filter{Family: nat.IPv4}, func(es []nat.Entry) error {
		for _, en := range es {
			if en.Client.Addr().As4()[1] == 18 {
				got++
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if got != n {
		t.Errorf("%d of the %d halves after the grow", got, n)
	}
	if r.Shed.Total() != 0 || r.Compaction != nil {
		t.Errorf("the round shed %+v, compacted %+v", r.Shed, r.Compaction)
	}
}

// TestConcurrentAppliesGrowReverseNAT: three services list one backend;
// the fourth and fifth, also listing it, are applied at the same time.
// Neither alone passes bpf.Be2feSlots frontends, both together do: once
// both are committed, fluxvm_nat4 is at its ceiling (the fifth frontend's
// flows store reverse halves), whichever apply saw the other. Many
// rounds, each on a new dataplane.
func TestConcurrentAppliesGrowReverseNAT(t *testing.T) {
	root := testenv.PinRoot(t)
	backend := Backend{Address: netip.MustParseAddr("10.1.0.10"), Port: 8080}
	svc := func(i int) Service {
		return Service{Name: fmt.Sprintf("s%d", i), VIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 1, byte(i)})},
			Ports: []ServicePort{{Port: 80, Protocol: TCP}}, Backends: []Backend{backend}}
	}
	ctx := context.Background()
	for round := range 12 {
		d, err := Open(context.Background(), Options{Loader: bpf.Options{PinRoot: filepath.Join(root, fmt.Sprint(round)), Tier: bpf.TierS}, ConntrackGCInterval: -1})
		if err != nil {
			t.Fatal(err)
		}
		for i := 1; i <= 3; i++ {
			if _, err := d.ApplyService(ctx, svc(i)); err != nil {
				t.Fatal(err)
			}
		}
		if s := sizeOf(t, d, "fluxvm_nat4"); s.Size != SizeToken {
			d.Close()
			t.Fatalf("round %d: fluxvm_nat4 before: %+v, want token", round, s)
		}
		start := make(chan struct{})
		errs := make(chan error, 2)
		for i := 4; i <= 5; i++ {
			go func() {
				<-start
				_, err := d.ApplyService(ctx, svc(i))
				errs <- err
			}()
		}
		close(start)
		for range 2 {
			if err := <-errs; err != nil {
				t.Errorf("round %d: %v", round, err)
			}
		}
		s := sizeOf(t, d, "fluxvm_nat4")
		d.Close()
		if s.Size != SizeFull || s.ReasonCode != "stored_reverse_halves" {
			t.Fatalf("round %d: five frontends list %s, fluxvm_nat4 is %+v; want it at its ceiling", round, backend.Address, s)
		}
	}
}

// TestGrowRebindFailure: a grow whose rebind of the flow views fails (an
// injected error) leaves the datapath on the grown maps and the apply
// failing; the views then write the old map. The apply retried rebinds
// them: what the views write lands in the maps the datapath runs on.
func TestGrowRebindFailure(t *testing.T) {
	d, err := Open(context.Background(), Options{Loader: bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "a"), Tier: bpf.TierS}, ConntrackGCInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	backend := Backend{Address: netip.MustParseAddr("10.1.0.10"), Port: 8080}
	svc := func(i int) Service {
		return Service{Name: fmt.Sprintf("s%d", i), VIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 1, byte(i)})},
			Ports: []ServicePort{{Port: 80, Protocol: TCP}}, Backends: []Backend{backend}}
	}
	ctx := context.Background()
	for i := 1; i <= 4; i++ {
		if _, err := d.ApplyService(ctx, svc(i)); err != nil {
			t.Fatal(err)
		}
	}
	now, err := conntrack.Now()
	if err != nil {
		t.Fatal(err)
	}
	// put writes a reverse-NAT half through the views and reports whether
	// the datapath's fluxvm_nat4 holds it.
	put := func(i int) bool {
		t.Helper()
		client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{172, 18, 0, byte(i)}), 40000)
		e := nat.Entry{Key: nat.Key{Backend: netip.AddrPortFrom(backend.Address, 8080), Client: client, Proto: conntrack.ProtoTCP},
			VIP: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, 1, 1}), 80), ServiceID: 1, BackendID: 1, LastSeen: now}
		if err := d.ct.NAT().Put(e); err != nil {
			t.Fatal(err)
		}
		k := bpf.Tuple4{}
		var v bpf.NATValue
		it := d.dp.Maps().FluxvmNat4.Iterate()
		n := 0
		for it.Next(&k, &v) {
			n++
		}
		return n == i
	}
	rebindFault = func() error { return fmt.Errorf("injected") }
	_, err = d.ApplyService(ctx, svc(5))
	rebindFault = nil
	if err == nil || !strings.Contains(err.Error(), "injected") {
		t.Fatalf("apply with the rebind failing: %v, want the injected error", err)
	}
	if s := sizeOf(t, d, "fluxvm_nat4"); s.Size != SizeFull {
		t.Fatalf("fluxvm_nat4 after the grow: %+v", s)
	}
	if put(1) {
		t.Fatal("the views wrote the grown map although their rebind failed: the injection did nothing")
	}
	if _, err := d.ApplyService(ctx, svc(5)); err != nil {
		t.Fatalf("apply retried: %v", err)
	}
	if !put(1) {
		t.Error("after the retried apply the views still write the replaced fluxvm_nat4")
	}
}
