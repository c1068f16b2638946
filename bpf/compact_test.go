package bpf

import (
	"errors"
	"path/filepath"
	"slices"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestCompactFlowMaps: the hard action rebuilds a flow map with the flows
// most costly to lose (established, then UDP, half-open, closed; the most
// recently seen first within a class) up to its budget, pins the new map
// in place of the old, switches the attached hooks to programs that use
// it, and leaves the generation marker as it found it; maps not named keep
// their objects.
func TestCompactFlowMaps(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, rx, err := testenv.VethPair("fvcx", "fvcr")
		if err != nil {
			t.Fatal(err)
		}
		d := openT(t, Options{PinRoot: root, Tier: TierS})
		for _, h := range []Hook{HookFromVM, HookToVM} {
			if _, err := d.Attach(Interface{Name: "fvcr"}, h); err != nil {
				t.Fatal(err)
			}
		}
		// 1,000 established, 500 UDP, 300 half-open, 200 closed, each
		// seen at a distinct time; the keys say which.
		type fill struct {
			state CTState
			n     int
		}
		fills := []fill{{CTTCPEstablished, 1000}, {CTUDP, 500}, {CTTCPSyn, 300}, {CTTCPFin, 200}}
		var keys []Tuple4
		var vals []CTValue
		class := map[Tuple4]CTState{}
		seen := map[Tuple4]uint64{}
		i := 0
		for _, f := range fills {
			for j := range f.n {
				k := ctKey(i)
				v := CTValue{ServiceId: 1, BackendId: 1, State: uint8(f.state), LastSeenNs: uint64(1_000_000 + j)}
				keys, vals = append(keys, k), append(vals, v)
				class[k], seen[k] = f.state, v.LastSeenNs
				i++
			}
		}
		if _, err := d.Maps().FluxvmFct4.BatchUpdate(keys, vals, nil); err != nil {
			t.Fatal(err)
		}
		// 50 reverse-NAT halves, seen at distinct times.
		for j := range 50 {
			if err := d.Maps().FluxvmNat4.Put(ctKey(10000+j), NATValue{ServiceId: 1, BackendId: 1, LastSeenNs: uint64(j)}); err != nil {
				t.Fatal(err)
			}
		}
		oldFct := pinnedMapID(t, root, "fluxvm_fct4")
		oldSvc := d.Maps().FluxvmBackends
		oldProg := progID(t, d.Programs().FluxvmFromVm)
		var dropped []CTState
		res, err := d.CompactFlowMaps(CompactOptions{
			Keep: map[string]int{"fluxvm_fct4": 1200, "fluxvm_nat4": 10},
			Dropped: func(name string, k, v []byte) {
				if name == "fluxvm_fct4" {
					dropped = append(dropped, CTState(v[unsafe.Offsetof(CTValue{}.State)]))
				}
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Maps) != 2 {
			t.Fatalf("result %+v", res)
		}
		ct, nt := res.Maps[0], res.Maps[1]
		if ct.Map != "fluxvm_fct4" || ct.Entries != 2000 || ct.Kept != 1200 || ct.Dropped != 800 ||
			ct.DroppedBy["udp"] != 300 || ct.DroppedBy["half_open"] != 300 || ct.DroppedBy["closed"] != 200 || ct.DroppedBy["established"] != 0 {
			t.Errorf("fct4: %+v", ct)
		}
		if nt.Map != "fluxvm_nat4" || nt.Kept != 10 || nt.Dropped != 40 || nt.DroppedBy["nat"] != 40 {
			t.Errorf("nat4: %+v", nt)
		}
		if len(dropped) != 800 {
			t.Errorf("Dropped told of %d entries, want 800", len(dropped))
		}
		// The pin names the new map, which the programs and Maps use.
		newFct := pinnedMapID(t, root, "fluxvm_fct4")
		if newFct == oldFct || newFct != ct.MapID || ct.PreviousMapID != oldFct {
			t.Errorf("pinned fct4 %d (was %d); result %d (was %d)", newFct, oldFct, ct.MapID, ct.PreviousMapID)
		}
		if info, err := d.Maps().FluxvmFct4.Info(); err != nil {
			t.Fatal(err)
		} else if id, _ := info.ID(); id != newFct {
			t.Errorf("Maps().FluxvmFct4 is map %d, want the pinned %d", id, newFct)
		}
		if d.Maps().FluxvmBackends != oldSvc {
			t.Error("a map not rebuilt got another handle")
		}
		prog := progID(t, d.Programs().FluxvmFromVm)
		if prog == oldProg {
			t.Error("programs not reloaded")
		}
		if got := tcxPrograms(t, rx.Attrs().Index, ebpf.AttachTCXIngress); len(got) != 1 || got[0] != prog {
			t.Errorf("ingress runs %v, want the reloaded program %d", got, prog)
		}
		info, err := d.Programs().FluxvmFromVm.Info()
		if err != nil {
			t.Fatal(err)
		}
		if ids, _ := info.MapIDs(); !slices.Contains(ids, newFct) || slices.Contains(ids, oldFct) {
			t.Errorf("the reloaded program uses maps %v: want %d, not %d", ids, newFct, oldFct)
		}
		// What was kept: every established flow and the 200 most recently
		// seen UDP flows.
		var k Tuple4
		var v CTValue
		kept := map[CTState]int{}
		it := d.Maps().FluxvmFct4.Iterate()
		for it.Next(&k, &v) {
			kept[class[k]]++
			if class[k] == CTUDP && seen[k] < 1_000_000+300 {
				t.Errorf("UDP flow seen at %d kept; only the 200 most recent should be", seen[k])
			}
		}
		if kept[CTTCPEstablished] != 1000 || kept[CTUDP] != 200 || len(kept) != 2 {
			t.Errorf("kept %v", kept)
		}
		if m, err := d.ReadMeta(); err != nil || m.ProgramGeneration != ProgramGeneration {
			t.Errorf("generation marker %d after the compaction (%v), want %d", m.ProgramGeneration, err, ProgramGeneration)
		}
		// A restart adopts the compacted pins as they are.
		d.Close()
		d = openT(t, Options{PinRoot: root, Tier: TierS})
		if st := d.Status(); st.Reloaded || st.TierChanged || count(t, d.Maps().FluxvmFct4) != 1200 {
			t.Errorf("reopen: %+v, %d flows", st, count(t, d.Maps().FluxvmFct4))
		}
	})
}

// TestCompactFlowMapsRefuses: bad input changes nothing.
func TestCompactFlowMapsRefuses(t *testing.T) {
	d := openT(t, Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: TierS})
	putCT(t, d, 10)
	for _, keep := range []map[string]int{
		{"fluxvm_services": 1},
		{"fluxvm_fct4": -1},
		{"fluxvm_fct4": 1 << 30},
	} {
		if _, err := d.CompactFlowMaps(CompactOptions{Keep: keep}); err == nil {
			t.Errorf("keep %v accepted", keep)
		}
	}
	if n := count(t, d.Maps().FluxvmFct4); n != 10 {
		t.Errorf("%d flows after refused compactions", n)
	}
	if m, _ := d.ReadMeta(); m.ProgramGeneration != ProgramGeneration {
		t.Errorf("generation marker %d", m.ProgramGeneration)
	}
	d.clsAttached = true
	if _, err := d.CompactFlowMaps(CompactOptions{Keep: map[string]int{"fluxvm_fct4": 1}}); !errors.Is(err, ErrCompactUnsupported) {
		t.Errorf("with cls_bpf hooks: %v, want ErrCompactUnsupported", err)
	}
}

