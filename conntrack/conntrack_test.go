package conntrack

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/mapscan"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
	"github.com/fluxvm/servicefabric/nat"
)

// variant is one address family × protocol combination, on a frontend
// whose east-west flows have derived replies (the datapath's default) or,
// stored, on one with bpf.SvcFlagRevStored, whose flows store reverse-NAT
// halves.
type variant struct {
	name     string
	proto    uint8
	client   netip.Addr
	vip      netip.AddrPort
	backends [3]netip.AddrPort
	ids      [3]uint32 // backend ids; distinct per family so variants can share a map
	stored   bool      // the frontend has bpf.SvcFlagRevStored
}

func variants() []variant {
	var out []variant
	for _, fam := range []variant{
		{name: "ipv4", client: netip.MustParseAddr("10.0.0.1"), vip: netip.MustParseAddrPort("10.96.0.10:80"),
			backends: [3]netip.AddrPort{netip.MustParseAddrPort("10.1.0.1:8080"), netip.MustParseAddrPort("10.1.0.2:8080"), netip.MustParseAddrPort("10.1.0.3:8081")},
			ids:      [3]uint32{1, 2, 3}},
		{name: "ipv6", client: netip.MustParseAddr("fd00::1"), vip: netip.MustParseAddrPort("[fd00:96::10]:80"),
			backends: [3]netip.AddrPort{netip.MustParseAddrPort("[fd00:1::1]:8080"), netip.MustParseAddrPort("[fd00:1::2]:8080"), netip.MustParseAddrPort("[fd00:1::3]:8081")},
			ids:      [3]uint32{4, 5, 6}},
	} {
		for _, p := range []struct {
			name  string
			proto uint8
		}{{"tcp", ProtoTCP}, {"udp", ProtoUDP}} {
			v := fam
			v.name += "_" + p.name
			v.proto = p.proto
			out = append(out, v)
		}
	}
	return out
}

// storedVariants are the variants on a frontend with bpf.SvcFlagRevStored
// (a VIP of its own, so that its flows never share a key with the derived
// variant's): every new flow stores a reverse-NAT half, as every east-west
// flow of program generation 3 did. The frontend is past the slots of its
// backends' fluxvm_be2fe entries (bpftest), so replies are translated by
// the stored halves only.
func storedVariants() []variant {
	out := variants()
	for i := range out {
		out[i].name += "_stored"
		out[i].stored = true
		out[i].vip = netip.AddrPortFrom(out[i].vip.Addr().Next(), out[i].vip.Port())
	}
	return out
}

// halves is the number of reverse-NAT halves one east-west flow of the
// variant has: 1 stored, 0 with derived replies.
func (v variant) halves() int {
	if v.stored {
		return 1
	}
	return 0
}

const sid = 7 // the service under test

func (v variant) flow(port uint16) Key {
	return Key{Client: netip.AddrPortFrom(v.client, port), VIP: v.vip, Proto: v.proto}
}

// natOf is the reverse-NAT key of flow k on the variant's backend i.
func (v variant) natOf(k Key, i int) nat.Key {
	return nat.Key{Backend: v.backends[i], Client: k.Client, Proto: k.Proto}
}

// setup installs the service with its three backends Ready and a table
// that sends every new flow to the first; a stored variant's frontend has
// bpf.SvcFlagRevStored.
func (v variant) setup(d *dataplane) {
	for i, b := range v.backends {
		d.backend(v.ids[i], sid, b, bpf.BackendReady, 0)
	}
	var flags uint32
	if v.stored {
		flags = bpf.SvcFlagRevStored
	}
	d.serviceFlags(sid, v.vip, v.proto, flags, v.ids[0])
}

// established is the packet sequence that leaves a flow established (TCP)
// or simply learned (UDP).
var established = []pkt.TCPFlags{pkt.SYN, pkt.ACK}

// testTimeouts are distinct from the defaults and from each other, so a
// test can tell which one the datapath and GC applied.
var testTimeouts = Timeouts{
	TCPSyn: 20 * time.Second, TCPEstablished: 300 * time.Second,
	TCPFin: 15 * time.Second, TCPRst: 5 * time.Second, UDP: 40 * time.Second,
}

