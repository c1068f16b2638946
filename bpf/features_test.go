package bpf

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// featureSpec returns load's spec with the features set as an Open with
// OmitFeatures omit sets them.
func featureSpec(load func() (*ebpf.CollectionSpec, error), omit Features) func() (*ebpf.CollectionSpec, error) {
	return func() (*ebpf.CollectionSpec, error) {
		spec, err := load()
		if err != nil {
			return nil, err
		}
		return spec, setFeatures(spec, Options{OmitFeatures: omit}, "test", true)
	}
}

// newFeatureHarness is newHarness on the TC object loaded with omit left
// out.
func newFeatureHarness(t *testing.T, omit Features) *harness {
	t.Helper()
	spec, err := featureSpec(loadService, omit)()
	if err != nil {
		t.Fatal(err)
	}
	return newHarnessSpec(t, spec, 4096)
}

// TestFeaturesLoadTime: a feature left out at load has no effect even
// while its run-time switch says on (the meta map's HA flag, a flow
// sample rate of 1, a service's pacing entry); loaded alone, it works as
// before. One row per feature: the setup turns the run-time switch on,
// the packets run through the real programs, and effect measures what
// the feature leaves behind (records queued, records opened, departure
// times).
func TestFeaturesLoadTime(t *testing.T) {
	v := variants()[0]
	for _, tc := range []struct {
		feature Features
		// run sets the switch on, sends the packets and returns a
		// description of the feature's effect, "" when there is none.
		run func(t *testing.T, h *harness) string
	}{
		{FeatureHA, func(t *testing.T, h *harness) string {
			v.nsSetup(h, 0)
			h.haOn(true)
			h.haRecords()
			c0 := h.counters()[CounterHAEmitted]
			if ret, _ := h.run(h.objs.FluxvmNsIn, v.fwd(41000, pkt.SYN)); ret != tcOK {
				t.Fatalf("SYN: verdict %d", int32(ret))
			}
			ct, ok := h.ct(v.flow(41000))
			if !ok || ct.Flags&CTFlagSNAT == 0 {
				t.Fatalf("no SNAT conntrack entry: %+v", ct)
			}
			var out []string
			if recs := h.haRecords(); len(recs) != 0 {
				out = append(out, fmt.Sprintf("%d records queued", len(recs)))
			}
			if n := h.counters()[CounterHAEmitted] - c0; n != 0 {
				out = append(out, fmt.Sprintf("ha_emitted +%d", n))
			}
			if ct.L7Ifindex != 0 {
				out = append(out, fmt.Sprintf("ha_until %d", ct.L7Ifindex))
			}
			return strings.Join(out, ", ")
		}},
		{FeatureFlowRecords, func(t *testing.T, h *harness) string {
			v.setup(h)
			h.flowSampling(1)
			c0 := h.counters()[CounterFlowRecorded]
			if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(41001, pkt.SYN)); ret != tcOK {
				t.Fatalf("SYN: verdict %d", int32(ret))
			}
			// A drop of a client packet: a service without backends.
			h.noTable(sid)
			if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(41002, pkt.SYN)); ret != tcShot {
				t.Fatalf("SYN without backends: verdict %d, want a drop", int32(ret))
			}
			ct, _ := h.ct(v.flow(41001))
			var out []string
			if ct.Flow != 0 {
				out = append(out, fmt.Sprintf("conntrack flow id %d", ct.Flow))
			}
			if n := h.flowSeq(); n != 0 {
				out = append(out, fmt.Sprintf("%d records opened", n))
			}
			if n := h.counters()[CounterFlowRecorded] - c0; n != 0 {
				out = append(out, fmt.Sprintf("flow_recorded +%d", n))
			}
			return strings.Join(out, ", ")
		}},
		{FeatureEDT, func(t *testing.T, h *harness) string {
			v.setup(h)
			h.edt(sid, MinEDTRate, time.Second)
			if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(41003, pkt.SYN)); ret != tcOK {
				t.Fatalf("SYN: verdict %d", int32(ret))
			}
			ct, ok := h.ct(v.flow(41003))
			if !ok {
				t.Fatal("no conntrack entry")
			}
			ret, _, ts := h.runTstamp(h.objs.FluxvmToVm, v.reply(v.backends[ct.BackendId-1], 41003, pkt.ACK), 0)
			if ret != tcOK {
				t.Fatalf("reply: verdict %d", int32(ret))
			}
			if ts != 0 {
				return fmt.Sprintf("reply departure %d", ts)
			}
			return ""
		}},
	} {
		t.Run(tc.feature.String(), func(t *testing.T) {
			for _, load := range []struct {
				name string
				omit Features
				want bool
			}{
				{"left out", tc.feature, false},
				{"none loaded", AllFeatures, false},
				{"alone", AllFeatures &^ tc.feature, true},
			} {
				t.Run(load.name, func(t *testing.T) {
					h := newFeatureHarness(t, load.omit)
					h.reset()
					effect := tc.run(t, h)
					if got := effect != ""; got != load.want {
						t.Errorf("loaded %s: effect %q, want one: %v", AllFeatures&^load.omit, effect, load.want)
					}
				})
			}
		})
	}
}

