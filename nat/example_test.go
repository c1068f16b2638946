package nat_test

import (
	"errors"
	"fmt"
	"log"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/nat"
)

// open loads the embedded TC object (root needed) and returns the Table
// over its reverse-NAT maps. A daemon would open the loader's pinned maps
// instead (ebpf.LoadPinnedMap).
func open() (*nat.Table, *ebpf.Collection) {
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
	return tab, coll
}

// How will a reply from this backend to this client be translated, if
// its flow stored a reverse-NAT half? (A flow whose replies are derived
// from its conntrack entry has none: see conntrack.Entry.ReverseDerived.)
func ExampleTable_Lookup() {
	tab, coll := open()
	defer coll.Close()

	e, err := tab.Lookup(nat.Key{
		Backend: netip.MustParseAddrPort("10.1.0.1:8080"),
		Client:  netip.MustParseAddrPort("10.0.0.1:40000"),
		Proto:   nat.ProtoTCP,
	})
	switch {
	case errors.Is(err, nat.ErrNotFound):
		fmt.Println("no stored half: translated from conntrack if the flow has derived replies, else not at all")
	case err != nil:
		log.Fatal(err)
	default:
		fmt.Printf("reply leaves as %s (service %d, backend %d)\n", e.VIP, e.ServiceID, e.BackendID)
	}
}

// Count the stored halves of each backend of a service (SNAT mappings and
// stored east-west halves; flows with derived replies have none, so count
// flows with conntrack.Map.Scan), however large the map: Scan holds one
// chunk at a time.
func ExampleTable_Scan() {
	tab, coll := open()
	defer coll.Close()

	perBackend := map[uint32]int{}
	err := tab.Scan(nat.Filter{ServiceIDs: []uint32{7}}, func(es []nat.Entry) error {
		for _, e := range es {
			perBackend[e.BackendID]++
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(perBackend)
}