func TestNewValidatesConfig(t *testing.T) {
	testenv.RequirePrivileged(t)
	spec, err := bpf.Spec(bpf.TierS)
	if err != nil {
		t.Fatal(err)
	}
	mk := func(name string) *ebpf.Map {
		ms := spec.Maps[name].Copy()
		ms.MaxEntries = min(ms.MaxEntries, 64)
		m, err := ebpf.NewMap(ms)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	ct4, ct6, nat4, nat6, be := mk("fluxvm_fct4"), mk("fluxvm_fct6"), mk("fluxvm_nat4"), mk("fluxvm_nat6"), mk("fluxvm_backends")
	tab, err := nat.New(nat4, nat6)
	if err != nil {
		t.Fatal(err)
	}
	good := Config{CT4: ct4, CT6: ct6, Backends: be, NAT: tab}
	with := func(f func(*Config)) Config { c := good; f(&c); return c }
	tests := []struct {
		name    string
		cfg     Config
		wantErr error
	}{
		{"real maps, default timeouts", good, nil},
		{"explicit timeouts", with(func(c *Config) { c.Timeouts = testTimeouts }), nil},
		{"zero config", Config{}, ErrInvalidMap},
		{"nil ct6", with(func(c *Config) { c.CT6 = nil }), ErrInvalidMap},
		{"families swapped", with(func(c *Config) { c.CT4, c.CT6 = ct6, ct4 }), ErrInvalidMap},
		{"nat map as conntrack", with(func(c *Config) { c.CT4 = nat4 }), ErrInvalidMap},
		{"conntrack map as backends", with(func(c *Config) { c.Backends = ct4 }), ErrInvalidMap},
		{"no nat table", with(func(c *Config) { c.NAT = nil }), ErrInvalidMap},
		{"partial timeouts", with(func(c *Config) { c.Timeouts = Timeouts{UDP: time.Minute} }), ErrInvalidTimeout},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := New(tt.cfg)
			if tt.wantErr == nil {
				if err != nil {
					t.Fatal(err)
				}
				want := tt.cfg.Timeouts
				if want == (Timeouts{}) {
					want = DefaultTimeouts()
				}
				if m.Timeouts() != want {
					t.Errorf("timeouts %+v, want %+v", m.Timeouts(), want)
				}
				return
			}
			if !errors.Is(err, tt.wantErr) || m != nil {
				t.Fatalf("New = %v, %v; want %v", m, err, tt.wantErr)
			}
		})
	}
}

func TestTimeoutsValidate(t *testing.T) {
	def := DefaultTimeouts()
	with := func(f func(*Timeouts)) Timeouts { to := def; f(&to); return to }
	tests := []struct {
		name    string
		to      Timeouts
		wantErr string // substring; "" = valid
	}{
		{"defaults", def, ""},
		{"test timeouts", testTimeouts, ""},
		{"bounds are inclusive", Timeouts{MinTimeout, MaxTimeout, MinTimeout, MinTimeout, MaxTimeout}, ""},
		{"zero value", Timeouts{}, "tcp syn timeout is not set"},
		{"one zero", with(func(to *Timeouts) { to.TCPRst = 0 }), "tcp rst timeout is not set"},
		{"negative", with(func(to *Timeouts) { to.UDP = -time.Second }), "udp timeout -1s is outside"},
		{"below the refresh margin", with(func(to *Timeouts) { to.TCPFin = time.Second }), "tcp fin timeout 1s is outside"},
		{"above the cap", with(func(to *Timeouts) { to.TCPEstablished = 8 * 24 * time.Hour }), "tcp established timeout 192h0m0s is outside"},
		{"fraction of a second", with(func(to *Timeouts) { to.TCPSyn = 2500 * time.Millisecond }), "not a whole number of seconds"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.to.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, ErrInvalidTimeout) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Validate() = %v, want ErrInvalidTimeout mentioning %q", err, tt.wantErr)
			}
			var m bpf.Meta
			if err := tt.to.ApplyTo(&m); !errors.Is(err, ErrInvalidTimeout) || m != (bpf.Meta{}) {
				t.Errorf("ApplyTo of invalid timeouts = %v and wrote %+v", err, m)
			}
		})
	}
}

