package nat

import (
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// dataplane is the real TC object of tier S, loaded with the lifecycle maps
// shrunk, plus the control-plane writes a test needs to make the program
// learn flows.
type dataplane struct {
	t    testing.TB
	th   *testenv.Thread
	spec *ebpf.CollectionSpec
	objs struct {
		FromVM   *ebpf.Program `ebpf:"fluxvm_from_vm"`
		ToVM     *ebpf.Program `ebpf:"fluxvm_to_vm"`
		NSIn     *ebpf.Program `ebpf:"fluxvm_ns_in"`
		Svc4     *ebpf.Map     `ebpf:"fluxvm_svc4"`
		Svc6     *ebpf.Map     `ebpf:"fluxvm_svc6"`
		Sguard   *ebpf.Map     `ebpf:"fluxvm_sguard"`
		Backends *ebpf.Map     `ebpf:"fluxvm_backends"`
		Maglev   *ebpf.Map     `ebpf:"fluxvm_maglev"`
		Nat4     *ebpf.Map     `ebpf:"fluxvm_nat4"`
		Nat6     *ebpf.Map     `ebpf:"fluxvm_nat6"`
		SNAT     *ebpf.Map     `ebpf:"fluxvm_snat"`
	}
	table *Table
}

// newDataplane loads the object inside a fresh network namespace thread.
// Preallocated lifecycle maps of 64k entries are pointless for tests, so
// they are shrunk to entries.
func newDataplane(t testing.TB, entries uint32) *dataplane {
	t.Helper()
	d := &dataplane{t: t, th: testenv.NewThread(t)}
	spec, err := bpf.Spec(bpf.TierS)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"} {
		spec.Maps[name].MaxEntries = entries
	}
	d.spec = spec
	if err := spec.LoadAndAssign(&d.objs, nil); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() {
		for _, c := range []interface{ Close() error }{d.objs.FromVM, d.objs.ToVM, d.objs.NSIn, d.objs.Svc4, d.objs.Svc6,
			d.objs.Sguard, d.objs.Backends, d.objs.Maglev, d.objs.Nat4, d.objs.Nat6, d.objs.SNAT} {
			c.Close()
		}
	})
	if d.table, err = New(d.objs.Nat4, d.objs.Nat6); err != nil {
		t.Fatal(err)
	}
	return d
}

// newTable returns a Table over fresh maps made from the object's own map
// specs, for tests that run no program: no verifier, no namespace.
func newTable(t testing.TB, entries uint32) *Table {
	t.Helper()
	testenv.RequirePrivileged(t)
	spec, err := bpf.Spec(bpf.TierS)
	if err != nil {
		t.Fatal(err)
	}
	mk := func(name string) *ebpf.Map {
		ms := spec.Maps[name].Copy()
		ms.MaxEntries = entries
		m, err := ebpf.NewMap(ms)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	tab, err := New(mk("fluxvm_nat4"), mk("fluxvm_nat6"))
	if err != nil {
		t.Fatal(err)
	}
	return tab
}

func (d *dataplane) must(err error) {
	d.t.Helper()
	if err != nil {
		d.t.Fatal(err)
	}
}

// service installs frontend vip/proto -> sid, opens its guard and points
// every slot of its Maglev table at backend bid.
func (d *dataplane) service(sid uint32, vip netip.AddrPort, proto uint8, bid uint32) {
	d.t.Helper()
	d.serviceFlags(sid, vip, proto, 0, bid)
}

// serviceFlags is service with frontend flags (bpf.SvcFlag*).
func (d *dataplane) serviceFlags(sid uint32, vip netip.AddrPort, proto uint8, flags uint32, bid uint32) {
	d.t.Helper()
	val := bpf.SvcValue{ServiceId: sid, Flags: flags, Revision: 1}
	w := bpf.AddrWords(vip.Addr())
	if vip.Addr().Is4() {
		d.must(d.objs.Svc4.Put(bpf.SvcKey4{Vip: w[0], Port: bpf.Port(vip.Port()), Proto: proto}, val))
	} else {
		d.must(d.objs.Svc6.Put(bpf.SvcKey6{Vip: w, Port: bpf.Port(vip.Port()), Proto: proto}, val))
	}
	d.must(d.objs.Sguard.Put(sid, bpf.Guard{State: bpf.GuardOpen, Revision: 1}))
	inner, err := ebpf.NewMap(d.spec.Maps["fluxvm_maglev"].InnerMap)
	d.must(err)
	defer inner.Close()
	n := inner.MaxEntries()
	keys, ids := make([]uint32, n), make([]uint32, n)
	for i := range keys {
		keys[i], ids[i] = uint32(i), bid
	}
	_, err = inner.BatchUpdate(keys, ids, nil)
	d.must(err)
	d.must(d.objs.Maglev.Put(sid, inner))
}

func (d *dataplane) backend(id, sid uint32, ap netip.AddrPort) {
	d.t.Helper()
	fam := uint8(bpf.FamilyIPv6)
	if ap.Addr().Is4() {
		fam = bpf.FamilyIPv4
	}
	d.must(d.objs.Backends.Put(id, bpf.Backend{
		Addr: bpf.AddrWords(ap.Addr()), Port: bpf.Port(ap.Port()), Family: fam,
		State: uint8(bpf.BackendReady), ServiceId: sid,
	}))
}

func frame(src, dst netip.AddrPort, proto uint8, f pkt.TCPFlags) []byte {
	if proto == ProtoTCP {
		return pkt.TCP(src, dst, f, []byte("fluxvm"))
	}
	return pkt.UDP(src, dst, []byte("fluxvm"))
}

// run passes one frame through prog in the test's namespace.
func (d *dataplane) run(prog *ebpf.Program, in []byte) (uint32, []byte) {
	d.t.Helper()
	opts := ebpf.RunOptions{Data: in, DataOut: make([]byte, len(in)+256), Repeat: 1}
	var ret uint32
	var err error
	d.th.Do(func() { ret, err = prog.Run(&opts) })
	d.must(err)
	return ret, opts.DataOut
}

const tcOK = 0 // TC_ACT_OK: translated

// forward sends client -> vip through the VM-edge program and requires it
// translated, which makes the program learn both halves of the flow.
func (d *dataplane) forward(client, vip netip.AddrPort, proto uint8) {
	d.t.Helper()
	if ret, _ := d.run(d.objs.FromVM, frame(client, vip, proto, pkt.SYN)); ret != tcOK {
		d.t.Fatalf("forward %s -> %s: verdict %d, want TC_ACT_OK", client, vip, int32(ret))
	}
}

// snatConfig writes the north-south SNAT configuration: addresses a4 and
// a6, ports [min, max].
func (d *dataplane) snatConfig(a4, a6 netip.Addr, min, max uint16) {
	d.t.Helper()
	d.must(d.objs.SNAT.Put(uint32(0), bpf.SNATConfig{
		Addr4: bpf.AddrWords(a4)[0], Addr6: bpf.AddrWords(a6),
		PortMin: min, PortMax: max, Flags: bpf.SNATFlagV4 | bpf.SNATFlagV6,
	}))
}
