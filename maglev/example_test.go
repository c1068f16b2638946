package maglev_test

import (
	"fmt"
	"net/netip"

	"github.com/fluxvm/servicefabric/maglev"
)

func exampleBackends() []maglev.Backend {
	return []maglev.Backend{
		{ID: 1, Addr: netip.MustParseAddr("192.0.2.1"), Port: 80, Proto: 6, Weight: 1, Ready: true},
		{ID: 2, Addr: netip.MustParseAddr("192.0.2.2"), Port: 80, Proto: 6, Weight: 1, Ready: true},
		{ID: 3, Addr: netip.MustParseAddr("2001:db8::3"), Port: 80, Proto: 6, Weight: 2, Ready: true},
		{ID: 4, Addr: netip.MustParseAddr("192.0.2.4"), Port: 80, Proto: 6, Weight: 1, Ready: false},
	}
}

// New apportions the slots exactly by weight: 1:1:2 of 16381 slots, and
// nothing for the backend that is not ready.
func ExampleNew() {
	t, err := maglev.New(maglev.Config{Size: maglev.SizeS, Seed: 42}, exampleBackends())
	if err != nil {
		panic(err)
	}
	for _, sc := range t.SlotCounts() {
		fmt.Printf("%v weight %d: %d slots\n", sc.Backend, sc.Backend.Weight, sc.Slots)
	}
	// Output:
	// 192.0.2.1:80/6#1 weight 1: 4095 slots
	// 192.0.2.2:80/6#2 weight 1: 4095 slots
	// [2001:db8::3]:80/6#3 weight 2: 8191 slots
}

// Lookup picks the backend of a flow hash the way the datapath does, by
// slot hash % Size. An empty table is an explicit "no backend".
func ExampleTable_Lookup() {
	cfg := maglev.Config{Size: maglev.SizeS, Seed: 42}
	t, err := maglev.New(cfg, exampleBackends())
	if err != nil {
		panic(err)
	}
	for _, hash := range []uint32{0, 1, 0xdeadbeef} {
		b, _ := t.Lookup(hash)
		fmt.Printf("hash %#x -> slot %d -> %v\n", hash, hash%t.Size(), b.Addr)
	}

	empty, err := maglev.New(cfg, nil)
	if err != nil {
		panic(err)
	}
	_, ok := empty.Lookup(1)
	fmt.Println("empty:", empty.Empty(), "ok:", ok)
	// Output:
	// hash 0x0 -> slot 0 -> 192.0.2.2
	// hash 0x1 -> slot 1 -> 2001:db8::3
	// hash 0xdeadbeef -> slot 12175 -> 2001:db8::3
	// empty: true ok: false
}

// Entries are what the control plane writes into the datapath's BPF array:
// entry i holds the backend ID for flows with hash % Size == i.
func ExampleTable_Entries() {
	t, err := maglev.New(maglev.Config{Size: 13}, exampleBackends())
	if err != nil {
		panic(err)
	}
	fmt.Println(t.Entries())
	// Output:
	// [3 2 3 3 1 3 3 2 2 3 1 1 3]
}

// Measure tells how much traffic a change moves: here one backend of ten
// leaves a table of 65537 slots.
func ExampleMeasure() {
	var bs []maglev.Backend
	for i := range 10 {
		bs = append(bs, maglev.Backend{
			ID: uint32(i + 1), Addr: netip.AddrFrom4([4]byte{192, 0, 2, byte(i + 1)}),
			Port: 443, Proto: 6, Weight: 1, Ready: true,
		})
	}
	cfg := maglev.Config{Size: maglev.SizeM}
	before, err := maglev.New(cfg, bs)
	if err != nil {
		panic(err)
	}
	bs[4].Ready = false
	after, err := maglev.New(cfg, bs)
	if err != nil {
		panic(err)
	}
	d := maglev.Measure(before, after)
	fmt.Printf("moved %d of %d slots (at least %d had to)\n", d.MovedSlots, d.Slots, d.MinMovedSlots)
	fmt.Printf("moved although their backend stayed: %d (%.2f%%)\n", d.MovedWhileStayedSlots, 100*d.MovedWhileStayed)
	// Output:
	// moved 6699 of 65537 slots (at least 6554 had to)
	// moved although their backend stayed: 145 (0.25%)
}