func TestTimeoutsMeta(t *testing.T) {
	m := bpf.Meta{SchemaVersion: bpf.SchemaVersion, ProgramGeneration: 3, Tier: 2, HashSeed: 42}
	if err := testTimeouts.ApplyTo(&m); err != nil {
		t.Fatal(err)
	}
	want := bpf.Meta{SchemaVersion: bpf.SchemaVersion, ProgramGeneration: 3, Tier: 2, HashSeed: 42,
		TimeoutTcpSynS: 20, TimeoutTcpEstablishedS: 300, TimeoutTcpFinS: 15, TimeoutTcpRstS: 5, TimeoutUdpS: 40}
	if m != want {
		t.Errorf("ApplyTo wrote %+v\nwant %+v", m, want)
	}
	if got := TimeoutsFromMeta(m); got != testTimeouts {
		t.Errorf("round trip: %+v", got)
	}
	if got := TimeoutsFromMeta(bpf.Meta{}); got != DefaultTimeouts() {
		t.Errorf("zero meta: %+v, want the defaults", got)
	}
	if got := TimeoutsFromMeta(bpf.Meta{TimeoutUdpS: 90}); got.UDP != 90*time.Second || got.TCPSyn != DefaultTimeouts().TCPSyn {
		t.Errorf("partly set meta: %+v", got)
	}
	for s, want := range map[bpf.CTState]time.Duration{
		bpf.CTTCPSyn: 20 * time.Second, bpf.CTTCPEstablished: 300 * time.Second, bpf.CTTCPFin: 15 * time.Second,
		bpf.CTTCPRst: 5 * time.Second, bpf.CTUDP: 40 * time.Second, bpf.CTNone: 40 * time.Second,
	} {
		if got := testTimeouts.For(s); got != want {
			t.Errorf("For(%s) = %v, want %v", s, got, want)
		}
	}
	if err := testTimeouts.ApplyTo(nil); err == nil {
		t.Error("ApplyTo(nil) succeeded")
	}
}

// stateCases drive a flow into each protocol state with real packets.
var stateCases = []struct {
	name  string
	proto uint8
	flags []pkt.TCPFlags
	state bpf.CTState
}{
	{"tcp syn", ProtoTCP, []pkt.TCPFlags{pkt.SYN}, bpf.CTTCPSyn},
	{"tcp established", ProtoTCP, []pkt.TCPFlags{pkt.SYN, pkt.ACK}, bpf.CTTCPEstablished},
	{"tcp fin", ProtoTCP, []pkt.TCPFlags{pkt.SYN, pkt.ACK, pkt.FIN}, bpf.CTTCPFin},
	{"tcp rst", ProtoTCP, []pkt.TCPFlags{pkt.SYN, pkt.RST}, bpf.CTTCPRst},
	{"udp", ProtoUDP, []pkt.TCPFlags{{}}, bpf.CTUDP},
}

// TestDatapathUsesAppliedTimeouts: the meta fields ApplyTo writes are the
// ones the program reads, state by state.
func TestDatapathUsesAppliedTimeouts(t *testing.T) {
	d := sharedDataplane(t)
	v := variants()[0]
	for i, sc := range stateCases {
		t.Run(sc.name, func(t *testing.T) {
			d.t = t
			v.proto = sc.proto
			v.setup(d)
			k := v.flow(uint16(41000 + i))
			d.send(k, sc.flags...)
			e, ok := d.lookup(k)
			if !ok {
				t.Fatal("no entry")
			}
			if e.State != sc.state || e.Deadline-e.LastSeen != testTimeouts.For(sc.state) {
				t.Errorf("state %s, deadline last seen + %v; want %s, + %v", e.State, e.Deadline-e.LastSeen, sc.state, testTimeouts.For(sc.state))
			}
		})
	}
}

