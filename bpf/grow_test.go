package bpf

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"maps"
	"net/netip"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// The grow's promise (GrowFlowMaps, docs/operations.md "Maps sized by
// need"): every entry carried over byte for byte. These tests fill flow
// maps with entries whose every field is set, fields a migration loses
// easily included (timestamps, flags, SNAT address and port, the HA /
// L7 union, flow record ids, policy revisions, padding), grow them, and
// compare every byte.

// growFixture is the i-th entry of a flow map's fixture: distinct keys
// (clients, VIPs, ports, protocols varied) and values shaped as the
// datapath writes them, every kind of flow in turn, every field its kind
// uses set. now is a CLOCK_MONOTONIC time the entries were last seen
// before.
func growFixture(name string, i int, now uint64) (key, value any) {
	// Clients 10.2.0.0/16 and fd00:2:0:1:0:2::/96, reply sources
	// (backends) 10.3.0.0/16 and fd00:3:0:1:0:3::/96, SNAT addresses
	// 192.0.2.1-3 and 2001:db8:a:b:c:d:e:1-3: none of them an address
	// the programs of TestGrowWhileProgramWrites write. The IPv6
	// addresses have no zero word, so that every word of an address
	// field is checked.
	v6addr := func(pfx string, i int) [4]uint32 {
		a := netip.MustParseAddr(pfx).As16()
		a[14], a[15] = byte(i>>8), byte(i)|1
		return AddrWords(netip.AddrFrom16(a))
	}
	v4addr := func(a, b byte, i int) uint32 {
		return AddrWords(netip.AddrFrom4([4]byte{a, b, byte(i >> 8), byte(i)}))[0]
	}
	client4 := func(i int) uint32 { return v4addr(10, 2, i) }
	client6 := func(i int) [4]uint32 { return v6addr("fd00:2:0:1:0:2::", 2*i) }
	vip4 := AddrWords(netip.AddrFrom4([4]byte{10, 96, 0, byte(10 + i%5)}))[0]
	vip6 := v6addr("fd00:96:0:1:0:1:0:0", 0x10+2*(i%5))
	be4, be6 := v4addr(10, 3, i), v6addr("fd00:3:0:1:0:3::", 2*i)
	snat4 := AddrWords(netip.AddrFrom4([4]byte{192, 0, 2, byte(1 + i%3)}))
	snat6 := v6addr("2001:db8:a:b:c:d:e:0", 2*(i%3))
	// Without this many seconds of uptime, "seen a minute ago" would wrap.
	now = max(now, 3600e9)
	v6 := name == "fluxvm_fct6" || name == "fluxvm_nat6"
	proto := uint8(ipTCP)
	states := []CTState{CTTCPEstablished, CTTCPSyn, CTUDP, CTTCPFin, CTTCPRst, CTTCPEstablished}
	state := states[i%len(states)]
	if state == CTUDP {
		proto = ipUDP
	}
	sport := uint16(32768 + i*37%28000)
	dport := []uint16{80, 443, 53, 8080, 6443}[i%5]
	// Seen between 1 and 60 s ago, created up to 10 min before that.
	seen := now - uint64(1+i%60)*1e9 - uint64(i)*1_000_003
	created := seen - uint64(i%600)*1e9 - 12_345
	sid, bid := uint32(1+i%5), uint32(100+i%13)
	flow := uint32(0x5eed0000 + i*7 + 1)

	if name == "fluxvm_fct4" || name == "fluxvm_fct6" {
		// The kinds in turn: east-west (replies from the entry), east-west
		// audited, north-south SNAT (HA-replicated: ha_until), routed DSR,
		// L7 (l7_ifindex), SNAT audited.
		kinds := []uint8{CTFlagRevDerived, CTFlagRevDerived | CTFlagAudited, CTFlagSNAT, CTFlagDSR, CTFlagL7, CTFlagSNAT | CTFlagAudited}
		v := CTValue{ServiceId: sid, BackendId: bid, CreatedNs: created, LastSeenNs: seen,
			DeadlineNs: seen + 7200e9, State: uint8(state), Flags: kinds[i%len(kinds)], Flow: flow,
			PolicyRev: uint32(3 + i%4)}
		switch f := v.Flags; {
		case f&CTFlagSNAT != 0:
			v.NatPort = Port(uint16(20000 + i))
			v.NatAddr = snat4
			if v6 {
				v.NatAddr = snat6
			}
			v.L7Ifindex = uint32(seen/1e9) + 30 // ha_until: a second
		case f&CTFlagL7 != 0:
			v.BackendId = 0
			v.L7Ifindex = uint32(40 + i%3)
		case f&CTFlagDSR != 0:
			v.L7Ifindex = uint32(seen/1e9) + 30
		}
		if v6 {
			return Tuple6{Saddr: client6(i), Daddr: vip6, Sport: Port(sport), Dport: Port(dport), Proto: proto}, v
		}
		return Tuple4{Saddr: client4(i), Daddr: vip4, Sport: Port(sport), Dport: Port(dport), Proto: proto}, v
	}

	// Reverse NAT: the reply's view, backend -> client (or -> the SNAT
	// address and port, the client's own in the value).
	snat := i%3 != 0
	v := NATValue{Vport: Port(dport), ServiceId: sid, BackendId: bid, Flow: flow, LastSeenNs: seen}
	v.Vip[0] = vip4
	if v6 {
		v.Vip = vip6
	}
	dst4, dst6, dstPort := client4(i), client6(i), sport
	if snat {
		v.Flags = NATFlagSNAT
		if i%2 == 0 {
			v.Flags |= NATFlagHostRouting
		}
		v.Client[0], v.Cport = client4(i), Port(sport)
		if v6 {
			v.Client = client6(i)
		}
		dst4, dst6, dstPort = snat4[0], snat6, uint16(20000+i)
	} else {
		v.Flags = NATFlagHostRouting
	}
	if v6 {
		return Tuple6{Saddr: be6, Daddr: dst6, Sport: Port(8080), Dport: Port(dstPort), Proto: proto}, v
	}
	return Tuple4{Saddr: be4, Daddr: dst4, Sport: Port(8080), Dport: Port(dstPort), Proto: proto}, v
}