// BenchmarkCompactFlowMaps: the hard action at tier L on a full conntrack
// map (1,048,576 entries, the soft target kept): how long the ranked copy
// and the switch take.
func BenchmarkCompactFlowMaps(b *testing.B) {
	d, err := Open(Options{PinRoot: filepath.Join(testenv.PinRoot(b), "service"), Tier: TierL})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	capacity := int(d.Maps().FluxvmFct4.MaxEntries())
	keys := make([]Tuple4, 0, 65536)
	vals := make([]CTValue, 0, 65536)
	fill := func() {
		for i := 0; i < capacity; i += len(keys) {
			keys, vals = keys[:0], vals[:0]
			for j := i; j < min(i+65536, capacity); j++ {
				keys = append(keys, Tuple4{Saddr: uint32(j) + 1, Daddr: 0x0a60000a, Sport: Port(uint16(j)), Dport: Port(80), Proto: ipTCP})
				vals = append(vals, CTValue{ServiceId: 1, BackendId: 1, State: uint8(CTTCPEstablished), LastSeenNs: uint64(j)})
			}
			if _, err := d.Maps().FluxvmFct4.BatchUpdate(keys, vals, nil); err != nil {
				b.Fatal(err)
			}
		}
	}
	for b.Loop() {
		b.StopTimer()
		fill()
		b.StartTimer()
		res, err := d.CompactFlowMaps(CompactOptions{Keep: map[string]int{"fluxvm_fct4": capacity * 79 / 100}})
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(res.Maps[0].Kept), "kept")
		b.ReportMetric(float64(res.SwitchTime.Microseconds()), "switch-us")
	}
}

