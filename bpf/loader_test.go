package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

func openT(t *testing.T, opts Options) *Datapath {
	t.Helper()
	d, err := Open(opts)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func ctKey(i int) Tuple4 {
	return Tuple4{Saddr: uint32(i) + 1, Daddr: 0x0a60000a, Sport: Port(uint16(1000 + i%60000)), Dport: Port(80), Proto: ipTCP}
}

func putCT(t *testing.T, d *Datapath, n int) {
	t.Helper()
	m := d.Maps().FluxvmFct4
	keys := make([]Tuple4, n)
	vals := make([]CTValue, n)
	for i := range keys {
		keys[i] = ctKey(i)
		vals[i] = CTValue{ServiceId: 1, BackendId: uint32(i%3 + 1), State: uint8(CTTCPEstablished)}
	}
	if _, err := m.BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}
}

func count(t *testing.T, m *ebpf.Map) int {
	t.Helper()
	n, err := countEntries(m)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestOpenFreshAndRestart(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS, HashSeed: 0xfeed})
	st := d.Status()
	if !st.Created || st.SchemaRebuilt || st.Reloaded || st.TierChanged || len(st.KeptMaps) != 0 ||
		st.HashSeed != 0xfeed || st.HashSeedChanged {
		t.Errorf("fresh open status %+v", st)
	}
	meta, err := d.ReadMeta()
	if err != nil {
		t.Fatal(err)
	}
	if meta.SchemaVersion != SchemaVersion || meta.ProgramGeneration != ProgramGeneration || Tier(meta.Tier) != TierS || meta.HashSeed != 0xfeed {
		t.Errorf("meta %+v", meta)
	}
	for name := range d.Spec().Maps {
		if dataSection(name) {
			continue // .rodata (load-time features) belongs to the load, not the pins
		}
		if _, err := os.Stat(filepath.Join(root, "maps", name)); err != nil {
			t.Errorf("map %s not pinned: %v", name, err)
		}
	}
	putCT(t, d, 10)
	svc := SvcKey4{Vip: 0x0a60000a, Port: Port(80), Proto: ipTCP}
	if err := d.PutFrontend4(svc, SvcValue{ServiceId: 1}); err != nil {
		t.Fatal(err)
	}
	if err := d.UpdateMeta(func(m *Meta) { m.TimeoutUdpS = 99; m.HashSeed = 1 }); err != nil {
		t.Fatal(err)
	}
	d.Close()

	// A restart adopts every map: flows, services and timeouts. The
	// configured seed replaces the one in the pins (new flows follow it;
	// conntrack keeps the established ones), and Status says so.
	d = openT(t, Options{PinRoot: root, Tier: TierS, HashSeed: 0xbad})
	st = d.Status()
	if st.Created || st.SchemaRebuilt || st.Reloaded || st.TierChanged || len(st.NewMaps) != 0 {
		t.Errorf("restart status %+v", st)
	}
	if st.HashSeed != 0xbad || !st.HashSeedChanged || st.PreviousHashSeed != 0xfeed {
		t.Errorf("restart with another seed: hash seed %#x, changed %t, previous %#x; want 0xbad, true, 0xfeed",
			st.HashSeed, st.HashSeedChanged, st.PreviousHashSeed)
	}
	if n := count(t, d.Maps().FluxvmFct4); n != 10 {
		t.Errorf("conntrack entries after restart: %d, want 10", n)
	}
	var v SvcValue
	if err := d.Maps().FluxvmSvc4.Lookup(svc, &v); err != nil {
		t.Errorf("service lost across restart: %v", err)
	}
	meta, _ = d.ReadMeta()
	if meta.HashSeed != 0xbad || meta.TimeoutUdpS != 99 {
		t.Errorf("meta after restart %+v (want the configured seed and the timeouts UpdateMeta set)", meta)
	}
	d.Close()

	// The same seed again: nothing changed. Seed 0 is a seed like any
	// other, not "pick one at random".
	for _, o := range []struct {
		seed, prev uint64
		changed    bool
	}{{0xbad, 0, false}, {0, 0xbad, true}, {0, 0, false}} {
		d = openT(t, Options{PinRoot: root, Tier: TierS, HashSeed: o.seed})
		st = d.Status()
		meta, _ = d.ReadMeta()
		if meta.HashSeed != o.seed || st.HashSeed != o.seed || st.HashSeedChanged != o.changed || st.PreviousHashSeed != o.prev {
			t.Errorf("open with seed %#x: meta seed %#x, status %#x, changed %t, previous %#x; want changed %t, previous %#x",
				o.seed, meta.HashSeed, st.HashSeed, st.HashSeedChanged, st.PreviousHashSeed, o.changed, o.prev)
		}
		d.Close()
	}
}