// zeroFields lists the fields of struct v (array elements one by one)
// that are zero, padding (Pad...) left out.
func zeroFields(v any) []string {
	var out []string
	rv := reflect.ValueOf(v)
	for i := range rv.NumField() {
		f := rv.Type().Field(i)
		if f.Name == "_" || strings.HasPrefix(f.Name, "Pad") {
			continue
		}
		fv := rv.Field(i)
		if fv.Kind() == reflect.Array {
			for j := range fv.Len() {
				if fv.Index(j).IsZero() {
					out = append(out, fmt.Sprintf("%s[%d]", f.Name, j))
				}
			}
			continue
		}
		if fv.IsZero() {
			out = append(out, f.Name)
		}
	}
	return out
}

// rawEntries is a map's content: value bytes by key bytes.
type rawEntries map[string][]byte

// growFixtures builds the first n entries of the fixture of flow map name
// as raw bytes, and checks the fixture itself: distinct keys; every value
// field set where its kind uses it, and each in some entry. Odd entries
// then have every zero byte of their value replaced by 0x80 | its offset:
// values the datapath never writes (padding, the unused words of an IPv4
// address, the high bytes of small ids and timestamps set), which the map
// must carry as they are. A copy that rebuilds a value field by field and
// forgets one, or narrows one, shows in them. The last-seen time stays as
// it is, in the past: the catch-up (which copies what was seen since the
// grow began) must find nothing to do, so that it hides no loss of the
// copy.
func growFixtures(t *testing.T, name string, n int, now uint64) rawEntries {
	t.Helper()
	out := rawEntries{}
	everZero := map[string]bool{}
	for i := range n {
		k, v := growFixture(name, i, now)
		if z := zeroFields(k); len(z) != 0 {
			t.Fatalf("fixture %s[%d]: key fields %v zero", name, i, z)
		}
		z := zeroFields(v)
		if i == 0 {
			for _, f := range z {
				everZero[f] = true
			}
		}
		for f := range everZero {
			if !slices.Contains(z, f) {
				delete(everZero, f)
			}
		}
		// Zero as the datapath writes them: the unused words of an
		// IPv4 address, the SNAT fields of an entry without SNAT, the
		// L7 interface or HA second of an east-west entry, the backend
		// of an L7 one.
		z = slices.DeleteFunc(z, func(f string) bool {
			switch f {
			case "NatPort", "NatAddr[0]", "NatAddr[1]", "NatAddr[2]", "NatAddr[3]",
				"Vip[1]", "Vip[2]", "Vip[3]", "Client[0]", "Client[1]", "Client[2]", "Client[3]", "Cport",
				"L7Ifindex", "BackendId":
				return true
			}
			return false
		})
		if len(z) != 0 {
			t.Fatalf("fixture %s[%d]: value fields %v zero", name, i, z)
		}
		kb, err := binary.Append(nil, binary.NativeEndian, k)
		if err != nil {
			t.Fatal(err)
		}
		vb, err := binary.Append(nil, binary.NativeEndian, v)
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 1 {
			seen := lastSeenOffset(name)
			for j := range vb {
				if vb[j] == 0 && (j < seen || j >= seen+8) {
					vb[j] = 0x80 | byte(j)
				}
			}
		}
		if _, dup := out[string(kb)]; dup {
			t.Fatalf("fixture %s[%d]: key %x twice", name, i, kb)
		}
		out[string(kb)] = vb
	}
	// An IPv4 map's unused address words are zero in every entry the
	// datapath writes (the odd entries set them); any other field is set
	// in some entry.
	v6 := strings.HasSuffix(name, "6")
	for f := range everZero {
		if v6 || !strings.HasSuffix(f, "[1]") && !strings.HasSuffix(f, "[2]") && !strings.HasSuffix(f, "[3]") {
			t.Fatalf("fixture %s: field %s zero in every entry", name, f)
		}
	}
	return out
}