// featureLoads are the feature sets TestFeatureVerifierCost measures.
func featureLoads() []struct {
	name string
	omit Features
} {
	out := []struct {
		name string
		omit Features
	}{{"none", AllFeatures}}
	for _, fv := range featureVars {
		out = append(out, struct {
			name string
			omit Features
		}{fv.name + " alone", AllFeatures &^ fv.f})
	}
	return append(out, struct {
		name string
		omit Features
	}{"all", 0})
}

// TestFeatureVerifierCost measures what each feature costs the verifier:
// every program of the TC and XDP objects loaded with no feature, each
// feature alone and every feature (processed instructions, deepest
// stack). A feature left out must be out of the verified program: with
// none, every program that carries a feature costs less than with all,
// and each feature alone costs more than none in the programs that use
// it. The table (go test -v) is the one in docs/benchmarks.md.
func TestFeatureVerifierCost(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, o := range []struct {
		object string
		load   func() (*ebpf.CollectionSpec, error)
		// uses: which programs carry which feature's code.
		uses map[Features][]string
	}{
		{"fluxvm_service", loadService, map[Features][]string{
			FeatureHA:          {"fluxvm_from_vm", "fluxvm_to_vm", "fluxvm_ns_in", "fluxvm_ns_out"},
			FeatureFlowRecords: {"fluxvm_from_vm", "fluxvm_to_vm", "fluxvm_ns_in", "fluxvm_ns_out"},
			FeatureEDT:         {"fluxvm_to_vm", "fluxvm_ns_out"},
		}},
		// XDP's HA code is two early exits to TC (fluxvm_ha_xdp_pass,
		// fluxvm_ha_xdp_hit): loaded, it ends some paths sooner, and
		// costs about as much as it saves (within 100 insns either
		// way), so only flow records are required to show.
		{"fluxvm_service_xdp", loadServiceXdp, map[Features][]string{
			FeatureFlowRecords: {"fluxvm_xdp_ns"},
		}},
	} {
		costs := map[string]map[string]verifierCost{}
		var rows []string
		for _, fl := range featureLoads() {
			costs[fl.name] = measureVerifier(t, featureSpec(o.load, fl.omit))
		}
		progs := slices.Sorted(maps.Keys(costs["all"]))
		for _, p := range progs {
			row := fmt.Sprintf("%-19s %-15s", o.object, p)
			for _, fl := range featureLoads() {
				c := costs[fl.name][p]
				row += fmt.Sprintf(" %8d/%3d", c.insns, c.stack)
			}
			rows = append(rows, row)
			if none, all := costs["none"][p], costs["all"][p]; none.insns > all.insns || none.stack > all.stack {
				t.Errorf("%s %s: no feature costs %d insns/%d bytes, more than every feature's %d/%d", o.object, p, none.insns, none.stack, all.insns, all.stack)
			}
		}
		for _, fv := range featureVars {
			for _, p := range o.uses[fv.f] {
				alone, none := costs[fv.name+" alone"][p], costs["none"][p]
				if alone.insns <= none.insns {
					t.Errorf("%s %s: %s alone verifies %d insns, no feature %d: the feature is not in the program, or a feature left out still is", o.object, p, fv.name, alone.insns, none.insns)
				}
			}
		}
		head := fmt.Sprintf("%-19s %-15s", "object", "program")
		for _, fl := range featureLoads() {
			head += fmt.Sprintf(" %12s", fl.name)
		}
		t.Logf("processed insns/stack bytes by the features loaded\n%s\n%s", head, strings.Join(rows, "\n"))
	}
}

