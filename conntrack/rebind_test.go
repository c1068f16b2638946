package conntrack

import (
	"net/netip"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestRebind: after Rebind the Map reads and writes the new maps and
// hands back the old ones; maps of another layout are refused and the
// binding stays.
func TestRebind(t *testing.T) {
	testenv.RequirePrivileged(t)
	newMap := func(name string, key uintptr) *ebpf.Map {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Name: name, Type: ebpf.LRUHash, KeySize: uint32(key),
			ValueSize: uint32(unsafe.Sizeof(bpf.CTValue{})), MaxEntries: 64})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	d := sharedDataplane(t)
	m := d.ct
	old4, old6 := m.flows.Load().ct4, m.flows.Load().ct6
	new4, new6 := newMap("fluxvm_fct4", unsafe.Sizeof(bpf.Tuple4{})), newMap("fluxvm_fct6", unsafe.Sizeof(bpf.Tuple6{}))
	if _, err := m.Rebind(new6, new4); err == nil {
		t.Fatal("Rebind accepted the families swapped")
	}
	if m.flows.Load().ct4 != old4 {
		t.Fatal("a refused Rebind changed the binding")
	}
	wait, err := m.Rebind(new4, new6)
	if err != nil {
		t.Fatal(err)
	}
	if got4, got6 := wait(); got4 != old4 || got6 != old6 {
		t.Fatalf("Rebind handed back %p %p, want %p %p", got4, got6, old4, old6)
	}
	t.Cleanup(func() {
		if w, err := m.Rebind(old4, old6); err == nil {
			w()
		}
	})
	now, err := Now()
	if err != nil {
		t.Fatal(err)
	}
	k := Key{Client: netip.MustParseAddrPort("10.9.9.9:4000"), VIP: netip.MustParseAddrPort("10.96.0.10:80"), Proto: ProtoTCP}
	e := Entry{Key: k, ServiceID: 1, BackendID: 1, State: bpf.CTTCPEstablished, Kind: EastWest,
		Created: now, LastSeen: now, Deadline: now + time.Hour}
	if _, err := m.Restore(e, false); err != nil {
		t.Fatal(err)
	}
	var v bpf.CTValue
	if err := new4.Lookup(key4(k), &v); err != nil {
		t.Errorf("the restored entry is not in the new map: %v", err)
	}
	if err := old4.Lookup(key4(k), &v); err == nil {
		t.Error("the restored entry went into the old map")
	}
	if got, err := m.Lookup(k); err != nil || got.BackendID != 1 {
		t.Errorf("Lookup through the rebound Map: %+v, %v", got, err)
	}
}