// TestCompactCaughtUpNotDropped: entries the rank leaves out but the
// datapath used during the copy (seen since it began) are caught up into
// the new map: they are not reported as dropped (a replication journal
// would delete a flow the node keeps).
func TestCompactCaughtUpNotDropped(t *testing.T) {
	d := openT(t, Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: TierS})
	now, err := monotonicCoarse()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 15 {
		v := CTValue{ServiceId: 1, BackendId: 1, State: uint8(CTTCPEstablished), LastSeenNs: 1000 + uint64(i)}
		if i >= 10 { // busy UDP flows, ranked below every established one
			v.State, v.LastSeenNs = uint8(CTUDP), now
		}
		if err := d.Maps().FluxvmFct4.Put(ctKey(i), v); err != nil {
			t.Fatal(err)
		}
	}
	told := 0
	res, err := d.CompactFlowMaps(CompactOptions{Keep: map[string]int{"fluxvm_fct4": 10},
		Dropped: func(string, []byte, []byte) { told++ }})
	if err != nil {
		t.Fatal(err)
	}
	m := res.Maps[0]
	if n := count(t, d.Maps().FluxvmFct4); n != 15 || told != 0 || m.Dropped != 0 || m.Kept != 15 || m.CaughtUp != 5 || len(m.DroppedBy) != 0 {
		t.Errorf("new map holds %d, %d told dropped; result %+v: want all 15 kept, 5 caught up, none dropped", n, told, m)
	}
}

// TestCompactMarkerAfterFailure: a marker left cleared by an earlier
// failure is written back by the next compaction that succeeds.
func TestCompactMarkerAfterFailure(t *testing.T) {
	d := openT(t, Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: TierS})
	putCT(t, d, 10)
	m, _ := d.ReadMeta()
	m.ProgramGeneration = 0
	if err := d.Maps().FluxvmMeta.Put(uint32(0), m); err != nil {
		t.Fatal(err)
	}
	if _, err := d.CompactFlowMaps(CompactOptions{Keep: map[string]int{"fluxvm_fct4": 5}}); err != nil {
		t.Fatal(err)
	}
	if m, _ := d.ReadMeta(); m.ProgramGeneration != ProgramGeneration {
		t.Errorf("generation marker %d after a successful compaction, want %d", m.ProgramGeneration, ProgramGeneration)
	}
}

// TestCompactWithRouteCacheWrites: the route watch writes the XDP route
// cache from its own goroutine, without the caller's lock, while
// compactions switch the handles (run with -race).
func TestCompactWithRouteCacheWrites(t *testing.T) {
	d := openT(t, Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: TierS})
	putCT(t, d, 10)
	stop, done := make(chan struct{}), make(chan struct{})
	var errs int
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := d.InvalidateXDPRoutes(); err != nil {
				errs++
			}
		}
	}()
	for range 3 {
		if _, err := d.CompactFlowMaps(CompactOptions{Keep: map[string]int{"fluxvm_fct4": 5}}); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	<-done
	if errs != 0 {
		t.Errorf("%d route cache writes failed during the compactions", errs)
	}
	if st := d.XDPRouteCache(); st.Generation == 0 {
		t.Error("the route cache was never written")
	}
}

// TestCatchUpCreatedEqualsSeen: catch-up compares last-seen times, also
// after entries whose creation and last-seen times are equal (every new
// flow's are): a flow the new map holds more recently is not overwritten
// by the old map's older version.
func TestCatchUpCreatedEqualsSeen(t *testing.T) {
	d := openT(t, Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: TierS})
	nm, err := ebpf.NewMap(d.spec.Maps["fluxvm_fct4"])
	if err != nil {
		t.Fatal(err)
	}
	defer nm.Close()
	old := d.Maps().FluxvmFct4
	// New flows in the old map only (created == last seen), walked before
	// or after the one flow both maps hold: created at 1000, seen at 8000
	// in the old map, at 9000 and in FIN in the new one.
	for i := range 50 {
		if err := old.Put(ctKey(100+i), CTValue{ServiceId: 1, BackendId: 1, CreatedNs: 5000, LastSeenNs: 5000, State: uint8(CTTCPSyn)}); err != nil {
			t.Fatal(err)
		}
	}
	k := ctKey(1)
	if err := old.Put(k, CTValue{ServiceId: 1, BackendId: 1, CreatedNs: 1000, LastSeenNs: 8000, State: uint8(CTTCPEstablished)}); err != nil {
		t.Fatal(err)
	}
	if err := nm.Put(k, CTValue{ServiceId: 1, BackendId: 1, CreatedNs: 1000, LastSeenNs: 9000, State: uint8(CTTCPFin)}); err != nil {
		t.Fatal(err)
	}
	ins, upd, err := catchUp("fluxvm_fct4", old, nm, 1000)
	if err != nil {
		t.Fatal(err)
	}
	var v CTValue
	if err := nm.Lookup(k, &v); err != nil || v.LastSeenNs != 9000 || CTState(v.State) != CTTCPFin {
		t.Errorf("the new map's fresher entry became %+v (%v)", v, err)
	}
	if ins != 50 || upd != 0 {
		t.Errorf("caught up %d new, %d changed; want 50, 0", ins, upd)
	}
}
