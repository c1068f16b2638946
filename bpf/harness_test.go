package bpf

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// Verdicts as Program.Run reports them.
const (
	tcOK   = 0 // TC_ACT_OK: rewritten, chain ends
	tcShot = 2 // TC_ACT_SHOT: dropped
)

// harness is the loaded TC object plus the map writes a control plane
// would do, in raw form, for datapath tests.
type harness struct {
	t    testing.TB
	th   *testenv.Thread
	spec *ebpf.CollectionSpec
	objs serviceObjects
	// What fluxvm_be2fe is written from, as the control plane keeps it:
	// frontends by service id, backends by id.
	fes map[uint32][]harnessFrontend
	bes map[uint32]harnessBackend
	// Frontends placed past the index's slots (revStored).
	stored map[uint32]bool
	// fe writes fluxvm_svc4 and its index, as the loader does: every
	// test runs the frontend stage through the index.
	fe *FrontendIndex
}

type harnessFrontend struct {
	vip   netip.AddrPort
	proto uint8
}

type harnessBackend struct {
	sid uint32
	ap  netip.AddrPort
}

func newHarness(t testing.TB) *harness {
	t.Helper()
	return newHarnessSized(t, 4096)
}

// newHarnessSized loads the object with the lifecycle maps shrunk to
// ctEntries (0 keeps the tier's real capacity).
func newHarnessSized(t testing.TB, ctEntries uint32) *harness {
	t.Helper()
	spec, err := loadService()
	if err != nil {
		t.Fatal(err)
	}
	return newHarnessSpec(t, spec, ctEntries)
}

// newHarnessSpec is newHarnessSized for another build of the object (a
// baseline to compare against), with the same map layouts.
func newHarnessSpec(t testing.TB, spec *ebpf.CollectionSpec, ctEntries uint32) *harness {
	t.Helper()
	h := &harness{t: t, th: testenv.NewThread(t), fes: map[uint32][]harnessFrontend{}, bes: map[uint32]harnessBackend{}, stored: map[uint32]bool{}}
	// The lifecycle maps hold hundreds of thousands of preallocated
	// entries at tier M; the behaviour under test does not depend on
	// capacity, and small maps keep a load per test cheap.
	for _, name := range []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"} {
		if ctEntries != 0 {
			spec.Maps[name].MaxEntries = ctEntries
		}
	}
	// An object of an earlier generation may lack maps of this one; the
	// harness writes them anyway, and its programs ignore them.
	if cur, err := loadService(); err == nil {
		for name, m := range cur.Maps {
			if spec.Maps[name] == nil {
				spec.Maps[name] = m.Copy()
			}
		}
	}
	h.spec = spec
	if err := spec.LoadAndAssign(&h.objs, nil); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() { h.objs.Close() })
	h.indexFrontends()
	return h
}

// indexFrontends gives the harness the writer of its fluxvm_svc4 and
// frontend index, and builds the index, as Open does.
func (h *harness) indexFrontends() {
	h.t.Helper()
	var err error
	if h.fe, err = NewFrontendIndex(h.objs.FluxvmSvc4, h.objs.FluxvmFe4); err != nil {
		h.t.Fatal(err)
	}
	if _, err := h.fe.Rebuild(); err != nil {
		h.t.Fatal(err)
	}
}