// onOneCPU runs fn on a thread bound to one CPU (and ended afterwards).
// Filling an LRU hash map to exactly its capacity needs it: the kernel
// hands each CPU free entries in batches, and a CPU whose batch runs out
// while another holds the last free ones evicts instead.
func onOneCPU(t *testing.T, fn func() error) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		var set unix.CPUSet
		set.Set(0)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// putRaw writes entries into m, on one CPU, and requires m to hold them
// all then.
func putRaw(t *testing.T, m *ebpf.Map, entries rawEntries) {
	t.Helper()
	onOneCPU(t, func() error {
		for k, v := range entries {
			if err := m.Update([]byte(k), v, ebpf.UpdateNoExist); err != nil {
				return fmt.Errorf("put %x: %w", k, err)
			}
		}
		return nil
	})
}

// dumpRaw reads every entry of m.
func dumpRaw(t *testing.T, m *ebpf.Map) rawEntries {
	t.Helper()
	out := rawEntries{}
	k, v := make([]byte, m.KeySize()), make([]byte, m.ValueSize())
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[string(k)] = slices.Clone(v)
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// diffRaw compares got with want entry by entry and byte by byte: keys
// missing, keys extra, and values differing (with the offsets that do).
// Empty when equal.
func diffRaw(got, want rawEntries) []string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(want)) {
		g, ok := got[k]
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("key %x missing", k))
		case !bytes.Equal(g, want[k]):
			var offs []int
			for j := range want[k] {
				if j >= len(g) || g[j] != want[k][j] {
					offs = append(offs, j)
				}
			}
			out = append(out, fmt.Sprintf("key %x: value differs at bytes %v:\n got %x\nwant %x", k, offs, g, want[k]))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(got)) {
		if _, ok := want[k]; !ok {
			out = append(out, fmt.Sprintf("key %x not written", k))
		}
	}
	return out
}

// reportDiff fails t with the first few differences of diffRaw.
func reportDiff(t *testing.T, what string, d []string) {
	t.Helper()
	if len(d) == 0 {
		return
	}
	t.Errorf("%s: %d entries differ; first: %v", what, len(d), d[:min(len(d), 3)])
}

