package nat

import (
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/bpftest"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// dataplane is the real TC object of tier S with its lifecycle maps
// shrunk (bpftest), in a network namespace thread of its own, and the
// Table over its reverse-NAT maps.
type dataplane struct {
	t     testing.TB
	th    *testenv.Thread
	o     *bpftest.Object
	table *Table
}

// newDataplane loads the object with the lifecycle maps shrunk to entries.
func newDataplane(t testing.TB, entries uint32) *dataplane {
	t.Helper()
	d := &dataplane{t: t, th: testenv.NewThread(t)}
	o, err := bpftest.Load(bpf.TierS, bpftest.Sizes{CT: entries, NAT: entries})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	d.o = o
	if d.table, err = New(o.Maps.FluxvmNat4, o.Maps.FluxvmNat6); err != nil {
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
	d.must(d.o.Service(sid, vip, proto, 0, bid))
}

// serviceFlags is service with frontend flags (bpf.SvcFlag*).
func (d *dataplane) serviceFlags(sid uint32, vip netip.AddrPort, proto uint8, flags uint32, bid uint32) {
	d.t.Helper()
	d.must(d.o.Service(sid, vip, proto, flags, bid))
}

func (d *dataplane) backend(id, sid uint32, ap netip.AddrPort) {
	d.t.Helper()
	d.must(d.o.Backend(id, sid, ap, bpf.BackendReady, 0))
}

var frame = bpftest.Frame

// run passes one frame through prog in the test's namespace.
func (d *dataplane) run(prog *ebpf.Program, in []byte) (uint32, []byte) {
	d.t.Helper()
	var ret uint32
	var out []byte
	var err error
	d.th.Do(func() { ret, out, err = bpftest.Run(prog, in) })
	d.must(err)
	return ret, out
}

const tcOK = bpftest.TCOK

// forward sends client -> vip through the VM-edge program and requires it
// translated, which makes the program learn the flow: its conntrack entry,
// and its reverse-NAT entry if the frontend has bpf.SvcFlagRevStored.
func (d *dataplane) forward(client, vip netip.AddrPort, proto uint8) {
	d.t.Helper()
	if ret, _ := d.run(d.o.Programs.FluxvmFromVm, frame(client, vip, proto, pkt.SYN)); ret != tcOK {
		d.t.Fatalf("forward %s -> %s: verdict %d, want TC_ACT_OK", client, vip, int32(ret))
	}
}

// snatConfig writes the north-south SNAT configuration: addresses a4 and
// a6, ports [min, max].
func (d *dataplane) snatConfig(a4, a6 netip.Addr, min, max uint16) {
	d.t.Helper()
	d.must(d.o.SNAT(a4, a6, min, max))
}
