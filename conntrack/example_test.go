package conntrack_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/nat"
)

// The loader writes the configured timeouts into the meta map, which the
// datapath reads on every new deadline.
func ExampleTimeouts_ApplyTo() {
	to := conntrack.DefaultTimeouts()
	to.UDP = 30 * time.Second

	var meta bpf.Meta // in the loader: the current value of fluxvm_meta
	if err := to.ApplyTo(&meta); err != nil {
		log.Fatal(err)
	}
	fmt.Println(meta.TimeoutUdpS, meta.TimeoutTcpEstablishedS)
	fmt.Println(conntrack.TimeoutsFromMeta(meta).For(bpf.CTUDP))
	// Output:
	// 30 21600
	// 30s
}

func ExampleTimeouts_Validate() {
	to := conntrack.DefaultTimeouts()
	to.TCPRst = 500 * time.Millisecond // shorter than the datapath's refresh interval
	err := to.Validate()
	fmt.Println(errors.Is(err, conntrack.ErrInvalidTimeout))
	fmt.Println(err)
	// Output:
	// true
	// conntrack: invalid conntrack timeout: tcp rst timeout 500ms is outside [2s, 168h0m0s]
}

// open loads the embedded TC object (root needed) and returns the typed
// views over its lifecycle maps. A daemon would open the loader's pinned
// maps instead (ebpf.LoadPinnedMap), so that flows survive restarts.
func open() (*conntrack.Map, *nat.Table, *ebpf.Collection) {
	spec, err := bpf.Spec(bpf.TierM)
	if err != nil {
		log.Fatal(err)
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		log.Fatal(err)
	}
	tab, err := nat.New(coll.Maps["fluxvm_nat4"], coll.Maps["fluxvm_nat6"])
	if err != nil {
		log.Fatal(err)
	}
	ct, err := conntrack.New(conntrack.Config{
		CT4:      coll.Maps["fluxvm_fct4"],
		CT6:      coll.Maps["fluxvm_fct6"],
		Backends: coll.Maps["fluxvm_backends"],
		NAT:      tab,
		Timeouts: conntrack.DefaultTimeouts(),
	})
	if err != nil {
		log.Fatal(err)
	}
	return ct, tab, coll
}

// A GC loop: every few seconds, on the datapath's clock.
func ExampleMap_GC() {
	ct, _, coll := open()
	defer coll.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for {
		now, err := conntrack.Now() // CLOCK_MONOTONIC_COARSE, not time.Now
		if err != nil {
			log.Fatal(err)
		}
		res, err := ct.GC(ctx, now)
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) {
				return
			}
			log.Fatal(err)
		}
		if res.Removed() > 0 || res.CTRepaired+res.NATRepaired > 0 {
			log.Printf("conntrack gc: %v", res)
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return
		}
	}
}

// Which flows does a backend carry, and how long have they been idle?
func ExampleMap_Scan() {
	ct, _, coll := open()
	defer coll.Close()

	now, err := conntrack.Now()
	if err != nil {
		log.Fatal(err)
	}
	err = ct.Scan(conntrack.Filter{ServiceIDs: []uint32{7}, BackendIDs: []uint32{3}}, func(es []conntrack.Entry) error {
		for _, e := range es { // e is only valid until the function returns
			fmt.Printf("%s %s idle %v, expires in %v\n", e.Key, e.State, now-e.LastSeen, e.Deadline-now)
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
}

// Flushing one flow removes both of its halves.
func ExampleMap_Delete() {
	ct, tab, coll := open()
	defer coll.Close()

	entries, err := ct.List(conntrack.Filter{Family: conntrack.IPv4, ServiceIDs: []uint32{7}})
	if err != nil {
		log.Fatal(err)
	}
	for _, e := range entries {
		if err := ct.Delete(e.Key); err != nil && !errors.Is(err, conntrack.ErrNotFound) {
			log.Fatal(err)
		}
	}
	left, _ := tab.List(nat.Filter{ServiceIDs: []uint32{7}})
	fmt.Println(len(left), "reverse-NAT entries left") // 0, unless flows arrived meanwhile
}
