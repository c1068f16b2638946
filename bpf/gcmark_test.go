package bpf

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestGCMark writes the conntrack GC's mark and reads it back through
// the pins after a restart, a program-generation reload, a tier change
// and a compaction (each recreates maps of the object's, never this
// one); a pin of another layout is refused by GCMark and replaced by
// SetGCMark; Remove takes it with the pin root.
func TestGCMark(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS})
	if _, err := d.GCMark(); !errors.Is(err, ErrNoGCMark) {
		t.Fatalf("fresh pins: %v, want ErrNoGCMark", err)
	}
	now, err := Now()
	if err != nil {
		t.Fatal(err)
	}
	want := GCMark{Last: uint64(now), Period: 800e6, Base: 400e6}
	if err := d.SetGCMark(want); err != nil {
		t.Fatal(err)
	}
	check := func(step string, d *Datapath) {
		t.Helper()
		if got, err := d.GCMark(); err != nil || got != want {
			t.Errorf("%s: %+v, %v; want %+v", step, got, err, want)
		}
	}
	check("written", d)
	want.Last += 1e6
	if err := d.SetGCMark(want); err != nil {
		t.Fatal(err)
	}
	check("rewritten", d)

	d.Close()
	if _, err := d.GCMark(); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: %v, want ErrClosed", err)
	}
	if err := d.SetGCMark(want); !errors.Is(err, ErrClosed) {
		t.Errorf("set after Close: %v, want ErrClosed", err)
	}
	d = openT(t, Options{PinRoot: root, Tier: TierS})
	check("restart", d)

	meta, _ := d.ReadMeta()
	meta.ProgramGeneration = ProgramGeneration + 100
	if err := d.Maps().FluxvmMeta.Put(uint32(0), meta); err != nil {
		t.Fatal(err)
	}
	d.Close()
	d = openT(t, Options{PinRoot: root, Tier: TierS})
	if !d.Status().Reloaded {
		t.Fatalf("status %+v, want a generation reload", d.Status())
	}
	check("generation reload", d)

	d.Close()
	d = openT(t, Options{PinRoot: root, Tier: TierM})
	if !d.Status().TierChanged {
		t.Fatalf("status %+v, want a tier change", d.Status())
	}
	check("tier change", d)

	putCT(t, d, 10)
	if _, err := d.CompactFlowMaps(CompactOptions{Keep: map[string]int{"fluxvm_fct4": 5}}); err != nil {
		t.Fatal(err)
	}
	check("compaction", d)

	// A pin of another layout under the name.
	path := filepath.Join(root, "maps", GCMarkPin)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	other, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := other.Pin(path); err != nil {
		t.Fatal(err)
	}
	if _, err := d.GCMark(); !errors.Is(err, ErrObjectMismatch) {
		t.Errorf("a pin of another layout: %v, want ErrObjectMismatch", err)
	}
	if err := d.SetGCMark(want); err != nil {
		t.Fatal(err)
	}
	check("replaced", d)

	if err := d.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin root after Remove: %v", err)
	}
}