// reset empties every map, so that one loaded object (verification is the
// slow part of a load) serves many independent scenarios.
func (h *harness) reset() {
	h.t.Helper()
	for name, m := range map[string]*ebpf.Map{
		"fluxvm_svc4": h.objs.FluxvmSvc4, "fluxvm_svc6": h.objs.FluxvmSvc6,
		"fluxvm_fct4": h.objs.FluxvmFct4, "fluxvm_fct6": h.objs.FluxvmFct6,
		"fluxvm_nat4": h.objs.FluxvmNat4, "fluxvm_nat6": h.objs.FluxvmNat6,
		"fluxvm_maglev": h.objs.FluxvmMaglev, "fluxvm_be2fe": h.objs.FluxvmBe2fe,
		"fluxvm_snat_peers": h.objs.FluxvmSnatPeers,
	} {
		var keys []any
		it := m.Iterate()
		k := make([]byte, m.KeySize())
		var v []byte
		if m.Type() == ebpf.ArrayOfMaps {
			for i := range m.MaxEntries() {
				_ = m.Delete(i)
			}
			continue
		}
		for it.Next(&k, &v) {
			keys = append(keys, append([]byte(nil), k...))
		}
		h.must(it.Err())
		for _, key := range keys {
			if err := m.Delete(key); err != nil {
				h.t.Fatalf("reset %s: %v", name, err)
			}
		}
	}
	if _, err := h.fe.Rebuild(); err != nil {
		h.t.Fatal(err)
	}
	clear(h.fes)
	clear(h.bes)
	clear(h.stored)
	ncpu := ebpf.MustPossibleCPU()
	for _, z := range []struct {
		m    *ebpf.Map
		vals func(n int) any
	}{
		{h.objs.FluxvmBackends, func(n int) any { return make([]Backend, n) }},
		{h.objs.FluxvmSguard, func(n int) any { return make([]Guard, n) }},
		{h.objs.FluxvmMeta, func(n int) any { return make([]Meta, n) }},
		{h.objs.FluxvmSvcStats, func(n int) any { return make([]ServiceStats, n*ncpu) }},
		{h.objs.FluxvmEdgeStats, func(n int) any { return make([]ServiceStats, n*ncpu) }},
		{h.objs.FluxvmEdgeSlots, func(n int) any { return make([]EdgeSlot, n) }},
		{h.objs.FluxvmDrops, func(n int) any { return make([]uint64, n*ncpu) }},
		{h.objs.FluxvmCounters, func(n int) any { return make([]uint64, n*ncpu) }},
	} {
		n := int(z.m.MaxEntries())
		keys := make([]uint32, n)
		for i := range keys {
			keys[i] = uint32(i)
		}
		_, err := z.m.BatchUpdate(keys, z.vals(n), nil)
		h.must(err)
	}
}

func (h *harness) must(err error) {
	h.t.Helper()
	if err != nil {
		h.t.Fatal(err)
	}
}

// service installs the frontend (vip, proto) -> sid, its VIP marker, and
// opens the guard.
func (h *harness) service(sid uint32, vip netip.AddrPort, proto uint8) {
	h.t.Helper()
	val := SvcValue{ServiceId: sid, Revision: 1}
	marker := SvcValue{ServiceId: sid, Flags: SvcFlagVIPMarker, Revision: 1}
	if vip.Addr().Is4() {
		w := AddrWords(vip.Addr())
		h.must(h.fe.Put(SvcKey4{Vip: w[0], Port: Port(vip.Port()), Proto: proto}, val))
		h.must(h.fe.Put(SvcKey4{Vip: w[0], Proto: proto}, marker))
	} else {
		w := AddrWords(vip.Addr())
		h.must(h.objs.FluxvmSvc6.Put(SvcKey6{Vip: w, Port: Port(vip.Port()), Proto: proto}, val))
		h.must(h.objs.FluxvmSvc6.Put(SvcKey6{Vip: w, Proto: proto}, marker))
	}
	h.guard(sid, GuardOpen)
	// One service id may serve a frontend per family (the benchmark's).
	fe := harnessFrontend{vip, proto}
	if !slices.Contains(h.fes[sid], fe) {
		h.fes[sid] = append(h.fes[sid], fe)
	}
	for _, b := range h.bes {
		if b.sid == sid {
			h.index(b.ap, proto)
		}
	}
}

// revStored places the frontend of sid past the index's slots, as the
// control plane does for a frontend after the first Be2feSlots of a backend
// endpoint: it gets SvcFlagRevStored (its new flows store reverse-NAT
// halves), no slot, and its backends' entries are marked overflowing, so
// that its replies are found by their halves only.
func (h *harness) revStored(sid uint32) {
	h.t.Helper()
	h.stored[sid] = true
	for _, fe := range h.fes[sid] {
		val := SvcValue{ServiceId: sid, Flags: SvcFlagRevStored, Revision: 1}
		if fe.vip.Addr().Is4() {
			h.must(h.fe.Put(SvcKey4{Vip: AddrWords(fe.vip.Addr())[0], Port: Port(fe.vip.Port()), Proto: fe.proto}, val))
		} else {
			h.must(h.objs.FluxvmSvc6.Put(SvcKey6{Vip: AddrWords(fe.vip.Addr()), Port: Port(fe.vip.Port()), Proto: fe.proto}, val))
		}
		for _, b := range h.bes {
			if b.sid == sid {
				h.index(b.ap, fe.proto)
			}
		}
	}
}

func (h *harness) guard(sid, state uint32) {
	h.t.Helper()
	h.must(h.objs.FluxvmSguard.Put(sid, Guard{State: state, Revision: 1}))
}

