package bpf

import (
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

func progID(t *testing.T, p *ebpf.Program) ebpf.ProgramID {
	t.Helper()
	info, err := p.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return id
}

func pinnedMapID(t *testing.T, root, name string) ebpf.MapID {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(mapDir(root), name), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return id
}

func mapID(t *testing.T, m *ebpf.Map) ebpf.MapID {
	t.Helper()
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return id
}

// TestStagedTierChange: a tier change opened with Staged leaves the
// attached programs, and the pinned maps they run on, exactly as they were
// until Activate, so that no packet meets the new tier's maps before the
// caller has written them (issue 14, point 3). Activate then switches the
// attachments and catches up the flows the old programs learned meanwhile;
// the migration counts are exact (point 4).
func TestStagedTierChange(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, rx, err := testenv.VethPair("fvtx", "fvrx")
		if err != nil {
			t.Fatal(err)
		}
		idx := rx.Attrs().Index
		d := openT(t, Options{PinRoot: root, Tier: TierS, SocketLB: true})
		if _, err := d.Attach(Interface{Index: idx}, HookFromVM); err != nil {
			t.Fatal(err)
		}
		putCT(t, d, 1000)
		// A socket LB association (a lifecycle map too).
		sockKey := SockRevKey{Cookie: 77, Addr: [4]uint32{0x0a000001}, Port: Port(8080), Proto: 17, Family: FamilyIPv4}
		sockVal := SockRevValue{Vip: [4]uint32{0x0a60000a}, Vport: Port(53), Family: FamilyIPv4, ServiceId: 1, BackendId: 2}
		if err := d.Maps().FluxvmSockRev.Put(sockKey, sockVal); err != nil {
			t.Fatal(err)
		}
		oldProg := progID(t, d.Programs().FluxvmFromVm)
		oldSvc := pinnedMapID(t, root, "fluxvm_svc4")
		// The old maps stay reachable through this handle after Close,
		// as they do through the attached program.
		oldCT, err := d.Maps().FluxvmFct4.Clone()
		if err != nil {
			t.Fatal(err)
		}
		defer oldCT.Close()
		oldSock, err := d.Maps().FluxvmSockRev.Clone()
		if err != nil {
			t.Fatal(err)
		}
		defer oldSock.Close()
		d.Close()

		d = openT(t, Options{PinRoot: root, Tier: TierM, Staged: true, SocketLB: true})
		st := d.Status()
		// 1000 flows and the socket association.
		if !st.TierChanged || st.Migrated != 1001 || st.NotMigrated != 0 {
			t.Errorf("status %+v, want a tier change with 1001 migrated", st)
		}
		if got := tcxPrograms(t, idx, ebpf.AttachTCXIngress); len(got) != 1 || got[0] != oldProg {
			t.Errorf("before Activate the hook runs %v, want the old program %d", got, oldProg)
		}
		// Attaching again before Activate, as a caller restoring its
		// interfaces does, leaves the pinned link to Activate.
		if _, err := d.Attach(Interface{Index: idx}, HookFromVM); err != nil {
			t.Fatal(err)
		}
		if got := tcxPrograms(t, idx, ebpf.AttachTCXIngress); len(got) != 1 || got[0] != oldProg {
			t.Errorf("Attach before Activate: the hook runs %v, want the old program %d until Activate", got, oldProg)
		}
		if got := pinnedMapID(t, root, "fluxvm_svc4"); got != oldSvc {
			t.Errorf("before Activate the fluxvm_svc4 pin is map %d, want the old map %d", got, oldSvc)
		}
		// The running programs' meta map still says what they are.
		pm, err := ebpf.LoadPinnedMap(filepath.Join(mapDir(root), "fluxvm_meta"), nil)
		if err != nil {
			t.Fatal(err)
		}
		var meta Meta
		if err := pm.Lookup(uint32(0), &meta); err != nil || Tier(meta.Tier) != TierS {
			t.Errorf("before Activate the pinned meta is %+v (%v), want tier S", meta, err)
		}
		pm.Close()

		// Flows the old program learns or changes before the switch.
		now, err := monotonicCoarse()
		if err != nil {
			t.Fatal(err)
		}
		learned := ctKey(5000)
		if err := oldCT.Put(learned, CTValue{ServiceId: 1, BackendId: 2, LastSeenNs: now, State: uint8(CTTCPSyn)}); err != nil {
			t.Fatal(err)
		}
		changed := ctKey(7)
		if err := oldCT.Put(changed, CTValue{ServiceId: 1, BackendId: 2, LastSeenNs: now, State: uint8(CTTCPFin)}); err != nil {
			t.Fatal(err)
		}

		// A socket that connects before the switch, through the old
		// programs.
		lateKey := sockKey
		lateKey.Cookie = 78
		if err := oldSock.Put(lateKey, sockVal); err != nil {
			t.Fatal(err)
		}

		if err := d.Activate(); err != nil {
			t.Fatal(err)
		}
		st = d.Status()
		newProg := progID(t, d.Programs().FluxvmFromVm)
		if got := tcxPrograms(t, idx, ebpf.AttachTCXIngress); len(got) != 1 || got[0] != newProg {
			t.Errorf("after Activate the hook runs %v, want the new program %d", got, newProg)
		}
		if got, want := pinnedMapID(t, root, "fluxvm_svc4"), mapID(t, d.Maps().FluxvmSvc4); got != want {
			t.Errorf("after Activate the fluxvm_svc4 pin is map %d, want the new map %d", got, want)
		}
		var v CTValue
		if err := d.Maps().FluxvmFct4.Lookup(learned, &v); err != nil {
			t.Errorf("flow learned before the switch lost: %v", err)
		}
		if err := d.Maps().FluxvmFct4.Lookup(changed, &v); err != nil || CTState(v.State) != CTTCPFin {
			t.Errorf("flow changed before the switch: %+v, %v; want its FIN state", v, err)
		}
		for _, k := range []SockRevKey{sockKey, lateKey} {
			var sv SockRevValue
			if err := d.Maps().FluxvmSockRev.Lookup(k, &sv); err != nil || sv != sockVal {
				t.Errorf("socket %d's association after the tier change: %+v, %v; want %+v", k.Cookie, sv, err, sockVal)
			}
		}
		var ct Migration
		for _, mg := range st.Migrations {
			if mg.Map == "fluxvm_fct4" {
				ct = mg
			}
		}
		// One flow learned meanwhile (a new entry), one changed (copied
		// at Open already): 1001 entries, 2 caught up.
		if ct.Entries != 1001 || ct.Migrated != 1001 || ct.Evicted != 0 || ct.Refused != 0 || ct.CaughtUp != 2 {
			t.Errorf("fluxvm_fct4 migration %+v, want 1001 entries migrated, 2 caught up", ct)
		}
		sum := 0
		for _, mg := range st.Migrations {
			sum += mg.Migrated
		}
		// 1001 flows, the socket migrated at Open and the one caught up.
		if st.Migrated != 1003 || st.Migrated != sum || st.NotMigrated != 0 {
			t.Errorf("totals: migrated %d (maps sum to %d), not migrated %d; want 1003 and 0", st.Migrated, sum, st.NotMigrated)
		}
		if err := d.Activate(); err != nil {
			t.Errorf("second Activate: %v", err)
		}
		if err := d.Remove(); err != nil {
			t.Fatal(err)
		}
	})
}

// TestMigrationCountsWhenTheTierShrinks: more flows than the smaller tier
// holds; every entry is accounted for, none negative.
func TestMigrationCountsWhenTheTierShrinks(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierM})
	putCT(t, d, 70000)
	d.Close()
	d = openT(t, Options{PinRoot: root, Tier: TierS})
	st := d.Status()
	for _, mg := range st.Migrations {
		if mg.Entries < 0 || mg.Migrated < 0 || mg.Evicted < 0 || mg.Refused < 0 || mg.CaughtUp < 0 ||
			mg.Entries != mg.Migrated+mg.Evicted+mg.Refused {
			t.Errorf("%s: %+v does not add up", mg.Map, mg)
		}
		if mg.Map == "fluxvm_fct4" {
			if mg.Entries != 70000 || mg.Evicted == 0 || mg.Migrated != count(t, d.Maps().FluxvmFct4) {
				t.Errorf("fluxvm_fct4: %+v, want 70000 entries, some evicted, the rest present", mg)
			}
			t.Logf("M->S: %+v", mg)
		}
	}
}
