package flows

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// ringMaps creates a tier-S ring and sequence, empty.
func ringMaps(t *testing.T) (ring, seq *ebpf.Map) {
	t.Helper()
	testenv.RequirePrivileged(t)
	spec, err := bpf.Spec(bpf.TierS)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []struct {
		name string
		m    **ebpf.Map
	}{{"fluxvm_sflows", &ring}, {"fluxvm_flow_seq", &seq}} {
		m, err := ebpf.NewMap(spec.Maps[p.name])
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		*p.m = m
	}
	return ring, seq
}

func TestReader(t *testing.T) {
	ring, seq := ringMaps(t)
	slots := uint64(ring.MaxEntries())
	mono := 1000 * time.Second
	wall := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	put := func(s uint64, rec bpf.FlowRecord) {
		t.Helper()
		rec.Seq = s
		if err := ring.Put(uint32(s&(slots-1)), rec); err != nil {
			t.Fatal(err)
		}
	}
	v4 := func(a string) [4]uint32 { return bpf.AddrWords(netip.MustParseAddr(a)) }
	// Records 1..10, alternately forwarded to 10.1.0.1 (service 1) and
	// dropped (service 2); record 3 was overwritten by a newer one that
	// the sequence does not count yet (a slot of the future): skipped.
	for s := uint64(1); s <= 10; s++ {
		rec := bpf.FlowRecord{Client: v4("10.0.0.1"), Cport: bpf.Port(uint16(40000 + s)), Vip: v4("10.96.0.10"), Vport: bpf.Port(80),
			Proto: 6, Family: bpf.FamilyIPv4, Hook: uint8(bpf.FlowHookFromVM), Ifindex: 7,
			FirstNs: uint64(mono - time.Duration(20-s)*time.Second), LastNs: uint64(mono - time.Duration(10-s)*time.Second)}
		if s%2 == 1 {
			rec.ServiceId, rec.Verdict, rec.Backend, rec.Bport, rec.BackendId = 1, uint8(bpf.FlowForwarded), v4("10.1.0.1"), bpf.Port(8080), 3
			rec.FwdPackets, rec.FwdBytes = s, 100*s
		} else {
			rec.ServiceId, rec.Verdict, rec.Reason, rec.Drops = 2, uint8(bpf.FlowDropped), uint8(bpf.DropNoBackend), 1
		}
		put(s, rec)
	}
	put(3+slots, bpf.FlowRecord{})
	if err := seq.Put(uint32(0), uint64(10)); err != nil {
		t.Fatal(err)
	}
	r := &Reader{Ring: ring, Seq: seq,
		Service:   func(id uint32) string { return map[uint32]string{1: "web", 2: "dead"}[id] },
		Interface: func(i int) string { return map[int]string{7: "vm1"}[i] },
		Now:       func() (time.Duration, time.Time, error) { return mono, wall, nil },
	}
	seqs := func(recs []Record) []uint64 {
		var out []uint64
		for _, x := range recs {
			out = append(out, x.Seq)
		}
		return out
	}
	for _, tc := range []struct {
		name  string
		limit int
		f     Filter
		want  []uint64
	}{
		{"all, newest first, the overwritten one skipped", 100, Filter{}, []uint64{10, 9, 8, 7, 6, 5, 4, 2, 1}},
		{"limit", 3, Filter{}, []uint64{10, 9, 8}},
		{"service", 100, Filter{Service: "web"}, []uint64{9, 7, 5, 1}},
		{"verdict", 2, Filter{Verdict: Dropped}, []uint64{10, 8}},
		{"backend", 100, Filter{Backend: netip.MustParseAddr("10.1.0.1")}, []uint64{9, 7, 5, 1}},
		{"since", 100, Filter{Since: wall.Add(-3 * time.Second)}, []uint64{10, 9, 8, 7}},
	} {
		got, err := r.Read(tc.limit, tc.f)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if g := seqs(got); len(g) != len(tc.want) || (len(g) > 0 && !equal(g, tc.want)) {
			t.Errorf("%s: seqs %v, want %v", tc.name, g, tc.want)
		}
	}
	got, _ := r.Read(1, Filter{Service: "web"})
	want := Record{Seq: 9, Service: "web", ServiceID: 1, BackendID: 3, Protocol: "tcp",
		Client: netip.MustParseAddrPort("10.0.0.1:40009"), VIP: netip.MustParseAddrPort("10.96.0.10:80"),
		Backend: netip.MustParseAddrPort("10.1.0.1:8080"), Verdict: Forwarded, Hook: "from_vm", Interface: "vm1",
		FirstSeen: wall.Add(-11 * time.Second), LastSeen: wall.Add(-time.Second), Forward: Counts{9, 900}}
	if len(got) != 1 || got[0] != want {
		t.Errorf("record:\n got %+v\nwant %+v", got, want)
	}
	got, _ = r.Read(1, Filter{Verdict: Dropped})
	if len(got) != 1 || got[0].Reason != "no_backend" || got[0].Drops != 1 || got[0].Backend.IsValid() || got[0].Service != "dead" {
		t.Errorf("drop record %+v", got)
	}
	for _, bad := range []int{0, -1, MaxLimit + 1} {
		if _, err := r.Read(bad, Filter{}); !errors.Is(err, ErrLimit) {
			t.Errorf("limit %d: %v, want ErrLimit", bad, err)
		}
	}
}

func equal(a, b []uint64) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return len(a) == len(b)
}
