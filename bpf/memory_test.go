package bpf

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// fdinfoMemlock reads the memlock line of the kernel's fdinfo of m
// directly: a source independent of the loader's reading through MapInfo.
func fdinfoMemlock(t testing.TB, m *ebpf.Map) uint64 {
	t.Helper()
	return testenv.FdinfoMemlock(t, m.FD())
}

// newInner creates a Maglev table from the object's template.
func newInner(t testing.TB, d *Datapath) *ebpf.Map {
	t.Helper()
	m, err := ebpf.NewMap(d.Spec().Maps[MaglevMap].InnerMap)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func mapMemory(t *testing.T, d *Datapath) MapMemory {
	t.Helper()
	mm, err := d.MapMemory()
	if err != nil {
		t.Fatal(err)
	}
	return mm
}

// TestMapMemory checks every figure against the kernel's fdinfo of the
// same map, and that Maglev tables put into the outer map count exactly.
func TestMapMemory(t *testing.T) {
	d := openT(t, Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: TierS})
	mm := mapMemory(t, d)

	if len(mm.Maps) != len(d.Spec().Maps) {
		t.Errorf("%d maps reported, the object has %d", len(mm.Maps), len(d.Spec().Maps))
	}
	var sum uint64
	for name := range d.Spec().Maps {
		want := fdinfoMemlock(t, d.Map(name))
		info, err := d.Map(name).Info()
		if err != nil {
			t.Fatal(err)
		}
		ml, _ := info.Memlock()
		// Only a map that allocates as it fills may be empty of memory.
		if got := mm.Maps[name]; got != want || got != ml || got == 0 && info.Flags&unix.BPF_F_NO_PREALLOC == 0 {
			t.Errorf("%s: %d bytes reported, fdinfo says %d, MapInfo.Memlock %d", name, got, want, ml)
		}
		sum += want
	}
	if mm.MaglevInner != (InnerMapMemory{}) || mm.Total != sum {
		t.Errorf("empty datapath: inner %+v, total %d; want none and %d", mm.MaglevInner, mm.Total, sum)
	}
	// A known size: the conntrack table of tier S holds 65,536 entries,
	// so it cannot take less than that many keys and values.
	ct := d.Maps().FluxvmFct4
	if min := uint64(ct.MaxEntries()) * uint64(ct.KeySize()+ct.ValueSize()); mm.Maps["fluxvm_fct4"] < min {
		t.Errorf("fluxvm_fct4: %d bytes, less than its %d entries' keys and values (%d)", mm.Maps["fluxvm_fct4"], ct.MaxEntries(), min)
	}

	outer := d.Map(MaglevMap)
	tables := map[uint32]*ebpf.Map{1: newInner(t, d), 5: newInner(t, d), 200: newInner(t, d)}
	var want InnerMapMemory
	for sid, m := range tables {
		if err := outer.Put(sid, m); err != nil {
			t.Fatal(err)
		}
		b := fdinfoMemlock(t, m)
		want.Count++
		want.Bytes += b
		want.LargestBytes = max(want.LargestBytes, b)
	}
	// An array of 16,381 u32 slots (values padded to 8 bytes) takes at
	// least that much.
	if min := uint64(d.Status().Capacities.MaglevSize) * 8; want.LargestBytes < min {
		t.Errorf("a Maglev table of tier S takes %d bytes by fdinfo, less than %d", want.LargestBytes, min)
	}
	// The batch read of the outer map finds what slot-by-slot lookups do.
	bs, bi, err := slotIDs(outer, true)
	if err != nil {
		t.Fatal(err)
	}
	ss, si, err := slotIDs(outer, false)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(bs, ss) || !slices.Equal(bi, si) || !slices.Equal(ss, []uint32{1, 5, 200}) {
		t.Errorf("batch read: slots %v ids %v; lookups: slots %v ids %v; want slots [1 5 200]", bs, bi, ss, si)
	}
	mm2 := mapMemory(t, d)
	if mm2.MaglevInner != want {
		t.Errorf("after 3 tables: inner %+v, want %+v", mm2.MaglevInner, want)
	}
	if mm2.Total != sum+want.Bytes {
		t.Errorf("after 3 tables: total %d, want %d", mm2.Total, sum+want.Bytes)
	}

	// A swap keeps the count; a removal lowers it by exactly one table.
	if err := outer.Put(uint32(5), newInner(t, d)); err != nil {
		t.Fatal(err)
	}
	if got := mapMemory(t, d).MaglevInner; got != want {
		t.Errorf("after a swap: inner %+v, want %+v", got, want)
	}
	if err := outer.Delete(uint32(200)); err != nil {
		t.Fatal(err)
	}
	b200 := fdinfoMemlock(t, tables[200])
	want2 := InnerMapMemory{Count: 2, Bytes: want.Bytes - b200, LargestBytes: want.LargestBytes}
	if got := mapMemory(t, d).MaglevInner; got != want2 {
		t.Errorf("after a removal: inner %+v, want %+v", got, want2)
	}
	if n := len(d.mem.inner); n != 2 {
		t.Errorf("the cache holds %d tables, the outer map 2", n)
	}

	// A table shared by two slots is one map: counted, and its bytes, once.
	if err := outer.Put(uint32(9), tables[1]); err != nil {
		t.Fatal(err)
	}
	if got := mapMemory(t, d).MaglevInner; got != want2 {
		t.Errorf("a table in two slots: inner %+v, want %+v", got, want2)
	}

	d.Close()
	if _, err := d.MapMemory(); !errors.Is(err, ErrClosed) {
		t.Errorf("MapMemory after Close: %v, want ErrClosed", err)
	}
}