func TestOpenSchemaMismatchRebuildsOnlyOurRoot(t *testing.T) {
	base := testenv.PinRoot(t)
	root := filepath.Join(base, "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS})
	putCT(t, d, 5)
	if err := d.Maps().FluxvmMeta.Put(uint32(0), Meta{SchemaVersion: 3, ProgramGeneration: ProgramGeneration, Tier: uint32(TierS)}); err != nil {
		t.Fatal(err)
	}
	d.Close()
	// Neighbours that are not ours: a pin beside the root, a directory
	// inside it.
	other, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := other.Pin(filepath.Join(base, "someone_else")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(root, "theirs"), 0o700); err != nil {
		t.Fatal(err)
	}

	d = openT(t, Options{PinRoot: root, Tier: TierS})
	st := d.Status()
	if !st.SchemaRebuilt || st.PreviousSchema != 3 || len(st.KeptMaps) != 0 {
		t.Errorf("status %+v, want a rebuild from schema 3", st)
	}
	if n := count(t, d.Maps().FluxvmFct4); n != 0 {
		t.Errorf("%d conntrack entries survived a schema change", n)
	}
	for _, p := range []string{filepath.Join(base, "someone_else"), filepath.Join(root, "theirs")} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s was touched: %v", p, err)
		}
	}
	os.Remove(filepath.Join(root, "theirs"))
}

func TestOpenGenerationBumpKeepsLifecycleMaps(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS})
	putCT(t, d, 7)
	if err := d.Maps().FluxvmNat4.Put(Tuple4{Saddr: 1, Proto: ipTCP}, NATValue{ServiceId: 1}); err != nil {
		t.Fatal(err)
	}
	if err := d.Maps().FluxvmSguard.Put(uint32(1), Guard{State: GuardOpen}); err != nil {
		t.Fatal(err)
	}
	// Flow records 1..41 were opened; conntrack keeps a flow's record id.
	const seq = 41
	if err := d.Maps().FluxvmFlowSeq.Put(uint32(0), uint64(seq)); err != nil {
		t.Fatal(err)
	}
	meta, _ := d.ReadMeta()
	meta.ProgramGeneration = ProgramGeneration - 1 + 100 // another generation
	if err := d.Maps().FluxvmMeta.Put(uint32(0), meta); err != nil {
		t.Fatal(err)
	}
	d.Close()

	d = openT(t, Options{PinRoot: root, Tier: TierS})
	st := d.Status()
	if !st.Reloaded || st.PreviousGeneration != ProgramGeneration+99 {
		t.Errorf("status %+v, want a generation reload", st)
	}
	for _, name := range LifecycleMaps {
		if !slices.Contains(st.KeptMaps, name) {
			t.Errorf("lifecycle map %s not kept (kept %v)", name, st.KeptMaps)
		}
	}
	if n := count(t, d.Maps().FluxvmFct4); n != 7 {
		t.Errorf("conntrack entries: %d, want 7", n)
	}
	if n := count(t, d.Maps().FluxvmNat4); n != 1 {
		t.Errorf("nat entries: %d, want 1", n)
	}
	var g Guard
	if err := d.Maps().FluxvmSguard.Lookup(uint32(1), &g); err != nil || g.State == GuardOpen {
		t.Errorf("guard %+v (%v): a reload must leave guards closed until reprogrammed", g, err)
	}
	if meta, _ := d.ReadMeta(); meta.ProgramGeneration != ProgramGeneration {
		t.Errorf("meta generation %d", meta.ProgramGeneration)
	}
	// The record sequence is recreated with the other maps, past the old
	// one: no new record takes an id a kept conntrack entry holds.
	if slices.Contains(st.KeptMaps, "fluxvm_flow_seq") {
		t.Fatalf("fluxvm_flow_seq kept over a reload: %v", st.KeptMaps)
	}
	var got uint64
	if err := d.Maps().FluxvmFlowSeq.Lookup(uint32(0), &got); err != nil {
		t.Fatal(err)
	}
	if got != seq+flowSeqSkip {
		t.Errorf("flow record sequence after the reload %d, want %d", got, seq+flowSeqSkip)
	}
	// A plain restart keeps it as it is.
	d.Close()
	d = openT(t, Options{PinRoot: root, Tier: TierS})
	if err := d.Maps().FluxvmFlowSeq.Lookup(uint32(0), &got); err != nil || got != seq+flowSeqSkip {
		t.Errorf("flow record sequence after a restart %d (%v), want %d", got, err, seq+flowSeqSkip)
	}
}