// TestSetFeatures: the loader's checks of a feature choice.
func TestSetFeatures(t *testing.T) {
	spec, err := loadService()
	if err != nil {
		t.Fatal(err)
	}
	if err := setFeatures(spec, Options{OmitFeatures: 1 << 20}, "TC", true); !errors.Is(err, ErrUnknownFeature) {
		t.Errorf("unknown feature bit: %v, want ErrUnknownFeature", err)
	}
	if err := setFeatures(spec, Options{OmitFeatures: FeatureHA | FeatureEDT}, "TC", true); err != nil {
		t.Fatal(err)
	}
	for _, fv := range featureVars {
		var got uint8
		if err := spec.Variables[fv.v].Get(&got); err != nil {
			t.Fatal(err)
		}
		if want := map[bool]uint8{true: 1, false: 0}[fv.f == FeatureFlowRecords]; got != want {
			t.Errorf("%s = %d, want %d", fv.v, got, want)
		}
	}
	// The compiled default is every feature on (an object loaded as is
	// behaves as before features were chosen at load).
	for _, load := range []func() (*ebpf.CollectionSpec, error){loadService, loadServiceXdp, loadServiceTierS, loadServiceXdpTierL} {
		s, err := load()
		if err != nil {
			t.Fatal(err)
		}
		for _, fv := range featureVars {
			var got uint8
			if v := s.Variables[fv.v]; v == nil || !v.Constant() || v.Get(&got) != nil || got != 1 {
				t.Errorf("object variable %s: %v, default %d: want a constant, 1", fv.v, v, got)
			}
		}
	}
	// An object without the variables (built before load-time features)
	// loads with every feature, and refuses to omit one.
	old := spec.Copy()
	for _, fv := range featureVars {
		delete(old.Variables, fv.v)
	}
	if err := setFeatures(old, Options{}, "TC", true); err != nil {
		t.Errorf("object without features, omitting none: %v", err)
	}
	if err := setFeatures(old, Options{OmitFeatures: FeatureEDT}, "TC", true); !errors.Is(err, ErrObjectMismatch) {
		t.Errorf("object without features, omitting EDT: %v, want ErrObjectMismatch", err)
	}
	if got := (FeatureHA | FeatureEDT).String(); got != "ha,edt" {
		t.Errorf("String = %q", got)
	}
	if got := Features(0).String(); got != "none" {
		t.Errorf("String(0) = %q", got)
	}
	for _, f := range []Features{0, FeatureHA, FeatureEDT | FeatureFlowRecords, AllFeatures} {
		if got, err := ParseFeatures(f.String()); err != nil || got != f {
			t.Errorf("ParseFeatures(%q) = %s, %v; want %s", f.String(), got, err, f)
		}
	}
	if got, err := ParseFeatures("all"); err != nil || got != AllFeatures {
		t.Errorf("ParseFeatures(all) = %s, %v", got, err)
	}
	if _, err := ParseFeatures("ha,l7"); !errors.Is(err, ErrUnknownFeature) {
		t.Errorf("ParseFeatures(ha,l7): %v, want ErrUnknownFeature", err)
	}
}

