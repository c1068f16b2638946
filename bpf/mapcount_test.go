package bpf

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestMapEntries: the kernel's count of each hash map's entries, through
// the map iterator, follows real inserts and deletes of an LRU map
// (conntrack) and a plain hash (reverse NAT); maps of other types are not
// reported; after Close it refuses.
func TestMapEntries(t *testing.T) {
	d := openT(t, Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: TierS})
	read := func() map[string]MapFill {
		t.Helper()
		m, err := d.MapEntries()
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	before := read()
	ct, ok := before["fluxvm_fct4"]
	if !ok || ct.MaxEntries != d.Map("fluxvm_fct4").MaxEntries() {
		t.Fatalf("fluxvm_fct4: %+v (reported %v)", ct, ok)
	}
	if _, ok := before["fluxvm_backends"]; ok {
		t.Error("an array map is reported: arrays are always full")
	}
	const n = 300
	for i := range n {
		k := Tuple4{Saddr: uint32(i + 1), Daddr: 7, Sport: 1, Dport: 2, Proto: 6}
		if err := d.Map("fluxvm_fct4").Put(k, CTValue{ServiceId: 1}); err != nil {
			t.Fatal(err)
		}
		if i < n/3 {
			if err := d.Map("fluxvm_nat4").Put(k, NATValue{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	after := read()
	if got := after["fluxvm_fct4"].Entries - before["fluxvm_fct4"].Entries; got != n {
		t.Errorf("fluxvm_fct4 (LRU): %d entries more, want %d", got, n)
	}
	if got := after["fluxvm_nat4"].Entries - before["fluxvm_nat4"].Entries; got != n/3 {
		t.Errorf("fluxvm_nat4: %d entries more, want %d", got, n/3)
	}
	if p := after["fluxvm_fct4"].Percent(); p <= 0 || p > 100 {
		t.Errorf("fluxvm_fct4 at %.2f%%", p)
	}
	for i := range n / 2 {
		if err := d.Map("fluxvm_fct4").Delete(Tuple4{Saddr: uint32(i + 1), Daddr: 7, Sport: 1, Dport: 2, Proto: 6}); err != nil {
			t.Fatal(err)
		}
	}
	if got := read()["fluxvm_fct4"].Entries - before["fluxvm_fct4"].Entries; got != n-n/2 {
		t.Errorf("fluxvm_fct4 after deletes: %d entries more, want %d", got, n-n/2)
	}
	d.Close()
	if _, err := d.MapEntries(); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: %v, want ErrClosed", err)
	}
}

// BenchmarkMapEntries times one reading of every hash map's count: the
// cost the pressure controller pays every few seconds, whatever the maps
// hold.
func BenchmarkMapEntries(b *testing.B) {
	d, err := Open(Options{PinRoot: filepath.Join(testenv.PinRoot(b), "service"), Tier: TierL})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	for b.Loop() {
		if _, err := d.MapEntries(); err != nil {
			b.Fatal(err)
		}
	}
}