func TestOpenTierChangeMigrates(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS})
	putCT(t, d, 1000)
	d.Close()

	d = openT(t, Options{PinRoot: root, Tier: TierM})
	st := d.Status()
	if !st.TierChanged || st.PreviousTier != TierS || st.Migrated != 1000 || st.NotMigrated != 0 {
		t.Errorf("S->M status %+v, want 1000 migrated", st)
	}
	if n := count(t, d.Maps().FluxvmFct4); n != 1000 {
		t.Errorf("entries after S->M: %d", n)
	}
	if got := d.Maps().FluxvmFct4.MaxEntries(); got != 262144 {
		t.Errorf("tier M conntrack capacity %d", got)
	}
	// Back down with more flows than tier S holds.
	putCT(t, d, 70000)
	d.Close()
	d = openT(t, Options{PinRoot: root, Tier: TierS})
	st = d.Status()
	n := count(t, d.Maps().FluxvmFct4)
	if !st.TierChanged || st.Migrated != n || st.Migrated+st.NotMigrated != 70000 || st.NotMigrated == 0 {
		t.Errorf("M->S status %+v with %d entries present", st, n)
	}
	t.Logf("M->S: migrated %d, did not fit %d", st.Migrated, st.NotMigrated)
}

func TestOpenRejectsBadRoots(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, root := range []string{"relative/root", "/sys/fs/bpf", t.TempDir()} {
		if _, err := Open(Options{PinRoot: root}); !errors.Is(err, ErrPinRoot) {
			t.Errorf("Open(%q) = %v, want ErrPinRoot", root, err)
		}
	}
	if _, err := Open(Options{PinRoot: "/sys/fs/bpf/x", AttachMode: "xdp"}); !errors.Is(err, ErrAttachMode) {
		t.Errorf("bad attach mode: %v", err)
	}
}

// tcxPrograms lists the program IDs attached by TCX on a hook.
func tcxPrograms(t *testing.T, index int, at ebpf.AttachType) []ebpf.ProgramID {
	t.Helper()
	res, err := link.QueryPrograms(link.QueryOptions{Target: index, Attach: at})
	if err != nil {
		t.Fatal(err)
	}
	var ids []ebpf.ProgramID
	for _, p := range res.Programs {
		ids = append(ids, p.ID)
	}
	return ids
}