// TestOpenFeatures: Open sets the features in the TC and XDP objects it
// loads and reports them; a reopen with other features reloads the
// programs on the kept maps (the flows stay), and the features' data
// section is never pinned; an unknown feature is refused before
// anything changes.
func TestOpenFeatures(t *testing.T) {
	testenv.RequirePrivileged(t)
	root := filepath.Join(testenv.PinRoot(t), "service")
	open := func(omit Features) *Datapath {
		t.Helper()
		d, err := Open(Options{PinRoot: root, Tier: TierS, OmitFeatures: omit})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	loaded := func(d *Datapath, want Features) {
		t.Helper()
		if got := d.Status().Features; got != want {
			t.Errorf("Status.Features = %s, want %s", got, want)
		}
		for what, c := range map[string]*ebpf.Collection{"TC": d.coll, "XDP": d.xcoll} {
			for _, fv := range featureVars {
				var v uint8
				if err := c.Variables[fv.v].Get(&v); err != nil {
					t.Fatalf("%s %s: %v", what, fv.v, err)
				}
				if (v == 1) != want.Has(fv.f) {
					t.Errorf("%s object: %s = %d in the loaded program, want features %s", what, fv.v, v, want)
				}
			}
		}
		pins, err := os.ReadDir(filepath.Join(root, "maps"))
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pins {
			if !strings.HasPrefix(p.Name(), "fluxvm_") {
				t.Errorf("pin %s: only the maps are pinned, not the load's data sections", p.Name())
			}
		}
	}
	d := open(FeatureHA | FeatureEDT)
	loaded(d, FeatureFlowRecords)
	putCT(t, d, 10)
	// A setting the programs cannot honour is refused, not ignored: HA
	// switched on without FeatureHA. Flow records, loaded, may be.
	if err := d.UpdateMeta(func(m *Meta) { m.Flags |= MetaFlagHA; m.TimeoutUdpS = 7 }); !errors.Is(err, ErrFeatureNotLoaded) {
		t.Errorf("HA flag without FeatureHA: %v, want ErrFeatureNotLoaded", err)
	}
	if m, err := d.ReadMeta(); err != nil || m.Flags&MetaFlagHA != 0 || m.TimeoutUdpS == 7 {
		t.Errorf("meta after the refused update: %+v, %v; want it unchanged", m, err)
	}
	if err := d.UpdateMeta(func(m *Meta) { m.FlowSampleRate = 5 }); err != nil {
		t.Errorf("flow sample rate with flow records loaded: %v", err)
	}
	d.Close()

	d = open(0)
	loaded(d, AllFeatures)
	st := d.Status()
	if st.Reloaded || st.TierChanged || !slices.Contains(st.KeptMaps, "fluxvm_fct4") || slices.Contains(st.NewMaps, ".rodata") {
		t.Errorf("reopen with other features: %+v, want the maps kept", st)
	}
	if n := count(t, d.Maps().FluxvmFct4); n != 10 {
		t.Errorf("conntrack entries after the reopen: %d, want 10", n)
	}
	d.Close()

	if d, err := Open(Options{PinRoot: root, Tier: TierS, OmitFeatures: 1 << 9}); !errors.Is(err, ErrUnknownFeature) {
		if d != nil {
			d.Close()
		}
		t.Fatalf("unknown feature: %v, want ErrUnknownFeature", err)
	}
	d = open(AllFeatures)
	loaded(d, 0)
	// The rate carried over from the earlier start may stay, or go.
	if err := d.UpdateMeta(func(m *Meta) { m.TimeoutUdpS = 9 }); err != nil {
		t.Errorf("an update keeping the carried-over rate: %v", err)
	}
	if err := d.UpdateMeta(func(m *Meta) { m.FlowSampleRate = 0 }); err != nil {
		t.Errorf("flow records off: %v", err)
	}
	if err := d.UpdateMeta(func(m *Meta) { m.FlowSampleRate = 1 }); !errors.Is(err, ErrFeatureNotLoaded) {
		t.Errorf("flow records on again without FeatureFlowRecords: %v, want ErrFeatureNotLoaded", err)
	}
	if n := count(t, d.Maps().FluxvmFct4); n != 10 {
		t.Errorf("conntrack entries after the refused open and a reopen: %d, want 10", n)
	}
}

// benchOmit applies the features named by environment variable env
// (ParseFeatures: "all", "ha,edt", ...) to spec as omitted, for
// BenchmarkDatapath: FLUXVM_BENCH_OMIT for this object's harness,
// FLUXVM_BENCH_BASELINE_OMIT for the baseline's (which may be the same
// object: FLUXVM_BENCH_BASELINE=bpf/fluxvm_service_bpfel.o), so that one
// run measures what the features cost a packet while loaded and switched
// off (the benchmark's meta map turns none on).
func benchOmit(b testing.TB, env string, spec *ebpf.CollectionSpec) *ebpf.CollectionSpec {
	b.Helper()
	s := os.Getenv(env)
	if s == "" {
		return spec
	}
	omit, err := ParseFeatures(s)
	if err != nil {
		b.Fatalf("%s: %v", env, err)
	}
	if err := setFeatures(spec, Options{OmitFeatures: omit}, env, true); err != nil {
		b.Fatalf("%s: %v", env, err)
	}
	b.Logf("%s: features loaded %s", env, AllFeatures&^omit)
	return spec
}

// TestFeaturesAfterRebuild: a GrowFlowMaps and a CompactFlowMaps reload
// the programs with the features Open loaded (HA omitted stays omitted),
// and each collection's data section is the one its programs use (not the
// previous load's).
func TestFeaturesAfterRebuild(t *testing.T) {
	testenv.RequirePrivileged(t)
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS, OmitFeatures: FeatureHA, Sizes: Sizes{CT4: TokenFlowEntries}})
	putCT(t, d, 100)
	check := func(when string) {
		t.Helper()
		for what, c := range map[string]*ebpf.Collection{"TC": d.coll, "XDP": d.xcoll} {
			ro := c.Maps[".rodata"]
			if ro == nil {
				t.Fatalf("%s: %s object has no .rodata", when, what)
			}
			info, err := ro.Info()
			if err != nil {
				t.Fatal(err)
			}
			roID, _ := info.ID()
			for name, p := range c.Programs {
				pi, err := p.Info()
				if err != nil {
					t.Fatal(err)
				}
				ids, _ := pi.MapIDs()
				if !slices.Contains(ids, roID) {
					t.Errorf("%s: %s program %s does not use its collection's .rodata (map %d; it uses %v)", when, what, name, roID, ids)
				}
			}
			for _, fv := range featureVars {
				var v uint8
				if err := c.Variables[fv.v].Get(&v); err != nil {
					t.Fatalf("%s: %s %s: %v", when, what, fv.v, err)
				}
				if (v == 1) == (fv.f == FeatureHA) {
					t.Errorf("%s: %s object: %s = %d, want HA omitted, the rest loaded", when, what, fv.v, v)
				}
			}
		}
		if got := d.Status().Features; got != AllFeatures&^FeatureHA {
			t.Errorf("%s: Status.Features = %s", when, got)
		}
	}
	check("open")
	// A rebuild replaces handles one for one: the old loads' data
	// sections and the side objects' clones of the rebuilt maps go.
	fds := testenv.BPFHandles(t)
	if res, err := d.GrowFlowMaps(map[string]uint32{"fluxvm_fct4": 0}, nil); err != nil || !res.Switched {
		t.Fatalf("grow: %+v, %v", res, err)
	}
	check("after GrowFlowMaps")
	if n := testenv.BPFHandles(t); n != fds {
		t.Errorf("after GrowFlowMaps: %d BPF handles open, %d before", n, fds)
	}
	if res, err := d.CompactFlowMaps(CompactOptions{Keep: map[string]int{"fluxvm_fct4": 50}}); err != nil || !res.Switched {
		t.Fatalf("compact: %+v, %v", res, err)
	}
	check("after CompactFlowMaps")
	if n := testenv.BPFHandles(t); n != fds {
		t.Errorf("after CompactFlowMaps: %d BPF handles open, %d before", n, fds)
	}
	// The HA flag still does nothing the programs would act on: refused.
	if err := d.UpdateMeta(func(m *Meta) { m.Flags |= MetaFlagHA }); !errors.Is(err, ErrFeatureNotLoaded) {
		t.Errorf("HA flag after the rebuilds: %v, want ErrFeatureNotLoaded", err)
	}
}

