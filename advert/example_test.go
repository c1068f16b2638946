package advert_test

import (
	"fmt"
	"log"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/fluxvm/servicefabric/advert"
)

func ExampleDecide() {
	vip := netip.MustParseAddr("203.0.113.10")
	for _, ready := range []int{2, 0} {
		e := advert.Decide(advert.Input{
			VIP: vip, Service: "web", Exposure: advert.ExposureNorthSouth,
			Enabled: true, Advertise: true, ReadyBackends: ready,
		})
		fmt.Printf("ready=%d advertised=%v reason=%q\n", ready, e.Advertised, e.Reason)
	}
	// Output:
	// ready=2 advertised=true reason=""
	// ready=0 advertised=false reason="no ready backend"
}

func ExamplePublisher() {
	dir, err := os.MkdirTemp("", "advert-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	p, err := advert.NewPublisher(advert.Options{
		Path: filepath.Join(dir, "service-advertisements.json"),
		Node: "node-a",
		Now:  func() time.Time { return time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC) },
	})
	if err != nil {
		log.Fatal(err)
	}
	web := advert.Input{
		VIP: netip.MustParseAddr("203.0.113.10"), Service: "web",
		Exposure: advert.ExposureNorthSouth, Enabled: true, Advertise: true,
	}
	for _, ready := range []int{1, 3, 0} {
		web.ReadyBackends = ready
		s, changed, err := p.Publish([]advert.Entry{advert.Decide(web)})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("ready=%d changed=%v generation=%d announce=%v\n", ready, changed, s.Generation, s.AdvertisedPrefixes())
	}
	// Output:
	// ready=1 changed=true generation=1 announce=[203.0.113.10/32]
	// ready=3 changed=false generation=1 announce=[203.0.113.10/32]
	// ready=0 changed=true generation=2 announce=[]
}

func ExampleRead() {
	s, err := advert.Read("testdata/snapshot.json")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("generation", s.Generation)
	for _, e := range s.Entries {
		if e.Advertised {
			fmt.Println("announce", e.Prefix, "for", e.Service)
		} else {
			fmt.Println("withdraw", e.Prefix, "for", e.Service+":", e.Reason)
		}
	}
	// Output:
	// generation 42
	// withdraw 198.51.100.7/32 for dns: no ready backend
	// announce 203.0.113.10/32 for web
	// withdraw 203.0.113.11/32 for internal: advertise=false
	// announce 2001:db8::10/128 for web
}