func TestAttachTCX(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, rx, err := testenv.VethPair("fvtx", "fvrx")
		if err != nil {
			t.Fatal(err)
		}
		idx := rx.Attrs().Index
		d := openT(t, Options{PinRoot: root, Tier: TierS})
		for i := range 2 { // idempotent; the second time ours is reused
			for _, h := range []Hook{HookFromVM, HookToVM} {
				a, err := d.Attach(Interface{Name: "fvrx"}, h)
				if err != nil {
					t.Fatal(err)
				}
				if a.Mode != AttachTCX || a.Ifindex != idx || a.Ifname != "fvrx" || a.Reused != (i == 1) {
					t.Errorf("attachment %d: %+v", i, a)
				}
			}
		}
		if n := len(tcxPrograms(t, idx, ebpf.AttachTCXIngress)); n != 1 {
			t.Fatalf("%d ingress programs after attaching twice, want 1", n)
		}
		as, err := d.Attachments()
		if err != nil || len(as) != 2 {
			t.Fatalf("attachments %+v, %v", as, err)
		}

		// A process exit leaves the programs attached; a restart moves
		// the links to its new programs.
		d.Close()
		before := tcxPrograms(t, idx, ebpf.AttachTCXIngress)
		if len(before) != 1 {
			t.Fatalf("program gone after Close: %v", before)
		}
		d = openT(t, Options{PinRoot: root, Tier: TierS})
		if got := d.Status().Links; len(got) != 2 {
			t.Errorf("links updated on reopen: %v", got)
		}
		after := tcxPrograms(t, idx, ebpf.AttachTCXIngress)
		id := progID(t, d.Programs().FluxvmFromVm)
		if len(after) != 1 || after[0] != id {
			t.Errorf("ingress runs %v, want the reopened program %d", after, id)
		}

		if err := d.Detach(Interface{Index: idx}, HookFromVM); err != nil {
			t.Fatal(err)
		}
		if n := len(tcxPrograms(t, idx, ebpf.AttachTCXIngress)); n != 0 {
			t.Errorf("%d ingress programs after detach", n)
		}
		if err := d.Detach(Interface{Index: idx}, HookFromVM); !errors.Is(err, ErrNotAttached) {
			t.Errorf("second detach: %v, want ErrNotAttached", err)
		}
		if err := d.Remove(); err != nil {
			t.Fatal(err)
		}
		if n := len(tcxPrograms(t, idx, ebpf.AttachTCXEgress)); n != 0 {
			t.Errorf("%d egress programs after Remove", n)
		}
		if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pin root still there after Remove: %v", err)
		}
	})
}

func TestAttachClsBPF(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, rx, err := testenv.VethPair("fvtx", "fvrx")
		if err != nil {
			t.Fatal(err)
		}
		d := openT(t, Options{PinRoot: root, Tier: TierS, AttachMode: AttachClsBPF})
		for i := range 2 {
			a, err := d.Attach(Interface{Index: rx.Attrs().Index}, HookFromVM)
			if err != nil {
				t.Fatal(err)
			}
			if a.Mode != AttachClsBPF || a.Reused != (i == 1) {
				t.Errorf("attachment %d: %+v", i, a)
			}
		}
		fs, err := netlink.FilterList(rx, netlink.HANDLE_MIN_INGRESS)
		if err != nil || len(fs) != 1 {
			t.Fatalf("filters %v, %v; want exactly ours", fs, err)
		}
		if name := fs[0].(*netlink.BpfFilter).Name; name != "fluxvm:fluxvm_from_vm" {
			t.Errorf("filter name %q", name)
		}
		// Our filter of the other hook of that direction (a restart that
		// turned the VM edge into a north-south interface) is replaced,
		// and the attachment is a new one, not a reuse: its rollback
		// must detach it. (It used to say reused.)
		a, err := d.Attach(Interface{Index: rx.Attrs().Index}, HookNSIn)
		if err != nil {
			t.Fatal(err)
		}
		if a.Reused {
			t.Errorf("ns_in over our from_vm filter: %+v, want not reused", a)
		}
		if fs, err := netlink.FilterList(rx, netlink.HANDLE_MIN_INGRESS); err != nil || len(fs) != 1 || fs[0].(*netlink.BpfFilter).Name != "fluxvm:fluxvm_ns_in" {
			t.Errorf("filters after ns_in over from_vm: %v, %v; want ours of ns_in alone", fs, err)
		}
		if a, err := d.Attach(Interface{Index: rx.Attrs().Index}, HookNSIn); err != nil || !a.Reused {
			t.Errorf("ns_in again: %+v, %v; want reused", a, err)
		}
		if err := d.Detach(Interface{Index: rx.Attrs().Index}, HookNSIn); err != nil {
			t.Fatal(err)
		}

		// Someone else's filter at priority 1 is never replaced or removed.
		foreign := &netlink.BpfFilter{
			FilterAttrs: netlink.FilterAttrs{LinkIndex: rx.Attrs().Index, Parent: netlink.HANDLE_MIN_EGRESS,
				Handle: netlink.MakeHandle(0, 1), Protocol: unix.ETH_P_ALL, Priority: 1},
			Fd: d.Programs().FluxvmToVm.FD(), Name: "policy", DirectAction: true,
		}
		if err := netlink.FilterAdd(foreign); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Attach(Interface{Index: rx.Attrs().Index}, HookToVM); !errors.Is(err, ErrForeignProgram) {
			t.Errorf("attach over a foreign filter: %v, want ErrForeignProgram", err)
		}
		if err := d.Detach(Interface{Index: rx.Attrs().Index}, HookToVM); !errors.Is(err, ErrForeignProgram) {
			t.Errorf("detach of a foreign filter: %v, want ErrForeignProgram", err)
		}
		if fs, _ := netlink.FilterList(rx, netlink.HANDLE_MIN_EGRESS); len(fs) != 1 {
			t.Errorf("foreign filter disturbed: %v", fs)
		}
	})
}