// TestMapMemoryTableVanishes: a table swapped out and released between
// the read of its id and its open is not an error; the slot is read again
// and its new table counted.
func TestMapMemoryTableVanishes(t *testing.T) {
	d := openT(t, Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: TierS})
	outer := d.Map(MaglevMap)
	old, err := ebpf.NewMap(d.Spec().Maps[MaglevMap].InnerMap)
	if err != nil {
		t.Fatal(err)
	}
	if err := outer.Put(uint32(7), old); err != nil {
		t.Fatal(err)
	}
	info, err := old.Info()
	if err != nil {
		t.Fatal(err)
	}
	oldID, _ := info.ID()
	old.Close() // the outer slot holds the only reference now

	repl := newInner(t, d)
	swaps := 0
	d.afterInnerLookup = func(slot uint32) {
		if slot != 7 || swaps > 0 {
			return
		}
		swaps++
		if err := outer.Put(uint32(7), repl); err != nil {
			t.Fatal(err)
		}
		// The old table's last reference went with the swap.
		if m, err := ebpf.NewMapFromID(oldID); err == nil {
			m.Close()
			t.Fatal("the swapped-out table is still there: the test tests nothing")
		}
	}
	got := mapMemory(t, d).MaglevInner
	b := fdinfoMemlock(t, repl)
	if swaps != 1 || got != (InnerMapMemory{Count: 1, Bytes: b, LargestBytes: b}) {
		t.Errorf("%d swaps, inner %+v; want the replacement's %d bytes", swaps, got, b)
	}
}

// TestMemlockByIDGone: reading a map id that no longer exists fails with
// os.ErrNotExist, which MapMemory takes for a table swapped out.
func TestMemlockByIDGone(t *testing.T) {
	testenv.RequirePrivileged(t)
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	m.Close()
	if _, _, err := memlockByID(id); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("memlockByID of a released map: %v, want os.ErrNotExist", err)
	}
}

// BenchmarkMapMemoryInner4000 times the Maglev part of MapMemory with
// 4,000 tables of tier S (16,381 slots, 128 KiB each) in an outer array
// of 4,096 slots: "cold" reads every table (the first call, or every
// table swapped since the last), "warm" is a repeated call.
func BenchmarkMapMemoryInner4000(b *testing.B) {
	testenv.RequirePrivileged(b)
	spec, err := Spec(TierS)
	if err != nil {
		b.Fatal(err)
	}
	ospec := spec.Maps[MaglevMap].Copy()
	ospec.MaxEntries = 4096
	ospec.Pinning = ebpf.PinNone
	outer, err := ebpf.NewMap(ospec)
	if err != nil {
		b.Fatal(err)
	}
	defer outer.Close()
	const tables = 4000
	for sid := range uint32(tables) {
		m, err := ebpf.NewMap(ospec.InnerMap)
		if err != nil {
			b.Fatal(err)
		}
		err = outer.Put(sid, m)
		m.Close()
		if err != nil {
			b.Fatal(err)
		}
	}
	check := func(in InnerMapMemory) {
		if in.Count != tables {
			b.Fatalf("%d tables counted, want %d", in.Count, tables)
		}
	}
	b.Run("cold", func(b *testing.B) {
		for b.Loop() {
			d := &Datapath{}
			in, err := d.innerMemory(outer)
			if err != nil {
				b.Fatal(err)
			}
			check(in)
		}
	})
	b.Run("warm", func(b *testing.B) {
		d := &Datapath{}
		if _, err := d.innerMemory(outer); err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			in, err := d.innerMemory(outer)
			if err != nil {
				b.Fatal(err)
			}
			check(in)
		}
	})
}

// BenchmarkMapMemoryTopLevel times the read of the object's own maps.
func BenchmarkMapMemoryTopLevel(b *testing.B) {
	d, err := Open(Options{PinRoot: filepath.Join(testenv.PinRoot(b), "service"), Tier: TierS})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	for b.Loop() {
		if _, err := d.MapMemory(); err != nil {
			b.Fatal(err)
		}
	}
}