func (h *harness) backend(id, sid uint32, ap netip.AddrPort, state BackendState, drainUntil uint64) {
	h.t.Helper()
	fam := uint8(FamilyIPv6)
	if ap.Addr().Is4() {
		fam = FamilyIPv4
	}
	h.must(h.objs.FluxvmBackends.Put(id, Backend{
		Addr: AddrWords(ap.Addr()), Port: Port(ap.Port()), Family: fam,
		State: uint8(state), ServiceId: sid, DrainUntilNs: drainUntil,
	}))
	old, had := h.bes[id]
	h.bes[id] = harnessBackend{sid, ap}
	for _, fe := range h.fes[sid] {
		h.index(ap, fe.proto)
	}
	if had && old.ap != ap {
		for _, fe := range h.fes[old.sid] {
			h.index(old.ap, fe.proto)
		}
	}
}

// index writes the fluxvm_be2fe entry of backend endpoint ap for proto
// from the frontends and backends written so far, in backend-id order (the
// control plane keeps its own order; tests of more than Be2feSlots
// frontends set the entry themselves).
func (h *harness) index(ap netip.AddrPort, proto uint8) {
	h.t.Helper()
	var v Be2feValue
	n := 0
	for _, id := range slices.Sorted(maps.Keys(h.bes)) {
		b := h.bes[id]
		if b.ap != ap {
			continue
		}
		for _, fe := range h.fes[b.sid] {
			if fe.proto != proto || fe.vip.Addr().Is4() != ap.Addr().Is4() {
				continue
			}
			if h.stored[b.sid] {
				v.Flags |= Be2feFlagOverflow
				continue
			}
			if n < Be2feSlots {
				v.Slots[n] = Be2feSlot{Vip: AddrWords(fe.vip.Addr()), Vport: Port(fe.vip.Port()), ServiceId: b.sid, BackendId: id}
			} else {
				v.Flags |= Be2feFlagOverflow
			}
			n++
		}
	}
	k := MakeBe2feKey(ap, proto)
	if n == 0 && v.Flags == 0 {
		if err := h.objs.FluxvmBe2fe.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			h.t.Fatal(err)
		}
		return
	}
	v.Count = uint8(min(n, Be2feSlots))
	h.must(h.objs.FluxvmBe2fe.Put(k, v))
}

// table swaps in a complete Maglev table for sid, as the control plane
// does: a new inner map of len(entries) slots, filled, then one update of
// the outer slot.
func (h *harness) table(sid uint32, entries []uint32) {
	h.t.Helper()
	ms := h.spec.Maps["fluxvm_maglev"].InnerMap.Copy()
	ms.MaxEntries = uint32(len(entries))
	inner, err := ebpf.NewMap(ms)
	h.must(err)
	defer inner.Close()
	keys := make([]uint32, len(entries))
	for i := range keys {
		keys[i] = uint32(i)
	}
	_, err = inner.BatchUpdate(keys, entries, nil)
	h.must(err)
	h.must(h.objs.FluxvmMaglev.Put(sid, inner))
}

// fill returns a table whose every slot names id.
// weighted is a table whose slots go to the backends in proportion to
// their weights (slot i to the i-th of a repeating pattern), as a Maglev
// table does; weight 0 leaves a backend out.
func (h *harness) weighted(w map[uint32]int) []uint32 {
	var ids []uint32
	for id := range w {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	var pattern []uint32
	for _, id := range ids {
		for range w[id] {
			pattern = append(pattern, id)
		}
	}
	e := make([]uint32, h.spec.Maps["fluxvm_maglev"].InnerMap.MaxEntries)
	for i := range e {
		e[i] = pattern[i%len(pattern)]
	}
	return e
}

func (h *harness) fill(id uint32) []uint32 {
	e := make([]uint32, h.spec.Maps["fluxvm_maglev"].InnerMap.MaxEntries)
	for i := range e {
		e[i] = id
	}
	return e
}

func (h *harness) noTable(sid uint32) {
	h.t.Helper()
	if err := h.objs.FluxvmMaglev.Delete(sid); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		h.t.Fatal(err)
	}
}

func (h *harness) meta(m Meta) {
	h.t.Helper()
	h.must(h.objs.FluxvmMeta.Put(uint32(0), m))
}

func (h *harness) run(prog *ebpf.Program, frame []byte) (uint32, []byte) {
	h.t.Helper()
	return run(h.t, h.th, prog, frame)
}