// TestAttachClsBPFStaged: a staged Open (a restart) that finds our
// cls_bpf filter of a hook leaves it running the old program until
// Activate replaces it, as TCX links are switched only then; a staged
// Open that is never activated (a restart that fails) leaves the old
// program in place. The filter used to be replaced at Attach, so a
// failed restart left the new programs running.
func TestAttachClsBPFStaged(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, rx, err := testenv.VethPair("fvsx", "fvsrx")
		if err != nil {
			t.Fatal(err)
		}
		ifc := Interface{Index: rx.Attrs().Index}
		running := func() int {
			t.Helper()
			fs, err := netlink.FilterList(rx, netlink.HANDLE_MIN_INGRESS)
			if err != nil || len(fs) != 1 {
				t.Fatalf("filters %v, %v; want exactly ours", fs, err)
			}
			return fs[0].(*netlink.BpfFilter).Id
		}
		progID := func(d *Datapath) int {
			info, err := d.Programs().FluxvmFromVm.Info()
			if err != nil {
				t.Fatal(err)
			}
			id, _ := info.ID()
			return int(id)
		}
		opts := Options{PinRoot: root, Tier: TierS, AttachMode: AttachClsBPF}
		d := openT(t, opts)
		if _, err := d.Attach(ifc, HookFromVM); err != nil {
			t.Fatal(err)
		}
		first := progID(d)
		if got := running(); got != first {
			t.Fatalf("filter runs program %d, want %d", got, first)
		}
		d.Close()

		opts.Staged = true
		for _, activate := range []bool{false, true} {
			d := openT(t, opts)
			a, err := d.Attach(ifc, HookFromVM)
			if err != nil || !a.Reused {
				t.Fatalf("staged attach: %+v, %v; want reused", a, err)
			}
			if got := running(); got != first {
				t.Errorf("after a staged Attach the filter runs program %d, want the old one (%d) until Activate", got, first)
			}
			if activate {
				if err := d.Activate(); err != nil {
					t.Fatal(err)
				}
				if got, want := running(), progID(d); got != want || got == first {
					t.Errorf("after Activate the filter runs program %d, want the new one (%d)", got, want)
				}
			}
			d.Close()
		}
	})
}

