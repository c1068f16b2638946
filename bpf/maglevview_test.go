package bpf

import (
	"net/netip"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestViewMaglevBackends: a view reads every frontend's Maglev table as
// the backend endpoint of each slot, IPv4 and IPv6, VIP markers left out,
// an empty table for a frontend without one; a slot naming a backend the
// backends map does not hold fails the read, naming the frontend and the
// slot.
func TestViewMaglevBackends(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS})
	m := d.Maps()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	vip4, vip6 := netip.MustParseAddr("10.96.0.1"), netip.MustParseAddr("fd00:96::1")
	be := map[uint32]netip.AddrPort{
		7: netip.MustParseAddrPort("10.0.0.7:8080"), 8: netip.MustParseAddrPort("10.0.0.8:9090"),
		11: netip.MustParseAddrPort("[fd00::11]:8080"),
	}
	for id, ap := range be {
		fam := FamilyIPv6
		if ap.Addr().Is4() {
			fam = FamilyIPv4
		}
		must(m.FluxvmBackends.Put(id, Backend{Addr: AddrWords(ap.Addr()), Port: Port(ap.Port()), Family: fam, State: uint8(BackendReady)}))
	}
	// Frontends: 10.96.0.1:80/tcp (sid 3), its VIP marker, [fd00:96::1]:53/udp
	// (sid 4, a table), [fd00:96::1]:80/tcp (sid 5, no table).
	must(m.FluxvmSvc4.Put(SvcKey4{Vip: AddrWords(vip4)[0], Port: Port(80), Proto: 6}, SvcValue{ServiceId: 3}))
	must(m.FluxvmSvc4.Put(SvcKey4{Vip: AddrWords(vip4)[0], Proto: 6}, SvcValue{ServiceId: 3, Flags: SvcFlagVIPMarker}))
	must(m.FluxvmSvc6.Put(SvcKey6{Vip: AddrWords(vip6), Port: Port(53), Proto: 17}, SvcValue{ServiceId: 4}))
	must(m.FluxvmSvc6.Put(SvcKey6{Vip: AddrWords(vip6), Port: Port(80), Proto: 6}, SvcValue{ServiceId: 5}))
	table := func(sid uint32, ids ...uint32) {
		t.Helper()
		ms := d.Spec().Maps["fluxvm_maglev"].InnerMap.Copy()
		ms.MaxEntries = uint32(len(ids))
		inner, err := ebpf.NewMap(ms)
		must(err)
		defer inner.Close()
		for i, id := range ids {
			must(inner.Put(uint32(i), id))
		}
		must(m.FluxvmMaglev.Put(sid, inner))
	}
	var ids3 []uint32
	want3 := make([]netip.AddrPort, 0, 13)
	for i := range 13 {
		id := []uint32{7, 8, 7}[i%3]
		ids3 = append(ids3, id)
		want3 = append(want3, be[id])
	}
	table(3, ids3...)
	table(4, 11, 11, 11, 11, 11)

	v, err := OpenView(root)
	must(err)
	defer v.Close()
	got, err := v.MaglevBackends()
	must(err)
	want := map[Frontend][]netip.AddrPort{
		{VIP: vip4, Port: 80, Proto: 6}:  want3,
		{VIP: vip6, Port: 53, Proto: 17}: {be[11], be[11], be[11], be[11], be[11]},
		{VIP: vip6, Port: 80, Proto: 6}:  {},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("tables %v\nwant %v", got, want)
	}
	for fe, s := range map[Frontend]string{
		{VIP: vip4, Port: 80, Proto: 6}:  "10.96.0.1:80/tcp",
		{VIP: vip6, Port: 53, Proto: 17}: "[fd00:96::1]:53/udp",
		{VIP: vip6, Port: 1, Proto: 132}: "[fd00:96::1]:1/proto-132",
	} {
		if fe.String() != s {
			t.Errorf("%#v prints %q, want %q", fe, fe.String(), s)
		}
	}

	// A slot naming a backend the backends map does not hold.
	table(4, 11, 11, 12, 11, 11)
	if _, err := v.MaglevBackends(); err == nil || !strings.Contains(err.Error(), "[fd00:96::1]:53/udp (service 4) slot 2") {
		t.Errorf("a table naming backend 12, which is unused: %v", err)
	}
}