func TestLookupListDelete(t *testing.T) {
	d := sharedDataplane(t)
	vs := variants()
	// Service sid on every variant, flows 0..5 of each; a second service
	// 8 on the first variant's VIP port 81 with flows on backend 2.
	type flow struct {
		v   variant
		k   Key
		sid uint32
		bid uint32
	}
	var flows []flow
	before := now(t)
	for _, v := range vs {
		v.setup(d)
		for p := range 6 {
			k := v.flow(uint16(42000 + p))
			d.send(k)
			flows = append(flows, flow{v, k, sid, v.ids[0]})
		}
	}
	v8 := vs[0]
	v8.vip = netip.AddrPortFrom(v8.vip.Addr(), 81)
	d.backend(10, 8, v8.backends[1], bpf.BackendReady, 0)
	d.service(8, v8.vip, v8.proto, 10)
	for p := range 3 {
		k := v8.flow(uint16(43000 + p))
		d.send(k)
		flows = append(flows, flow{v8, k, 8, 10})
	}

	t.Run("lookup", func(t *testing.T) {
		for _, f := range flows {
			e, err := d.ct.Lookup(f.k)
			if err != nil {
				t.Fatal(err)
			}
			state := bpf.CTTCPSyn
			if f.k.Proto == ProtoUDP {
				state = bpf.CTUDP
			}
			// Every frontend here lets the index find its flows: their
			// replies are derived, and they have no reverse-NAT half.
			if e.Key != f.k || e.ServiceID != f.sid || e.BackendID != f.bid || e.State != state ||
				e.Kind != EastWest || !e.ReverseDerived || e.HasNATHalf() {
				t.Errorf("%s: %+v", f.k, e)
			}
			if e.Created < before-time.Second || e.Created > now(t)+time.Second || e.LastSeen != e.Created ||
				e.Deadline != e.LastSeen+testTimeouts.For(state) {
				t.Errorf("%s: times created %v last %v deadline %v, now %v", f.k, e.Created, e.LastSeen, e.Deadline, before)
			}
			if e.Expired(e.Deadline) || !e.Expired(e.Deadline+1) {
				t.Errorf("Expired is not deadline < now")
			}
		}
		mapped := flows[0].k
		mapped.Client = netip.AddrPortFrom(netip.AddrFrom16(mapped.Client.Addr().As16()), mapped.Client.Port())
		mapped.VIP = netip.AddrPortFrom(netip.AddrFrom16(mapped.VIP.Addr().As16()), mapped.VIP.Port())
		if e, err := d.ct.Lookup(mapped); err != nil || e.Key != flows[0].k {
			t.Errorf("IPv4-mapped lookup: %+v, %v", e, err)
		}
		if all, err := d.nat.List(nat.Filter{}); err != nil || len(all) != 0 {
			t.Errorf("the datapath learned reverse-NAT entries for derived flows: %+v, %v", all, err)
		}
	})

	filters := []struct {
		name string
		f    Filter
	}{
		{"all", Filter{}},
		{"ipv4", Filter{Family: IPv4}},
		{"ipv6", Filter{Family: IPv6}},
		{"service 8", Filter{ServiceIDs: []uint32{8}}},
		{"backend 1", Filter{BackendIDs: []uint32{1}}},
		{"ipv6 service 8", Filter{Family: IPv6, ServiceIDs: []uint32{8}}},
		{"services 7 and 8 on backends 4 and 10", Filter{ServiceIDs: []uint32{7, 8}, BackendIDs: []uint32{4, 10}}},
	}
	for _, m := range []string{"batch", "iterate"} {
		for _, ft := range filters {
			t.Run("list "+m+" "+ft.name, func(t *testing.T) {
				d.ct.mode.SetBatch(!(m == "iterate"))
				d.ct.chunk = mapscan.MinChunk
				t.Cleanup(func() { d.ct.mode.SetBatch(!(false)); d.ct.chunk = mapscan.DefaultChunk })
				var want []Key
				for _, f := range flows {
					if (ft.f.Family == 0 || ft.f.Family == f.k.Family()) &&
						(ft.f.ServiceIDs == nil || slices.Contains(ft.f.ServiceIDs, f.sid)) &&
						(ft.f.BackendIDs == nil || slices.Contains(ft.f.BackendIDs, f.bid)) {
						want = append(want, f.k)
					}
				}
				got, err := d.ct.List(ft.f)
				if err != nil {
					t.Fatal(err)
				}
				var keys []Key
				for _, e := range got {
					keys = append(keys, e.Key)
				}
				cmp := func(a, b Key) int { return strings.Compare(a.String(), b.String()) }
				slices.SortFunc(keys, cmp)
				slices.SortFunc(want, cmp)
				if !slices.Equal(keys, want) {
					t.Errorf("List: %v\nwant %v", keys, want)
				}
			})
		}
	}

	t.Run("delete removes a derived flow, which has no half", func(t *testing.T) {
		for _, f := range flows[:4] {
			if err := d.ct.Delete(f.k); err != nil {
				t.Fatal(err)
			}
			if _, ok := d.lookup(f.k); ok {
				t.Errorf("%s: conntrack entry survived", f.k)
			}
			if err := d.ct.Delete(f.k); !errors.Is(err, ErrNotFound) || !errors.Is(err, ebpf.ErrKeyNotExist) {
				t.Errorf("second delete: %v", err)
			}
		}
		if _, err := d.ct.Lookup(flows[0].k); !errors.Is(err, ErrNotFound) {
			t.Errorf("lookup after delete: %v", err)
		}
	})

	t.Run("delete of a derived flow leaves a NAT entry that belongs to another flow", func(t *testing.T) {
		// Another backend id's half at the key: another flow's (a
		// failover's, a reused tuple's), not this one's leftover.
		f := flows[4]
		nk := f.v.natOf(f.k, 0)
		d.must(d.nat.Put(nat.Entry{Key: nk, VIP: f.k.VIP, ServiceID: f.sid, BackendID: 3, LastSeen: now(t)}))
		d.must(d.ct.Delete(f.k))
		if _, ok := d.natLookup(nk); !ok {
			t.Error("the other flow's NAT half was deleted")
		}
		d.must(d.nat.Delete(nk))
	})

	t.Run("delete of a derived flow removes its tuple's leftover half", func(t *testing.T) {
		// A half naming this flow's VIP and backend is an earlier, stored
		// flow's on the tuple. Left alone without the entry, GC would take
		// it for a stored flow whose conntrack half the LRU evicted and
		// bring the deleted flow back.
		f := flows[5]
		nk := f.v.natOf(f.k, 0)
		t0 := now(t)
		d.must(d.nat.Put(nat.Entry{Key: nk, VIP: f.k.VIP, ServiceID: f.sid, BackendID: f.bid, LastSeen: t0}))
		d.must(d.ct.Delete(f.k))
		if _, ok := d.natLookup(nk); ok {
			t.Error("the leftover half survived")
		}
		if res := d.gc(t0); res.CTRepaired != 0 {
			t.Errorf("GC revived the deleted flow: %v", res)
		}
		if _, ok := d.lookup(f.k); ok {
			t.Error("the deleted flow is back")
		}
	})

	t.Run("delete removes both halves of a stored flow", func(t *testing.T) {
		sv := storedVariants()[0]
		sv.setup(d)
		k := sv.flow(43100)
		d.send(k)
		e, _ := d.lookup(k)
		if e.ReverseDerived || !e.HasNATHalf() {
			t.Fatalf("stored flow reads as %+v", e)
		}
		if _, ok := d.natLookup(sv.natOf(k, 0)); !ok {
			t.Fatal("the stored flow has no NAT half")
		}
		d.must(d.ct.Delete(k))
		if _, ok := d.lookup(k); ok {
			t.Error("conntrack entry survived")
		}
		if _, ok := d.natLookup(sv.natOf(k, 0)); ok {
			t.Error("NAT half survived")
		}
	})

	t.Run("delete of a stored flow leaves a NAT half that belongs to another flow", func(t *testing.T) {
		// After a failover the old backend's NAT key may hold another
		// flow's half; Delete checks the value before removing it.
		sv := storedVariants()[0]
		k := sv.flow(43101)
		d.send(k)
		nk := sv.natOf(k, 0)
		e, _ := d.natLookup(nk)
		e.BackendID = 3
		d.must(d.nat.Put(e))
		d.must(d.ct.Delete(k))
		if _, ok := d.natLookup(nk); !ok {
			t.Error("the other flow's NAT half was deleted")
		}
	})

	t.Run("invalid keys", func(t *testing.T) {
		for _, k := range []Key{
			{},
			{Client: flows[0].k.Client, VIP: vs[2].vip, Proto: ProtoTCP},
			{Client: flows[0].k.Client, VIP: flows[0].k.VIP, Proto: 1},
		} {
			if _, err := d.ct.Lookup(k); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("Lookup(%s) = %v", k, err)
			}
			if err := d.ct.Delete(k); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("Delete(%s) = %v", k, err)
			}
		}
	})
}