// loadPinned is the map pinned at name under root's map directory.
func loadPinned(t *testing.T, root, name string) *ebpf.Map {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(mapDir(root), name), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// TestGrowKeepsEveryEntry: each flow map, loaded at its token size and
// filled to it (TokenFlowEntries) with the fixture, is grown to the
// tier's capacity (alone, or all four at once). The grown map, as the
// datapath holds it and as pinned, has the tier's capacity and holds every
// entry, every value byte for byte; the result counts them all kept, none
// dropped, none caught up (nothing ran); the programs use the new map;
// the other flow maps and every other map are the same objects with the
// same entries.
func TestGrowKeepsEveryEntry(t *testing.T) {
	ceil, err := Ceilings(TierS)
	if err != nil {
		t.Fatal(err)
	}
	now, err := monotonicCoarse()
	if err != nil {
		t.Fatal(err)
	}
	fixtures := map[string]rawEntries{}
	for _, name := range FlowMaps {
		fixtures[name] = growFixtures(t, name, TokenFlowEntries, now)
	}
	for _, tc := range []struct {
		name string
		grow []string
	}{
		{"fct4", []string{"fluxvm_fct4"}},
		{"fct6", []string{"fluxvm_fct6"}},
		{"nat4", []string{"fluxvm_nat4"}},
		{"nat6", []string{"fluxvm_nat6"}},
		{"all four", FlowMaps},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := filepath.Join(testenv.PinRoot(t), "service")
			tok := uint32(TokenFlowEntries)
			d := openT(t, Options{PinRoot: root, Tier: TierS, Sizes: Sizes{CT4: tok, CT6: tok, NAT4: tok, NAT6: tok}})
			for _, name := range FlowMaps {
				putRaw(t, d.Map(name), fixtures[name])
				if got := dumpRaw(t, d.Map(name)); len(got) != TokenFlowEntries {
					t.Fatalf("%s holds %d of the %d entries written", name, len(got), TokenFlowEntries)
				}
			}
			ids := map[string]ebpf.MapID{}
			for name, m := range d.coll.Maps {
				if !dataSection(name) {
					ids[name] = mapID(t, m)
				}
			}
			metaBefore, err := d.ReadMeta()
			if err != nil {
				t.Fatal(err)
			}

			sizes := map[string]uint32{}
			for _, name := range tc.grow {
				sizes[name] = 0
			}
			res, err := d.GrowFlowMaps(sizes, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !res.Switched || len(res.Maps) != len(tc.grow) {
				t.Fatalf("grow: %+v; want %v switched", res, tc.grow)
			}
			progMaps, err := d.Programs().FluxvmFromVm.Info()
			if err != nil {
				t.Fatal(err)
			}
			progIDs, _ := progMaps.MapIDs()
			for i, name := range tc.grow {
				mc := res.Maps[i]
				pinned := loadPinned(t, root, name)
				newID := mapID(t, pinned)
				if mc.Map != name || mc.Entries != TokenFlowEntries || mc.Kept != TokenFlowEntries || mc.Dropped != 0 ||
					len(mc.DroppedBy) != 0 || mc.CaughtUp != 0 || mc.PreviousMapID != ids[name] || mc.MapID != newID || newID == ids[name] {
					t.Errorf("%s: result %+v; want %d entries all kept, none dropped or caught up, map %d (was %d)",
						name, mc, TokenFlowEntries, newID, ids[name])
				}
				for what, m := range map[string]*ebpf.Map{"the datapath's map": d.Map(name), "the pinned map": pinned} {
					if m.MaxEntries() != ceil[name] {
						t.Errorf("%s, %s: %d entries' room, want the ceiling %d", name, what, m.MaxEntries(), ceil[name])
					}
					reportDiff(t, name+", "+what, diffRaw(dumpRaw(t, m), fixtures[name]))
				}
				if mapID(t, d.Map(name)) != newID {
					t.Errorf("%s: the datapath holds map %d, the pin names %d", name, mapID(t, d.Map(name)), newID)
				}
				if !slices.Contains(progIDs, newID) || slices.Contains(progIDs, ids[name]) {
					t.Errorf("%s: fluxvm_from_vm uses maps %v; want %d, not %d", name, progIDs, newID, ids[name])
				}
			}
			// Everything else as it was: the flow maps not grown (same
			// object, token size, every entry), and every other map the
			// same object; the meta map's content (the generation
			// marker, cleared during the grow) back as it was.
			for _, name := range FlowMaps {
				if slices.Contains(tc.grow, name) {
					continue
				}
				m := d.Map(name)
				if id := mapID(t, m); id != ids[name] || mapID(t, loadPinned(t, root, name)) != ids[name] || m.MaxEntries() != tok {
					t.Errorf("%s (not grown): map %d, %d entries' room; want map %d, %d", name, id, m.MaxEntries(), ids[name], tok)
				}
				reportDiff(t, name+" (not grown)", diffRaw(dumpRaw(t, m), fixtures[name]))
			}
			for name, id := range ids {
				if slices.Contains(tc.grow, name) {
					continue
				}
				if m := d.Map(name); m == nil || mapID(t, m) != id {
					t.Errorf("%s: another map after the grow (was %d)", name, id)
				}
			}
			if m, err := d.ReadMeta(); err != nil || m != metaBefore {
				t.Errorf("meta after the grow %+v (%v), was %+v", m, err, metaBefore)
			}
			// The sizes as reported.
			got, err := d.MapSizes()
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range got {
				if !slices.Contains(FlowMaps, s.Map) {
					continue
				}
				want := tok
				if slices.Contains(tc.grow, s.Map) {
					want = ceil[s.Map]
				}
				if s.MaxEntries != want {
					t.Errorf("MapSizes: %s at %d, want %d", s.Map, s.MaxEntries, want)
				}
			}
		})
	}
}
