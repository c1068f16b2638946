package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// Endpoints and VIPs of the reverse translation index tests.
var (
	ixB1 = netip.MustParseAddrPort("10.200.0.1:8080")
	ixB2 = netip.MustParseAddrPort("10.200.0.2:8080")
	ixB3 = netip.MustParseAddrPort("10.200.0.3:8080")
	ixB6 = netip.MustParseAddrPort("[fd00:200::1]:8080")
)

func ixVIP(n byte) netip.Addr  { return netip.AddrFrom4([4]byte{10, 96, 0, n}) }
func ixVIP6(n byte) netip.Addr { return netip.AddrFrom16([16]byte{0xfd, 0, 0, 0x96, 15: n}) }

// ixService is service name on vips and ports, listing backends.
func ixService(name string, vips []netip.Addr, ports []ServicePort, backends ...netip.AddrPort) Service {
	s := Service{Name: name, VIPs: vips, Ports: ports}
	for _, b := range backends {
		s.Backends = append(s.Backends, Backend{Address: b.Addr(), Port: b.Port()})
	}
	return s
}

var tcp80 = []ServicePort{{Port: 80, Protocol: TCP}}

// ixOpen opens a dataplane without interfaces on pin root root (below a
// test's testenv.PinRoot) with catalog catalog.
func ixOpen(t *testing.T, root, catalog string, tier bpf.Tier) *Dataplane {
	t.Helper()
	d, err := Open(context.Background(), Options{
		Loader:              bpf.Options{PinRoot: root, Tier: tier},
		CatalogPath:         catalog,
		ConntrackGCInterval: -1,
		Logger:              slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func ixEndpointKey(ep netip.AddrPort, proto uint8) string {
	return fmt.Sprintf("%s/%s", ep, protocolOf(proto))
}

func ixFrontend(vip netip.Addr, port uint16, proto Protocol) string {
	return feKey(vip, port, proto.Number()).String()
}

// checkIndex checks the reverse translation index against want (backend
// endpoint "addr:port/proto" -> the frontends that list it, in slot
// order, also past the map's slots): the model, and the map entry by
// entry (Count, Overflow, each slot's VIP, port, service id and backend
// id, the latter naming that endpoint in fluxvm_backends), with no other
// entry; and that exactly the frontends revStored have SvcFlagRevStored
// in their frontend entries.
func checkIndex(t *testing.T, d *Dataplane, what string, want map[string][]string, revStored ...string) {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	got := map[string][]string{}
	for k, list := range d.prog.Index().All() {
		ks := ixEndpointKey(netip.AddrPortFrom(bpf.Addr(k.Addr, k.Family), bpf.Port(k.Port)), k.Proto)
		for _, s := range list {
			got[ks] = append(got[ks], s.Key.String())
			if s.Seeded {
				t.Errorf("%s: %s: slot of %s still seeded", what, ks, s.Key)
			}
		}
	}
	if want == nil {
		want = map[string][]string{}
	}
	if !maps.EqualFunc(got, want, slices.Equal) {
		t.Errorf("%s: index model\n%v\nwant\n%v", what, got, want)
	}

	var (
		k bpf.Be2feKey
		v bpf.Be2feValue
		n int
	)
	it := d.dp.Maps().FluxvmBe2fe.Iterate()
	for it.Next(&k, &v) {
		n++
		ep := netip.AddrPortFrom(bpf.Addr(k.Addr, k.Family), bpf.Port(k.Port))
		ks := ixEndpointKey(ep, k.Proto)
		w, ok := want[ks]
		if !ok {
			t.Errorf("%s: map entry %s %+v, want none", what, ks, v)
			continue
		}
		if wc := min(len(w), bpf.Be2feSlots); int(v.Count) != wc {
			t.Errorf("%s: %s: count %d, want %d", what, ks, v.Count, wc)
		}
		if over := v.Flags&bpf.Be2feFlagOverflow != 0; over != (len(w) > bpf.Be2feSlots) {
			t.Errorf("%s: %s: overflow %v with %d frontends", what, ks, over, len(w))
		}
		for i, s := range v.Slots {
			if i >= int(v.Count) || i >= len(w) {
				if s != (bpf.Be2feSlot{}) {
					t.Errorf("%s: %s: slot %d past the count holds %+v", what, ks, i, s)
				}
				continue
			}
			fk := feKey(bpf.Addr(s.Vip, k.Family), bpf.Port(s.Vport), k.Proto)
			if fk.String() != w[i] {
				t.Errorf("%s: %s: slot %d names %s, want %s", what, ks, i, fk, w[i])
				continue
			}
			fe := d.prog.Frontend(fk)
			if fe == nil || s.ServiceId != fe.ID() || s.BackendId != fe.BackendID(ep) || s.BackendId == 0 {
				t.Errorf("%s: %s: slot %d %+v does not name the frontend's ids (%+v)", what, ks, i, s, fe)
				continue
			}
			var be bpf.Backend
			if err := d.dp.Maps().FluxvmBackends.Lookup(s.BackendId, &be); err != nil ||
				netip.AddrPortFrom(bpf.Addr(be.Addr, be.Family), bpf.Port(be.Port)) != ep || be.ServiceId != fe.ID() {
				t.Errorf("%s: %s: slot %d: backend %d is %+v (%v)", what, ks, i, s.BackendId, be, err)
			}
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	if n != len(want) {
		t.Errorf("%s: %d map entries, want %d", what, n, len(want))
	}

	for _, fe := range d.prog.Frontends() {
		v, ok, err := lookupFrontend(d, fe.Key())
		if err != nil || !ok {
			t.Errorf("%s: frontend %s: entry %v %v", what, fe.Key(), ok, err)
			continue
		}
		if has, w := v.Flags&bpf.SvcFlagRevStored != 0, slices.Contains(revStored, fe.Key().String()); has != w {
			t.Errorf("%s: frontend %s: SvcFlagRevStored %v, want %v (flags %#x)", what, fe.Key(), has, w, v.Flags)
		}
	}
	for _, r := range revStored {
		if !slices.ContainsFunc(slices.Collect(maps.Keys(maps.Collect(d.prog.Frontends()))), func(k services.Key) bool { return k.String() == r }) {
			t.Errorf("%s: frontend %s: not programmed", what, r)
		}
	}
}

// checkFindable is a beforeSwap hook: when the new table of an east-west
// NAT frontend goes in, every backend it lists is findable by a reply: fe
// is in the first slots of the endpoint's map entry with its ids, or the
// entry overflows and fe's live frontend entry, if it has one, makes its
// flows store reverse-NAT halves.
func checkFindable(t *testing.T, d *Dataplane) func(*services.Frontend, uint32) {
	return func(fe *services.Frontend, flags uint32) {
		if flags&(bpf.SvcFlagDSR|bpf.SvcFlagNoEastWest) != 0 {
			return
		}
		for ep, bid := range fe.Backends() {
			var v bpf.Be2feValue
			if err := d.dp.Maps().FluxvmBe2fe.Lookup(bpf.MakeBe2feKey(ep, fe.Key().Proto), &v); err != nil {
				t.Errorf("swap of %s: %s: no index entry: %v", fe.Key(), ep, err)
				continue
			}
			want := bpf.Be2feSlot{Vip: bpf.AddrWords(fe.Key().VIP), Vport: bpf.Port(fe.Key().Port), ServiceId: fe.ID(), BackendId: bid}
			if slices.Contains(v.Slots[:min(int(v.Count), bpf.Be2feSlots)], want) {
				continue
			}
			if v.Flags&bpf.Be2feFlagOverflow == 0 {
				t.Errorf("swap of %s: %s: not in the entry %+v, which does not overflow", fe.Key(), ep, v)
			}
			if sv, ok, err := lookupFrontend(d, fe.Key()); err != nil || ok && sv.Flags&bpf.SvcFlagRevStored == 0 {
				t.Errorf("swap of %s: %s: past the slots, and the live frontend entry %+v lacks SvcFlagRevStored (%v)", fe.Key(), ep, sv, err)
			}
		}
	}
}

// TestReverseIndex: services sharing backend endpoints, applied, updated,
// restarted and deleted; after every step the index (model and map) and
// the frontends' SvcFlagRevStored are exactly what the rules say, and
// every table swap of an apply finds its backends findable (checkFindable). The
// services are applied in the reverse of their names' order, which is the
// catalog's: a restore that did not keep the order would show.
func TestReverseIndex(t *testing.T) {
	ctx := context.Background()
	root := filepath.Join(testenv.PinRoot(t), "service")
	catalog := filepath.Join(t.TempDir(), "catalog.json")
	d := ixOpen(t, root, catalog, bpf.TierS)
	// reopen closes d, runs between (on the pins and catalog of a stopped
	// node), and opens d again at tier; the new d lives as long as the
	// test, not the step.
	reopen := func(tier bpf.Tier, between func()) func(*testing.T) {
		return func(st *testing.T) {
			if err := d.Close(); err != nil {
				st.Fatal(err)
			}
			if between != nil {
				between()
			}
			d = ixOpen(t, root, catalog, tier)
			d.beforeSwap = checkFindable(t, d)
		}
	}
	d.beforeSwap = checkFindable(t, d)
	apply := func(s Service) func(*testing.T) {
		return func(t *testing.T) {
			t.Helper()
			if _, err := d.ApplyService(ctx, s); err != nil {
				t.Fatalf("apply %s: %v", s.Name, err)
			}
		}
	}
	remove := func(names ...string) func(*testing.T) {
		return func(t *testing.T) {
			t.Helper()
			for _, n := range names {
				if err := d.DeleteService(ctx, n); err != nil {
					t.Fatalf("delete %s: %v", n, err)
				}
			}
		}
	}

	var (
		b1t, b1u = ixEndpointKey(ixB1, 6), ixEndpointKey(ixB1, 17)
		b2t      = ixEndpointKey(ixB2, 6)
		b3t, b3u = ixEndpointKey(ixB3, 6), ixEndpointKey(ixB3, 17)
		b6t      = ixEndpointKey(ixB6, 6)
		fe       = func(n byte) string { return ixFrontend(ixVIP(n), 80, TCP) }
		e6       = ixFrontend(ixVIP6(5), 80, TCP)
		d53      = ixFrontend(ixVIP(4), 53, UDP)
	)
	svcE := ixService("e", []netip.Addr{ixVIP(5), ixVIP6(5)}, tcp80, ixB1, ixB2, ixB6)
	svcD := ixService("d", []netip.Addr{ixVIP(4)}, []ServicePort{{Port: 80, Protocol: TCP}, {Port: 53, Protocol: UDP}}, ixB1, ixB3)
	svcDDrain := svcD.Clone()
	svcDDrain.Backends[0].State, svcDDrain.Backends[0].DrainUntilUnixMs = BackendDraining, time.Now().Add(time.Hour).UnixMilli()
	svcA1 := ixService("a", []netip.Addr{ixVIP(1)}, tcp80, ixB2)
	svcA2 := ixService("a", []netip.Addr{ixVIP(1)}, tcp80, ixB2, ixB1)

	// g: DSR east-west on B1 (no reverse translation), then NAT.
	svcG := ixService("g", []netip.Addr{ixVIP(6)}, []ServicePort{{Port: 8080, Protocol: TCP}}, ixB1)
	svcG.Mode = ModeDSR
	svcGNAT := svcG.Clone()
	svcGNAT.Mode = ModeNAT
	// g as DSR again, with B3 added in the same apply: its frontend is
	// still east-west NAT until the commit, so B3 is listed for it.
	svcGDSR3 := ixService("g", []netip.Addr{ixVIP(6)}, []ServicePort{{Port: 8080, Protocol: TCP}}, ixB1, ixB3)
	svcGDSR3.Mode = ModeDSR
	g := ixFrontend(ixVIP(6), 8080, TCP)
	afterE := map[string][]string{b1t: {fe(3), fe(2), fe(1), fe(4)}, b1u: {d53}, b2t: {fe(1)}, b3t: {fe(4)}, b3u: {d53}}
	afterEG := maps.Clone(afterE)
	afterEG[b1t] = []string{fe(3), fe(2), fe(1), fe(4), g}
	afterEG3 := maps.Clone(afterEG)
	afterEG3[b3t] = []string{fe(4), g}

	full := map[string][]string{
		b1t: {fe(5), fe(4), fe(3), fe(2), fe(1)}, b1u: {d53},
		b2t: {fe(5), fe(1)}, b3t: {fe(4)}, b3u: {d53}, b6t: {e6},
	}
	for _, st := range []struct {
		name      string
		do        func(*testing.T)
		want      map[string][]string
		revStored []string
		load      func(LoadStatus) bool // what the Open of a restart must have done
	}{
		{name: "one service", do: apply(svcE),
			want: map[string][]string{b1t: {fe(5)}, b2t: {fe(5)}, b6t: {e6}}},
		{name: "a second shares B1, per protocol", do: apply(svcD),
			want: map[string][]string{b1t: {fe(5), fe(4)}, b1u: {d53}, b2t: {fe(5)}, b3t: {fe(4)}, b3u: {d53}, b6t: {e6}}},
		{name: "four frontends on B1", do: func(t *testing.T) {
			apply(ixService("c", []netip.Addr{ixVIP(3)}, tcp80, ixB1))(t)
			apply(ixService("b", []netip.Addr{ixVIP(2)}, tcp80, ixB1))(t)
		},
			want: map[string][]string{b1t: {fe(5), fe(4), fe(3), fe(2)}, b1u: {d53}, b2t: {fe(5)}, b3t: {fe(4)}, b3u: {d53}, b6t: {e6}}},
		{name: "a fifth frontend, not on B1 yet", do: apply(svcA1),
			want: map[string][]string{b1t: {fe(5), fe(4), fe(3), fe(2)}, b1u: {d53}, b2t: {fe(5), fe(1)}, b3t: {fe(4)}, b3u: {d53}, b6t: {e6}}},
		{name: "the live fifth frontend adds B1: overflow, RevStored", do: apply(svcA2), want: full, revStored: []string{fe(1)}},
		{name: "reapplying changes nothing", do: apply(svcA2), want: full, revStored: []string{fe(1)}},
		{name: "draining keeps the slot", do: apply(svcDDrain), want: full, revStored: []string{fe(1)}},
		{name: "restart keeps the order", do: reopen(bpf.TierS, nil), want: full, revStored: []string{fe(1)},
			load: func(l LoadStatus) bool { return !l.Reloaded && !l.TierChanged && !l.SchemaRebuilt }},
		{name: "tier change keeps the order", do: reopen(bpf.TierM, nil), want: full, revStored: []string{fe(1)},
			load: func(l LoadStatus) bool { return l.TierChanged }},
		{name: "generation reload keeps the order", do: reopen(bpf.TierS, func() { setPinnedGeneration(t, root, bpf.ProgramGeneration-1) }),
			want: full, revStored: []string{fe(1)},
			load: func(l LoadStatus) bool { return l.Reloaded && l.TierChanged }},
		{name: "removing the 2nd moves the later ones down", do: remove("d"),
			want: map[string][]string{b1t: {fe(5), fe(3), fe(2), fe(1)}, b2t: {fe(5), fe(1)}, b6t: {e6}}},
		{name: "d back: appended, overflow again", do: apply(svcD),
			want:      map[string][]string{b1t: {fe(5), fe(3), fe(2), fe(1), fe(4)}, b1u: {d53}, b2t: {fe(5), fe(1)}, b3t: {fe(4)}, b3u: {d53}, b6t: {e6}},
			revStored: []string{fe(4)}},
		{name: "a restart whose catalog lost e drops its seeded slots", do: reopen(bpf.TierS, func() { dropFromCatalog(t, catalog, "e") }),
			want: afterE,
			load: func(l LoadStatus) bool { return !l.Reloaded && !l.TierChanged }},
		{name: "a DSR service takes no slot", do: apply(svcG),
			want: afterE},
		{name: "DSR to NAT: appended past the slots", do: apply(svcGNAT),
			want: afterEG, revStored: []string{g}},
		{name: "NAT to DSR keeps the slot", do: apply(svcG),
			want: afterEG, revStored: []string{g}},
		{name: "DSR to NAT again", do: apply(svcGNAT),
			want: afterEG, revStored: []string{g}},
		{name: "NAT to DSR with a backend added lists it", do: apply(svcGDSR3),
			want: afterEG3, revStored: []string{g}},
		{name: "deleting every service empties the index", do: remove("a", "b", "c", "d", "g")},
	} {
		t.Run(st.name, func(t *testing.T) {
			st.do(t)
			if st.load != nil {
				if l := d.Status().Load; !st.load(l) {
					t.Fatalf("the reopen did not take the path under test: %+v", l)
				}
			}
			checkIndex(t, d, st.name, st.want, st.revStored...)
		})
		if t.Failed() {
			break
		}
	}
}

// setPinnedGeneration rewrites the program generation in the meta map
// pinned under root, so that the next Open reloads the programs.
func setPinnedGeneration(t *testing.T, root string, gen uint32) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, "maps", "fluxvm_meta"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var meta bpf.Meta
	if err := m.Lookup(uint32(0), &meta); err != nil {
		t.Fatal(err)
	}
	meta.ProgramGeneration = gen
	if err := m.Put(uint32(0), meta); err != nil {
		t.Fatal(err)
	}
}

// dropFromCatalog removes service name from the (closed) catalog file.
func dropFromCatalog(t *testing.T, path, name string) {
	t.Helper()
	cat, err := catalog.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := len(cat.Services)
	cat.Services = slices.DeleteFunc(cat.Services, func(cs catalogService) bool { return cs.Service.Name == name })
	if len(cat.Services) != n-1 {
		t.Fatalf("catalog %s has no service %s", path, name)
	}
	if _, err := catalog.WriteFile(path, cat); err != nil {
		t.Fatal(err)
	}
}

// TestReverseIndexFull: an apply that meets a full fluxvm_be2fe fails
// with ErrLimit and leaves nothing of itself: a new service leaves no
// frontend, backend or slot, an update leaves the service, its frontends
// and the index as they were.
func TestReverseIndexFull(t *testing.T) {
	ctx := context.Background()
	d := ixOpen(t, filepath.Join(testenv.PinRoot(t), "service"), filepath.Join(t.TempDir(), "catalog.json"), bpf.TierS)
	x := ixService("x", []netip.Addr{ixVIP(7)}, tcp80, ixB1)
	if _, err := d.ApplyService(ctx, x); err != nil {
		t.Fatal(err)
	}
	before := map[string][]string{ixEndpointKey(ixB1, 6): {ixFrontend(ixVIP(7), 80, TCP)}}
	checkIndex(t, d, "before", before)

	// Fill the map but one entry with endpoints no service lists (the
	// control plane never gets there: endpoints are at most backend ids).
	m := d.dp.Maps().FluxvmBe2fe
	var junk []bpf.Be2feKey
	for i := 1; ; i++ {
		k := bpf.MakeBe2feKey(netip.AddrPortFrom(netip.AddrFrom4([4]byte{192, 0, byte(i >> 8), byte(i)}), 9), 6)
		if len(junk)+2 == int(m.MaxEntries()) {
			break
		}
		if err := m.Put(k, bpf.Be2feValue{Count: 1}); err != nil {
			t.Fatalf("fill: entry %d of %d: %v", len(junk)+1, m.MaxEntries(), err)
		}
		junk = append(junk, k)
	}
	clearJunk := func() {
		for _, k := range junk {
			if err := m.Delete(k); err != nil {
				t.Fatal(err)
			}
		}
		junk = nil
	}
	t.Cleanup(func() { clearJunk() })
	slotsOf := func() int {
		d.mu.Lock()
		defer d.mu.Unlock()
		return d.prog.Index().Len()
	}

	// New: its first endpoint fits, its second does not.
	y := ixService("y", []netip.Addr{ixVIP(8)}, tcp80, ixB2, ixB3)
	_, err := d.ApplyService(ctx, y)
	if !errors.Is(err, ErrLimit) || !strings.Contains(err.Error(), "fluxvm_be2fe is full") {
		t.Fatalf("apply into a full index: %v, want ErrLimit naming fluxvm_be2fe", err)
	}
	t.Logf("apply y: %v", err)
	if _, err := d.Service("y"); !errors.Is(err, ErrNotFound) {
		t.Errorf("service y after the failed apply: %v", err)
	}
	if _, ok, _ := lookupFrontend(d, feKey(ixVIP(8), 80, 6)); ok {
		t.Error("the failed apply left y's frontend entry")
	}
	if n := slotsOf(); n != 1 {
		t.Errorf("model holds %d endpoints after the failed apply, want 1", n)
	}
	var v bpf.Be2feValue
	if err := m.Lookup(bpf.MakeBe2feKey(ixB2, 6), &v); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("the failed apply left the slot of its first backend: %+v %v", v, err)
	}

	// Update: a second VIP and two new endpoints; x stays as it was.
	xst, _ := d.Service("x")
	x2 := ixService("x", []netip.Addr{ixVIP(7), ixVIP6(9)}, tcp80, ixB1, ixB2, ixB3, ixB6)
	if _, err := d.ApplyService(ctx, x2); !errors.Is(err, ErrLimit) {
		t.Fatalf("update into a full index: %v, want ErrLimit", err)
	}
	if st, err := d.Service("x"); err != nil || st.Revision != xst.Revision || len(st.Frontends) != 1 || st.Frontends[0].ServiceID != xst.Frontends[0].ServiceID {
		t.Errorf("x after the failed update: %+v %v, want %+v", st, err, xst)
	}
	if _, ok, _ := lookupFrontend(d, feKey(ixVIP6(9), 80, 6)); ok {
		t.Error("the failed update left its new frontend entry")
	}
	if n := slotsOf(); n != 1 {
		t.Errorf("model holds %d endpoints after the failed update, want 1", n)
	}

	// Room again: both go through, and the index is exact.
	clearJunk()
	checkIndex(t, d, "after the failures", before)
	if _, err := d.ApplyService(ctx, x2); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ApplyService(ctx, y); err != nil {
		t.Fatal(err)
	}
	x7, x9, y8 := ixFrontend(ixVIP(7), 80, TCP), ixFrontend(ixVIP6(9), 80, TCP), ixFrontend(ixVIP(8), 80, TCP)
	checkIndex(t, d, "after the retries", map[string][]string{
		ixEndpointKey(ixB1, 6): {x7}, ixEndpointKey(ixB2, 6): {x7, y8}, ixEndpointKey(ixB3, 6): {x7, y8}, ixEndpointKey(ixB6, 6): {x9},
	})
}

// TestReverseIndexTraffic: connections from a VM through five services
// that list the same backends. The first four frontends of each backend
// endpoint have slots, the fifth has SvcFlagRevStored; every connection
// gets its replies from its VIP. Deleting the 2nd moves the 5th into the
// slots: its established connections keep working and so do new ones,
// also across a restart.
func TestReverseIndexTraffic(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	vip := func(i int) []netip.Addr { return []netip.Addr{ixVIP(byte(20 + i)), ixVIP6(byte(20 + i))} }
	for i := range 5 {
		s := e.service(1, 1, 1)
		s.Name, s.VIPs = fmt.Sprintf("s%d", i), vip(i)
		if _, err := d.ApplyService(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	flagged := func(what string, want ...int) {
		t.Helper()
		for i := range 5 {
			for _, a := range vip(i) {
				for _, p := range []Protocol{TCP, UDP} {
					v, ok := svcEntry(t, d, a, 80, p)
					if has := v.Flags&bpf.SvcFlagRevStored != 0; !ok && i != 1 || ok && has != slices.Contains(want, i) {
						t.Errorf("%s: s%d %s/%s: entry %v, SvcFlagRevStored %v, want it on %v", what, i, a, p, ok, has, want)
					}
				}
			}
		}
	}
	flagged("five services", 4)

	conns := map[int][]*lab.Conn{}
	talk := func(what string, skip int) {
		t.Helper()
		for i := range 5 {
			if i == skip {
				continue
			}
			for _, a := range vip(i) {
				c := e.dial(t, a)
				echo(t, c, fmt.Sprintf("%s: new connection to s%d %s", what, i, a))
				conns[i] = append(conns[i], c)
				if name, err := e.cli.AskUDP(netip.AddrPortFrom(a, 80), 2*time.Second); err != nil || name == "" {
					t.Errorf("%s: udp to s%d %s: %q %v", what, i, a, name, err)
				}
			}
			for _, c := range conns[i] {
				echo(t, c, fmt.Sprintf("%s: connection to s%d via %s", what, i, c.Backend))
			}
		}
	}
	talk("five services", -1)

	if err := d.DeleteService(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	flagged("s1 deleted")
	talk("s1 deleted", 1)

	d.Close()
	d = e.open(t)
	flagged("restarted")
	talk("restarted", 1)
}

// TestReverseIndexWithoutCatalog: a node without a catalog restores
// nothing, while the adopted maps keep serving its frontends; their slots
// stay (replies keep being translated) until the embedder applies the
// frontends again, which confirms each slot in place.
func TestReverseIndexWithoutCatalog(t *testing.T) {
	ctx := context.Background()
	root := filepath.Join(testenv.PinRoot(t), "service")
	svc := ixService("a", []netip.Addr{ixVIP(1)}, tcp80, ixB1)
	want := map[string][]string{ixEndpointKey(ixB1, 6): {ixFrontend(ixVIP(1), 80, TCP)}}
	d := ixOpen(t, root, "", bpf.TierS)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	checkIndex(t, d, "applied", want)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d = ixOpen(t, root, "", bpf.TierS)
	var (
		k bpf.Be2feKey
		v bpf.Be2feValue
		n int
	)
	for it := d.dp.Maps().FluxvmBe2fe.Iterate(); it.Next(&k, &v); {
		n++
		if v.Count != 1 || bpf.Addr(v.Slots[0].Vip, k.Family) != ixVIP(1) {
			t.Errorf("after the restart: entry %+v", v)
		}
	}
	if n != 1 {
		t.Fatalf("after the restart: %d entries, want the 1 the adopted maps serve", n)
	}
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	checkIndex(t, d, "applied again", want)
}

// lookupFrontend reads the frontend entry of k as the services component
// writes it; ok is false when there is none.
func lookupFrontend(d *Dataplane, k services.Key) (bpf.SvcValue, bool, error) {
	return datapathMaps{d: d}.Lookup(k)
}

// feKey names the frontend (vip, port, proto).
func feKey(vip netip.Addr, port uint16, proto uint8) services.Key {
	return services.Key{VIP: vip, Port: port, Proto: proto}
}