// tuple keys a flow the way the datapath does.
type tuple struct {
	src, dst netip.AddrPort
	proto    uint8
}

func (tp tuple) key() any {
	if tp.src.Addr().Is4() {
		return MakeTuple4(tp.src, tp.dst, tp.proto)
	}
	return MakeTuple6(tp.src, tp.dst, tp.proto)
}

func (h *harness) ctMap(tp tuple) *ebpf.Map {
	if tp.src.Addr().Is4() {
		return h.objs.FluxvmFct4
	}
	return h.objs.FluxvmFct6
}

func (h *harness) natMap(tp tuple) *ebpf.Map {
	if tp.src.Addr().Is4() {
		return h.objs.FluxvmNat4
	}
	return h.objs.FluxvmNat6
}

// ct returns the conntrack entry of the client's view tp, if any.
func (h *harness) ct(tp tuple) (CTValue, bool) {
	h.t.Helper()
	var v CTValue
	err := h.ctMap(tp).Lookup(tp.key(), &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return v, false
	}
	h.must(err)
	return v, true
}

// nat returns the reverse-NAT entry of the reply view tp, if any.
func (h *harness) nat(tp tuple) (NATValue, bool) {
	h.t.Helper()
	var v NATValue
	err := h.natMap(tp).Lookup(tp.key(), &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return v, false
	}
	h.must(err)
	return v, true
}

func (h *harness) stats(sid uint32) ServiceStats {
	h.t.Helper()
	var per []ServiceStats
	h.must(h.objs.FluxvmSvcStats.Lookup(sid, &per))
	var s ServiceStats
	for _, p := range per {
		s.Packets += p.Packets
		s.Bytes += p.Bytes
		s.ReplyPackets += p.ReplyPackets
		s.ReplyBytes += p.ReplyBytes
		s.NewFlows += p.NewFlows
		s.Failovers += p.Failovers
		s.Drops += p.Drops
		s.EdtDrops += p.EdtDrops
		s.PolicyDenied += p.PolicyDenied
		s.PolicyAudited += p.PolicyAudited
		s.L7Redirected += p.L7Redirected
	}
	return s
}

// edge registers the interface BPF_PROG_TEST_RUN packets arrive on (the
// namespace's loopback, ifindex 1) for per-interface statistics.
func (h *harness) edge() {
	h.t.Helper()
	h.must(h.objs.FluxvmEdgeSlots.Put(uint32(1), EdgeSlot{Ifindex: 1, Slot: 5}))
}

func (h *harness) edgeStats() ServiceStats {
	h.t.Helper()
	var per []ServiceStats
	h.must(h.objs.FluxvmEdgeStats.Lookup(uint32(5), &per))
	var s ServiceStats
	for _, p := range per {
		s.Packets += p.Packets
		s.Bytes += p.Bytes
		s.ReplyPackets += p.ReplyPackets
		s.NewFlows += p.NewFlows
		s.Drops += p.Drops
	}
	return s
}

func (h *harness) drops() Drops {
	h.t.Helper()
	d, err := ReadDrops(h.objs.FluxvmDrops)
	h.must(err)
	return d
}

// monoNow is CLOCK_MONOTONIC_COARSE, the clock the datapath stamps with.
func monoNow(tb testing.TB) uint64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts); err != nil {
		tb.Fatal(err)
	}
	return uint64(ts.Nano())
}

// attachEdges attaches fluxvm_from_vm (TCX ingress) and fluxvm_to_vm (TCX
// egress) to the node-side interfaces of vms in lab l, as a node does on
// its VM edges, until the test ends.
func (h *harness) attachEdges(t testing.TB, l *lab.Lab, vms ...*lab.VM) {
	t.Helper()
	h.must(l.Node.Do(func() error {
		for _, vm := range vms {
			for _, a := range []struct {
				prog *ebpf.Program
				at   ebpf.AttachType
			}{{h.objs.FluxvmFromVm, ebpf.AttachTCXIngress}, {h.objs.FluxvmToVm, ebpf.AttachTCXEgress}} {
				tl, err := link.AttachTCX(link.TCXOptions{Interface: vm.NodeIfIndex, Program: a.prog, Attach: a.at})
				if err != nil {
					return fmt.Errorf("attach %s to %s: %w", a.prog, vm.NodeIf, err)
				}
				t.Cleanup(func() { tl.Close() })
			}
		}
		return nil
	}))
}