// TestOpenAfterInterfaceDeleted: an interface deleted while no process ran
// leaves a severed TCX link pinned. The next Open must not fail on it: it
// removes the pin, says so, and updates the links that are still alive.
func TestOpenAfterInterfaceDeleted(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		gone, _, err := testenv.VethPair("fvgone", "fvgone-p")
		if err != nil {
			t.Fatal(err)
		}
		_, stay, err := testenv.VethPair("fvstay-p", "fvstay")
		if err != nil {
			t.Fatal(err)
		}
		d := openT(t, Options{PinRoot: root, Tier: TierS})
		for _, name := range []string{"fvgone", "fvstay"} {
			for _, h := range []Hook{HookFromVM, HookToVM} {
				if _, err := d.Attach(Interface{Name: name}, h); err != nil {
					t.Fatal(err)
				}
			}
		}
		d.Close()
		if err := netlink.LinkDel(gone); err != nil {
			t.Fatal(err)
		}

		d, err = Open(Options{PinRoot: root, Tier: TierS})
		if err != nil {
			t.Fatalf("open after an interface was deleted: %v", err)
		}
		t.Cleanup(func() { d.Close() })
		st := d.Status()
		want := []string{
			fmt.Sprintf("tcx_%d_from_vm", gone.Attrs().Index),
			fmt.Sprintf("tcx_%d_to_vm", gone.Attrs().Index),
		}
		if !slices.Equal(st.SeveredLinks, want) {
			t.Errorf("severed links %v, want %v", st.SeveredLinks, want)
		}
		if len(st.Links) != 2 {
			t.Errorf("updated links %v, want the 2 of fvstay", st.Links)
		}
		for _, name := range want {
			if _, err := os.Stat(filepath.Join(linkDir(root), name)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("pin %s still there: %v", name, err)
			}
		}
		info, _ := d.Programs().FluxvmFromVm.Info()
		id, _ := info.ID()
		if got := tcxPrograms(t, stay.Attrs().Index, ebpf.AttachTCXIngress); len(got) != 1 || got[0] != id {
			t.Errorf("fvstay ingress runs %v, want the reopened program %d", got, id)
		}
	})
}

// TestAttachMissingInterface: an interface the namespace does not have is
// named in the error, which matches ErrNoInterface, by name or by index;
// so is an index that names another interface than the name given.
func TestAttachMissingInterface(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, rx, err := testenv.VethPair("fvtx", "fvrx")
		if err != nil {
			t.Fatal(err)
		}
		d := openT(t, Options{PinRoot: root, Tier: TierS})
		for _, c := range []struct {
			ifc  Interface
			want string
		}{
			{Interface{Name: "nope0"}, `bpf: interface "nope0": no such network interface`},
			{Interface{Index: 99999}, `bpf: interface index 99999: no such network interface`},
			{Interface{Name: "nope0", Index: rx.Attrs().Index}, `is "fvrx", not "nope0"`},
			{Interface{}, "neither a name nor an index"},
		} {
			_, err := d.Attach(c.ifc, HookFromVM)
			if !errors.Is(err, ErrNoInterface) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Attach(%+v): %v; want ErrNoInterface, saying %q", c.ifc, err, c.want)
			}
			if err := d.Detach(c.ifc, HookFromVM); !errors.Is(err, ErrNoInterface) {
				t.Errorf("Detach(%+v): %v; want ErrNoInterface", c.ifc, err)
			}
		}
		if as, err := d.Attachments(); err != nil || len(as) != 0 {
			t.Errorf("attachments %+v, %v; want none", as, err)
		}
	})
}

// TestFailedOpenRemovesItsDirectories: an Open that fails after making
// the pin root (here on a corrupt XDP object in ObjectDir) removes the
// directories it made, up to the first that was there, and a directory
// that was there stays.
func TestFailedOpenRemovesItsDirectories(t *testing.T) {
	base := testenv.PinRoot(t)
	objs := t.TempDir()
	tc, err := os.ReadFile("fluxvm_service_tier_s_bpfel.o")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(objs, ObjectName(TierS)), tc, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(objs, XDPObjectName(TierS)), []byte("not an ELF object"), 0o600); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(base, "node", "service")
	if d, err := Open(Options{PinRoot: root, Tier: TierS, ObjectDir: objs}); err == nil {
		d.Remove()
		t.Fatal("Open succeeded with a corrupt XDP object")
	} else if !strings.Contains(err.Error(), XDPObjectName(TierS)) {
		t.Errorf("Open: %v, want the XDP object's error", err)
	}
	if left, err := os.ReadDir(base); err != nil || len(left) != 0 {
		t.Errorf("left under %s by the failed Open: %v (%v)", base, left, err)
	}
}
