package bpf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
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
	// Every state with every kind of flow (below, i%6).
	states := []CTState{CTTCPEstablished, CTTCPSyn, CTUDP, CTTCPFin, CTTCPRst, CTTCPEstablished}
	state := states[i/6%len(states)]
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
		if err := bindToOneCPU(); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// bindToOneCPU binds the calling thread to the first CPU the process may
// run on (the same CPU on every call).
func bindToOneCPU() error {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return err
	}
	for cpu := range 1024 {
		if set.IsSet(cpu) {
			set.Zero()
			set.Set(cpu)
			return unix.SchedSetaffinity(0, &set)
		}
	}
	return errors.New("no CPU in the affinity mask")
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
	ceil, now := growTestStart(t)
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
			// Every map of the three objects (TC, XDP, socket LB) by
			// object and name; the TC object's by name alone too.
			objMaps := func() map[string]*ebpf.Map {
				out := map[string]*ebpf.Map{}
				for obj, c := range map[string]*ebpf.Collection{"tc": d.coll, "xdp": d.xcoll, "connect": d.ccoll} {
					for name, m := range c.Maps {
						if !dataSection(name) {
							out[obj+"/"+name] = m
						}
					}
				}
				return out
			}
			ids, objIDs := map[string]ebpf.MapID{}, map[string]ebpf.MapID{}
			for name, m := range d.coll.Maps {
				if !dataSection(name) {
					ids[name] = mapID(t, m)
				}
			}
			for name, m := range objMaps() {
				objIDs[name] = mapID(t, m)
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
			// The maps each program of the three objects (TC, XDP,
			// socket LB) uses.
			progMaps := map[string][]ebpf.MapID{}
			for _, c := range []*ebpf.Collection{d.coll, d.xcoll, d.ccoll} {
				for pn, p := range c.Programs {
					info, err := p.Info()
					if err != nil {
						t.Fatal(err)
					}
					progMaps[pn], _ = info.MapIDs()
				}
			}
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
				if !slices.Contains(progMaps["fluxvm_from_vm"], newID) {
					t.Errorf("%s: fluxvm_from_vm uses maps %v, not the new %d", name, progMaps["fluxvm_from_vm"], newID)
				}
				for pn, used := range progMaps {
					if slices.Contains(used, ids[name]) {
						t.Errorf("%s: program %s still uses the old map %d", name, pn, ids[name])
					}
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
			after := objMaps()
			if len(after) != len(objIDs) {
				t.Errorf("%d maps in the objects after the grow, %d before", len(after), len(objIDs))
			}
			for name, id := range objIDs {
				_, base, _ := strings.Cut(name, "/")
				if slices.Contains(tc.grow, base) {
					if m := after[name]; m != nil && mapID(t, m) == id {
						t.Errorf("%s: still the old map %d", name, id)
					}
					continue
				}
				if m := after[name]; m == nil || mapID(t, m) != id {
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

// harnessOn is a harness over the maps of d (the TC object's), to program
// services the way the datapath tests do. Only its control-plane writes
// (services, backends, Maglev tables, the reverse index) may be used: its
// handles of the flow maps are those of before any grow.
func harnessOn(t *testing.T, d *Datapath) *harness {
	t.Helper()
	h := &harness{t: t, th: testenv.NewThread(t), spec: d.spec,
		fes: map[uint32][]harnessFrontend{}, bes: map[uint32]harnessBackend{}, stored: map[uint32]bool{}}
	if err := assignNamed(&h.objs.serviceMaps, d.coll.Maps, nil); err != nil {
		t.Fatal(err)
	}
	h.fe = d.fe
	return h
}

// runProg runs prog on frame in th's namespace, for goroutines that are
// not the test's.
func runProg(th *testenv.Thread, prog *ebpf.Program, frame []byte) (uint32, []byte, error) {
	opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+256), Repeat: 1}
	var ret uint32
	var err error
	th.Do(func() { ret, err = prog.Run(&opts) })
	return ret, opts.DataOut, err
}

// endpointsOf decodes the source and destination of frame (zero when it
// does not decode).
func endpointsOf(frame []byte) (src, dst netip.AddrPort) {
	p := pkt.Decode(frame)
	if p.NetworkLayer() == nil || p.TransportLayer() == nil {
		return src, dst
	}
	nf, tf := p.NetworkLayer().NetworkFlow(), p.TransportLayer().TransportFlow()
	sa, _ := netip.AddrFromSlice(nf.Src().Raw())
	da, _ := netip.AddrFromSlice(nf.Dst().Raw())
	return netip.AddrPortFrom(sa.Unmap(), binary.BigEndian.Uint16(tf.Src().Raw())),
		netip.AddrPortFrom(da.Unmap(), binary.BigEndian.Uint16(tf.Dst().Raw()))
}

// switchGate is the lock a grow holds around its switch (the Switch of
// CompactOptions): a read-write lock whose readers run the programs, as
// the packets of a TCX link do (after the link update returns, none
// reaches the old program). atSwitch runs when the grow asks for it,
// before it is granted: after the copy and the catch-up passes before the
// switch, when only the pass after it can carry what the old program
// learns.
type switchGate struct {
	mu       sync.RWMutex
	atSwitch func()
}

func (g *switchGate) Lock() {
	if g.atSwitch != nil {
		g.atSwitch()
	}
	g.mu.Lock()
}

func (g *switchGate) Unlock() { g.mu.Unlock() }

// TestGrowWhileProgramWrites: each flow map, at its token size with 512
// entries of the fixture, grows while the real programs (BPF_PROG_TEST_RUN)
// learn new flows of an east-west service on it, one every millisecond at
// most, and complete their handshakes (SYN-ACK through fluxvm_to_vm, ACK
// through fluxvm_from_vm), from before the grow starts to after it ends:
// the conntrack maps by any flow, the reverse-NAT maps by the flows of a
// frontend whose reverse halves are stored. A few more flows are learned
// by the old program at the last moment before the switch.
//
// What GrowFlowMaps documents (and docs/operations.md, "Maps sized by
// need"): no entry is lost. The flows the old program learned or changed
// during the copy and the program loads are caught up before the switch,
// those of the last moment after it; the new program learns into the new
// map. So the bound asserted is zero: the new map holds every entry the
// old map ended with, byte for byte, and every flow the new program
// learned, nothing else; every flow the old program learned has its
// replies translated by the new program. The documented exposures are
// not entries lost and are left out: a reply that reaches the new program
// between the switch and the last catch-up, before its flow is copied,
// goes out untranslated; a change in the same tick of the coarse clock as
// the version the copy read is not caught up (the writer spaces its
// changes two ticks apart).
func TestGrowWhileProgramWrites(t *testing.T) {
	ceil, now := growTestStart(t)
	var v4, v6 variant
	for _, v := range variants() {
		switch v.name {
		case "ipv4_tcp":
			v4 = v
		case "ipv6_tcp":
			v6 = v
		}
	}
	const (
		prefill = 512
		budget  = 400 // flows the old program learns, at most: the token map holds them with the prefill
		last    = 5   // learned by the old program at the switch
	)
	// The writer learns a flow per millisecond at most, answers it lag
	// flows later and acknowledges it 2*lag flows later: each change of
	// an entry at least two ticks of the coarse clock after its previous
	// version. A change in the same tick as the version the copy read has
	// the same last-seen time, and the catch-up keeps the version it has
	// (catchUpEntry; docs/operations.md, the compacting reload's step 4).
	var tick unix.Timespec
	if err := unix.ClockGetres(unix.CLOCK_MONOTONIC_COARSE, &tick); err != nil {
		t.Fatal(err)
	}
	lag := max(10, int(2*tick.Nano()/1e6)+1)
	after := 2*lag + 20 // flows learned by the new program, at least
	for _, tc := range []struct {
		name  string
		v     variant
		sizes Sizes
		// rev: the frontend stores reverse halves (its flows write the
		// reverse-NAT map).
		rev bool
	}{
		{"fluxvm_fct4", v4, Sizes{CT4: TokenFlowEntries}, false},
		{"fluxvm_fct6", v6, Sizes{CT6: TokenFlowEntries}, false},
		{"fluxvm_nat4", v4, Sizes{NAT4: TokenFlowEntries}, true},
		{"fluxvm_nat6", v6, Sizes{NAT6: TokenFlowEntries}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name, v := tc.name, tc.v
			root := filepath.Join(testenv.PinRoot(t), "service")
			d := openT(t, Options{PinRoot: root, Tier: TierS, Sizes: tc.sizes})
			h := harnessOn(t, d)
			// The programs run on the CPU the prefill ran on (onOneCPU):
			// the token map, an LRU, then holds all it is given.
			var perr error
			h.th.Do(func() { perr = bindToOneCPU() })
			if perr != nil {
				t.Fatal(perr)
			}
			v.setup(h)
			if tc.rev {
				h.revStored(sid)
			}
			// The entry a flow from the client's port writes into the
			// map under test.
			keyOf := func(port uint16) string {
				tp := v.flow(port)
				if tc.rev {
					tp = v.natKey(v.backends[0], port)
				}
				kb, err := binary.Append(nil, binary.NativeEndian, tp.key())
				if err != nil {
					t.Fatal(err)
				}
				return string(kb)
			}
			fixture := growFixtures(t, name, prefill, now)
			putRaw(t, d.Map(name), fixture)
			old, err := d.Map(name).Clone() // the old map, read after the grow
			if err != nil {
				t.Fatal(err)
			}
			defer old.Close()
			p0 := d.Programs().FluxvmFromVm

			type learned struct {
				port uint16
				old  bool
			}
			var (
				mu       sync.Mutex
				flows    []learned
				oldN     int
				newN     int
				werr     error
				stop     = make(chan struct{})
				done     = make(chan struct{})
				atSwitch int
			)
			learn := func(prog *ebpf.Program, port uint16) error {
				ret, out, err := runProg(h.th, prog, v.fwd(port, pkt.SYN))
				if err == nil && ret != tcOK {
					err = fmt.Errorf("verdict %d", int32(ret))
				}
				if _, dst := endpointsOf(out); err == nil && dst != v.backends[0] {
					err = fmt.Errorf("forwarded to %v, want %v", dst, v.backends[0])
				}
				if err != nil {
					return fmt.Errorf("flow from port %d: %w", port, err)
				}
				return nil
			}
			// Ports: 20000+ by the writer, 10000+ at the switch.
			gate := &switchGate{atSwitch: func() {
				p := d.Programs().FluxvmFromVm
				if p != p0 {
					t.Error("at the switch: the programs were switched already")
					return
				}
				for i := range last {
					if err := learn(p, uint16(10000+i)); err != nil {
						t.Errorf("at the switch: %v", err)
						continue
					}
					mu.Lock()
					flows = append(flows, learned{uint16(10000 + i), true})
					atSwitch++
					mu.Unlock()
				}
			}}
			// handshake completes, on program set progs, the handshake of a
			// flow the same programs learned: the backend's SYN-ACK
			// (translated back from the VIP), the client's ACK (moves the
			// entry to established).
			handshake := func(progs *Programs, port uint16, synack bool) error {
				if synack {
					ret, out, err := runProg(h.th, progs.FluxvmToVm, v.reply(v.backends[0], port, pkt.SYNACK))
					if src, _ := endpointsOf(out); err == nil && (ret != tcOK || src != v.vip) {
						err = fmt.Errorf("verdict %d, from %v", int32(ret), src)
					}
					if err != nil {
						return fmt.Errorf("SYN-ACK to port %d: %w", port, err)
					}
					return nil
				}
				ret, out, err := runProg(h.th, progs.FluxvmFromVm, v.fwd(port, pkt.ACK))
				if _, dst := endpointsOf(out); err == nil && (ret != tcOK || dst != v.backends[0]) {
					err = fmt.Errorf("verdict %d, to %v", int32(ret), dst)
				}
				if err != nil {
					return fmt.Errorf("ACK from port %d: %w", port, err)
				}
				return nil
			}
			var handshakes [2]int // completed on the new, the old programs
			go func() {
				defer close(done)
				port := uint16(20000)
				// The writer's flows in order, and the next to answer and
				// to acknowledge (lag and 2*lag flows later).
				var mine []learned
				synackAt, ackAt := 0, 0
				deadline := time.Now().Add(30 * time.Second)
				for time.Now().Before(deadline) {
					select {
					case <-stop:
						return
					default:
					}
					gate.mu.RLock()
					progs := d.Programs()
					p := progs.FluxvmFromVm
					isOld := p == p0
					mu.Lock()
					full := isOld && oldN >= budget
					mu.Unlock()
					var err error
					if !full {
						err = learn(p, port)
						if err == nil {
							mine = append(mine, learned{port, isOld})
						}
					}
					for err == nil && synackAt < len(mine)-lag {
						f := mine[synackAt]
						synackAt++
						if f.old == isOld {
							err = handshake(progs, f.port, true)
							break
						}
					}
					for err == nil && ackAt < len(mine)-2*lag {
						f := mine[ackAt]
						ackAt++
						if f.old == isOld {
							if err = handshake(progs, f.port, false); err == nil && isOld {
								handshakes[1]++
							} else if err == nil {
								handshakes[0]++
							}
							break
						}
					}
					gate.mu.RUnlock()
					if err != nil {
						mu.Lock()
						werr = err
						mu.Unlock()
						return
					}
					if !full {
						mu.Lock()
						flows = append(flows, learned{port, isOld})
						if isOld {
							oldN++
						} else {
							newN++
						}
						mu.Unlock()
						port++
					}
					time.Sleep(time.Millisecond)
				}
			}()
			// The writer starts first.
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
				mu.Lock()
				n, err := oldN, werr
				mu.Unlock()
				if err != nil || n >= 10 || time.Now().After(deadline) {
					break
				}
			}
			res, gerr := d.GrowFlowMaps(map[string]uint32{name: 0}, gate)
			// And goes on on the new program.
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
				mu.Lock()
				n, err := newN, werr
				mu.Unlock()
				if err != nil || n >= after || time.Now().After(deadline) {
					break
				}
			}
			close(stop)
			<-done
			if gerr != nil {
				t.Fatal(gerr)
			}
			if werr != nil {
				t.Fatalf("the program: %v", werr)
			}
			if atSwitch != last || newN < after || oldN < 10 {
				t.Fatalf("learned %d flows on the old program (%d at the switch), %d on the new: want at least 10, %d, %d",
					oldN+atSwitch, atSwitch, newN, last, after)
			}

			oldEntries := dumpRaw(t, old)
			newEntries := dumpRaw(t, d.Map(name))
			if m := d.Map(name); m.MaxEntries() != ceil[name] {
				t.Errorf("grown map: %d entries' room, want %d", m.MaxEntries(), ceil[name])
			}
			reportDiff(t, "the pinned map against the datapath's", diffRaw(dumpRaw(t, loadPinned(t, root, name)), newEntries))
			// The old map: the prefill as written, and every flow the old
			// program learned (none evicted).
			var oldKeys, newKeys []string
			for _, f := range flows {
				if f.old {
					oldKeys = append(oldKeys, keyOf(f.port))
				} else {
					newKeys = append(newKeys, keyOf(f.port))
				}
			}
			if len(oldEntries) != prefill+len(oldKeys) {
				t.Errorf("the old map holds %d entries, want the %d of the prefill and the %d the old program learned", len(oldEntries), prefill, len(oldKeys))
			}
			for k, val := range fixture {
				if !bytes.Equal(oldEntries[k], val) {
					t.Fatalf("the old map lost or changed a prefilled entry %x: %x", k, oldEntries[k])
				}
			}
			// The new map: the old map's every entry byte for byte, and
			// the flows the new program learned; nothing else.
			want := maps.Clone(oldEntries)
			for _, k := range newKeys {
				if _, ok := newEntries[k]; !ok {
					t.Errorf("flow %x the new program learned is not in the new map", k)
					continue
				}
				if _, dup := want[k]; dup {
					t.Errorf("flow %x in the old map too", k)
				}
				want[k] = newEntries[k]
			}
			reportDiff(t, "the grown map", diffRaw(newEntries, want))
			var lost []string
			for _, k := range oldKeys {
				if _, ok := newEntries[k]; !ok {
					lost = append(lost, fmt.Sprintf("%x", k))
				}
			}
			if len(lost) != 0 {
				t.Errorf("%d of the %d flows the old program learned are not in the new map: %v", len(lost), len(oldKeys), lost[:min(len(lost), 3)])
			}
			if len(res.Maps) != 1 {
				t.Fatalf("grow: %+v", res)
			}
			mc := res.Maps[0]
			caught := len(oldEntries) - mc.Kept
			if !res.Switched || mc.Map != name || mc.Dropped != 0 || mc.Kept < prefill || mc.Kept > len(oldEntries) || mc.CaughtUp < caught {
				t.Errorf("grow: %+v; want none dropped, %d..%d kept, at least %d caught up", mc, prefill, len(oldEntries), caught)
			}
			// The last moment's flows came by the catch-up after the
			// switch; some of the others by the passes before it.
			if caught < last {
				t.Errorf("%d of the old program's flows caught up, want at least the %d of the switch", caught, last)
			}
			t.Logf("%s: %d prefilled, %d learned by the old program (%d caught up, %d handshakes completed), %d by the new (%d); switch %v",
				name, prefill, len(oldKeys), caught, handshakes[1], len(newKeys), handshakes[0], res.SwitchTime)

			// Replies of every flow the old program learned are
			// translated by the new one.
			to := d.Programs().FluxvmToVm
			var untranslated []string
			for _, f := range flows {
				if !f.old {
					continue
				}
				ret, out, err := runProg(h.th, to, v.reply(v.backends[0], f.port, pkt.SYNACK))
				if src, _ := endpointsOf(out); err != nil || ret != tcOK || src != v.vip {
					untranslated = append(untranslated, fmt.Sprintf("port %d: verdict %d, from %v (%v)", f.port, int32(ret), src, err))
				}
			}
			if len(untranslated) != 0 {
				t.Errorf("%d replies of the old program's flows not translated by the new one (want TC_ACT_OK from the VIP): %v",
					len(untranslated), untranslated[:min(len(untranslated), 3)])
			}
		})
	}
}

// growTestStart is what the grow tests start from: tier S's ceilings and
// the coarse clock now.
func growTestStart(t *testing.T) (map[string]uint32, uint64) {
	t.Helper()
	ceil, err := Ceilings(TierS)
	if err != nil {
		t.Fatal(err)
	}
	now, err := monotonicCoarse()
	if err != nil {
		t.Fatal(err)
	}
	return ceil, now
}