// TestOldSideObjectFeatures: an XDP object in ObjectDir built before
// load-time features (no feature variables: every feature in its code)
// loads while no feature is omitted, and is refused (ErrObjectMismatch)
// when one is, rather than run every feature while Status.Features says
// some are left out. The socket LB object declares none: it loads either
// way.
func TestOldSideObjectFeatures(t *testing.T) {
	testenv.RequirePrivileged(t)
	objs := t.TempDir()
	for name, src := range map[string]string{ObjectName(TierS): "fluxvm_service_tier_s_bpfel.o", XDPObjectName(TierS): "fluxvm_service_xdp_tier_s_bpfel.o"} {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if name == XDPObjectName(TierS) {
			// The same code, its feature variables renamed away (same
			// length: the ELF and BTF string tables keep their layout).
			n := bytes.Count(b, []byte("fluxvm_feature_"))
			if n == 0 {
				t.Fatal("XDP object names no feature variable")
			}
			b = bytes.ReplaceAll(b, []byte("fluxvm_feature_"), []byte("fluxvm_featurX_"))
		}
		if err := os.WriteFile(filepath.Join(objs, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		omit Features
		err  bool
	}{
		{omit: 0},
		{omit: FeatureHA, err: true},
		{omit: AllFeatures, err: true},
	} {
		root := filepath.Join(testenv.PinRoot(t), "service")
		d, err := Open(Options{PinRoot: root, Tier: TierS, ObjectDir: objs, OmitFeatures: tc.omit})
		if tc.err {
			if !errors.Is(err, ErrObjectMismatch) {
				if d != nil {
					d.Close()
				}
				t.Errorf("omit %s with a featureless XDP object: %v, want ErrObjectMismatch", tc.omit, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("omit %s with a featureless XDP object: %v", tc.omit, err)
		}
		if got := d.Status().Features; got != AllFeatures {
			t.Errorf("Status.Features = %s, want all", got)
		}
		d.Close()
	}
}
