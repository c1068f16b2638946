package bpf

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestOpenSizes: the maps Options.Sizes gives a size are loaded at it (the
// rest at the tier's capacity, which Capacities and Ceilings still
// report), and take less memory; sizes a map cannot have are refused.
func TestOpenSizes(t *testing.T) {
	page := TokenHAQueueBytes()
	for _, tc := range []struct {
		name  string
		sizes Sizes
		omit  Features
		want  map[string]uint32 // by map; others at the ceiling
		err   bool
	}{
		{name: "tier", sizes: Sizes{}, want: map[string]uint32{}},
		{name: "token", sizes: Sizes{CT6: TokenFlowEntries, NAT4: TokenFlowEntries, NAT6: TokenFlowEntries, FlowSlots: TokenFlowSlots, HAQueue: page},
			omit: FeatureFlowRecords,
			want: map[string]uint32{"fluxvm_fct6": TokenFlowEntries, "fluxvm_nat4": TokenFlowEntries, "fluxvm_nat6": TokenFlowEntries, "fluxvm_sflows": TokenFlowSlots, "fluxvm_haq": page}},
		{name: "over the ceiling", sizes: Sizes{CT4: 1 << 20}, err: true},
		{name: "ring not a power of two", sizes: Sizes{FlowSlots: 100}, omit: FeatureFlowRecords, err: true},
		// The programs pick a record's slot by the compiled size: a
		// smaller ring with flow records loaded would lose most records.
		{name: "small ring with flow records", sizes: Sizes{FlowSlots: TokenFlowSlots}, err: true},
		{name: "small ring with flow records, HA omitted", sizes: Sizes{FlowSlots: TokenFlowSlots}, omit: FeatureHA, err: true},
		{name: "queue not pages", sizes: Sizes{HAQueue: 1000}, err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := filepath.Join(testenv.PinRoot(t), "service")
			d, err := Open(Options{PinRoot: root, Tier: TierS, Sizes: tc.sizes, OmitFeatures: tc.omit})
			if tc.err {
				if !errors.Is(err, ErrMapSize) {
					t.Fatalf("open: %v, want ErrMapSize", err)
				}
				if _, err := os.Stat(root); !os.IsNotExist(err) {
					t.Errorf("failed open left %s: %v", root, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			ceil, err := Ceilings(TierS)
			if err != nil {
				t.Fatal(err)
			}
			if c := d.Status().Capacities; c.Conntrack != ceil["fluxvm_fct4"] || c.NAT != ceil["fluxvm_nat4"] {
				t.Errorf("capacities %+v: not the tier's", c)
			}
			mm := mapMemory(t, d)
			sizes, err := d.MapSizes()
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range sizes {
				want, ok := tc.want[s.Map]
				if !ok {
					want = ceil[s.Map]
				}
				if s.Map == "fluxvm_sock_fwd" || s.Map == "fluxvm_sock_rev" {
					want = socketMapsOff
				}
				if s.MaxEntries != want || d.Map(s.Map).MaxEntries() != want || s.Ceiling != ceil[s.Map] {
					t.Errorf("%s: %d entries (map %d), ceiling %d; want %d, ceiling %d", s.Map, s.MaxEntries, d.Map(s.Map).MaxEntries(), s.Ceiling, want, ceil[s.Map])
				}
				// Token: at most a sixteenth of the tier's memory.
				if ok && uint64(want)*16 <= uint64(ceil[s.Map]) && mm.Maps[s.Map]*16 > tierMemory(t, s.Map) {
					t.Errorf("%s: %d bytes at %d entries, more than a sixteenth of the tier's %d", s.Map, mm.Maps[s.Map], want, tierMemory(t, s.Map))
				}
			}
		})
	}
}

// TestSizesKeepAndGrow: a pinned conntrack map larger than the size asked
// is kept as it is (a map never shrinks below what it held, entries and
// all); one smaller than asked is recreated at the size asked with its
// entries migrated; and GrowFlowMaps grows a map in place of the running
// one, every entry carried over, the pin naming the new map.
func TestSizesKeepAndGrow(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	ceil, err := Ceilings(TierS)
	if err != nil {
		t.Fatal(err)
	}
	full := ceil["fluxvm_fct4"]

	// 1. Token at first: 500 entries fit.
	d := openT(t, Options{PinRoot: root, Tier: TierS, Sizes: Sizes{CT4: TokenFlowEntries}})
	putCT(t, d, 500)
	d.Close()
	// 2. Asked at full: recreated at the ceiling, the 500 migrated.
	d = openT(t, Options{PinRoot: root, Tier: TierS})
	if m := d.Maps().FluxvmFct4; m.MaxEntries() != full || count(t, m) != 500 || !slices.Contains(d.Status().NewMaps, "fluxvm_fct4") {
		t.Errorf("full after token: %d entries' room, %d entries, new maps %v; want %d, 500, recreated", m.MaxEntries(), count(t, m), d.Status().NewMaps, full)
	}
	putCT(t, d, 2000)
	d.Close()
	// 3. Asked at token again: the pinned full map is kept.
	d = openT(t, Options{PinRoot: root, Tier: TierS, Sizes: Sizes{CT4: TokenFlowEntries}})
	if m := d.Maps().FluxvmFct4; m.MaxEntries() != full || count(t, m) != 2000 || !slices.Contains(d.Status().KeptMaps, "fluxvm_fct4") {
		t.Errorf("token after full: %d entries' room, %d entries, kept %v; want %d, 2000, kept", m.MaxEntries(), count(t, m), d.Status().KeptMaps, full)
	}
	if got := pinnedMaxEntries(t, root); got != full {
		t.Errorf("pinned map: %d entries' room, want %d", got, full)
	}
	// 4. Emptied, asked at token: nothing to keep, recreated at token.
	for _, k := range ctKeys(2000) {
		if err := d.Maps().FluxvmFct4.Delete(k); err != nil {
			t.Fatal(err)
		}
	}
	d.Close()
	d = openT(t, Options{PinRoot: root, Tier: TierS, Sizes: Sizes{CT4: TokenFlowEntries}})
	if m := d.Maps().FluxvmFct4; m.MaxEntries() != TokenFlowEntries || count(t, m) != 0 || !slices.Contains(d.Status().NewMaps, "fluxvm_fct4") {
		t.Errorf("token after an empty full map: %d entries' room, %d entries, new %v; want %d, 0, recreated", m.MaxEntries(), count(t, m), d.Status().NewMaps, TokenFlowEntries)
	}
	d.Close()

	// 5. GrowFlowMaps from a token map holding entries.
	root = filepath.Join(testenv.PinRoot(t), "service")
	d = openT(t, Options{PinRoot: root, Tier: TierS, Sizes: Sizes{CT4: TokenFlowEntries, NAT6: TokenFlowEntries}})
	putCT(t, d, 900)
	res, err := d.GrowFlowMaps(map[string]uint32{"fluxvm_fct4": 0, "fluxvm_nat6": TokenFlowEntries}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Switched || len(res.Maps) != 1 || res.Maps[0].Map != "fluxvm_fct4" || res.Maps[0].Kept != 900 || res.Maps[0].Dropped != 0 {
		t.Errorf("grow: %+v; want fluxvm_fct4 alone (fluxvm_nat6 is that large), 900 kept, none dropped", res)
	}
	if m := d.Maps().FluxvmFct4; m.MaxEntries() != full || count(t, m) != 900 {
		t.Errorf("grown: %d entries' room, %d entries; want %d, 900", m.MaxEntries(), count(t, m), full)
	}
	if got := pinnedMaxEntries(t, root); got != full {
		t.Errorf("pinned map after the grow: %d entries' room, want %d", got, full)
	}
	if d.Map("fluxvm_nat6").MaxEntries() != TokenFlowEntries {
		t.Errorf("fluxvm_nat6 grew: %d", d.Map("fluxvm_nat6").MaxEntries())
	}
	// Nothing more to grow: no switch.
	if res, err := d.GrowFlowMaps(map[string]uint32{"fluxvm_fct4": 0}, nil); err != nil || res.Switched {
		t.Errorf("second grow: %+v, %v; want nothing done", res, err)
	}
	if _, err := d.GrowFlowMaps(map[string]uint32{"fluxvm_sflows": 0}, nil); err == nil {
		t.Error("grew fluxvm_sflows, not a flow map")
	}
}

// pinnedMaxEntries is the size of the fluxvm_fct4 pinned under root.
func pinnedMaxEntries(t *testing.T, root string) uint32 {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, "maps", "fluxvm_fct4"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	return m.MaxEntries()
}

// tierMemory is the memory of map name created at tier S's capacity.
func tierMemory(t *testing.T, name string) uint64 {
	t.Helper()
	spec, err := Spec(TierS)
	if err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(spec.Maps[name])
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	return fdinfoMemlock(t, m)
}

func ctKeys(n int) []Tuple4 {
	keys := make([]Tuple4, n)
	for i := range keys {
		keys[i] = ctKey(i)
	}
	return keys
}

// TestHaveTCX: the probe agrees with an attach of a TC program by a TCX
// link to the loopback of a fresh network namespace.
func TestHaveTCX(t *testing.T) {
	testenv.InNetNS(t, func() {
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "GPL",
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()}})
		if err != nil {
			t.Fatal(err)
		}
		defer prog.Close()
		lo, err := net.InterfaceByName("lo")
		if err != nil {
			t.Fatal(err)
		}
		l, err := link.AttachTCX(link.TCXOptions{Interface: lo.Index, Program: prog, Attach: ebpf.AttachTCXIngress})
		if err == nil {
			l.Close()
		}
		if got, want := HaveTCX(), err == nil; got != want {
			t.Errorf("HaveTCX() = %v; attaching by TCX: %v", got, err)
		}
	})
}
