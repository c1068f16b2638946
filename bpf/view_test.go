package bpf

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestOpenView: a second tool reads the pinned maps of a running datapath
// (here after its process closed, as a CLI would find it) without loading
// programs or touching pins and attachments, and cannot write.
func TestOpenView(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	if _, err := OpenView(root); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("view of an empty root: %v, want os.ErrNotExist", err)
	}
	testenv.InNetNS(t, func() {
		_, rx, err := testenv.VethPair("fvtx", "fvrx")
		if err != nil {
			t.Fatal(err)
		}
		d := openT(t, Options{PinRoot: root, Tier: TierS, HashSeed: 0xabc})
		if _, err := d.Attach(Interface{Index: rx.Attrs().Index}, HookFromVM); err != nil {
			t.Fatal(err)
		}
		putCT(t, d, 100)
		prog := progID(t, d.Programs().FluxvmFromVm)
		ct := mapID(t, d.Maps().FluxvmFct4)

		v, err := OpenView(root)
		if err != nil {
			t.Fatal(err)
		}
		defer v.Close()
		if n := count(t, v.Maps().FluxvmFct4); n != 100 {
			t.Errorf("the view sees %d conntrack entries, want 100", n)
		}
		if got := mapID(t, v.Maps().FluxvmFct4); got != ct {
			t.Errorf("the view reads map %d, want the datapath's %d", got, ct)
		}
		if m := v.Meta(); m.HashSeed != 0xabc || Tier(m.Tier) != TierS || m.SchemaVersion != SchemaVersion {
			t.Errorf("meta %+v", m)
		}
		if err := v.Maps().FluxvmFct4.Put(ctKey(5000), CTValue{ServiceId: 1}); err == nil {
			t.Error("a write through the view succeeded")
		}
		// Maglev tables: a copy, never a handle (inner maps open
		// writable).
		if v.Maps().FluxvmMaglev != nil {
			t.Error("the view hands out the Maglev outer map")
		}
		if tbl, err := v.MaglevTable(3); err != nil || tbl != nil {
			t.Errorf("table of a service without one: %v, %v", tbl, err)
		}
		ms := d.Spec().Maps["fluxvm_maglev"].InnerMap.Copy()
		ms.MaxEntries = 251
		inner, err := ebpf.NewMap(ms)
		if err != nil {
			t.Fatal(err)
		}
		defer inner.Close()
		if err := inner.Put(uint32(250), uint32(9)); err != nil {
			t.Fatal(err)
		}
		if err := d.Maps().FluxvmMaglev.Put(uint32(3), inner); err != nil {
			t.Fatal(err)
		}
		if tbl, err := v.MaglevTable(3); err != nil || len(tbl) != 251 || tbl[250] != 9 || tbl[0] != 0 {
			t.Errorf("the view's copy of the table: %d slots, %v", len(tbl), err)
		}
		if got := tcxPrograms(t, rx.Attrs().Index, ebpf.AttachTCXIngress); len(got) != 1 || got[0] != prog {
			t.Errorf("the hook runs %v after the view opened, want %d", got, prog)
		}
		if err := d.Remove(); err != nil {
			t.Fatal(err)
		}
	})
}
