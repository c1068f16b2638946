// Command embed shows how a VMM embeds the FluxVM Service Fabric: it opens
// the node dataplane, attaches a VM's host-side interface, applies a
// service from a JSON file and mounts the REST API on its own mux.
//
//	go run ./examples/embed -iface tap-vm1 -vm vm-1 -service examples/service-fabric-v4-east-west.json
//
// With -uplink (and -snat for north-south NAT) it also serves north-south
// services to clients behind that interface:
//
//	go run ./examples/embed -iface tap-vm1 -uplink eth1 -snat 203.0.113.10 -service ...
//
// It needs root (CAP_BPF, CAP_NET_ADMIN) and an existing interface. Stop it
// with Ctrl-C; the datapath keeps forwarding (run it again, or call
// fluxvm.Cleanup, to take over or remove the state; a second run while
// this one holds the pin root fails with fluxvm.ErrInUse).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

func main() {
	ifname := flag.String("iface", "", "host-side interface of the VM (required)")
	vmID := flag.String("vm", "vm-1", "the VM's id")
	svcFile := flag.String("service", "", "service JSON to apply (optional)")
	listen := flag.String("listen", "127.0.0.1:7788", "where to serve the REST API")
	uplink := flag.String("uplink", "", "north-south interface (optional)")
	snat := flag.String("snat", "", "SNAT address of north-south NAT (optional)")
	flag.Parse()
	if *ifname == "" {
		log.Fatal("-iface is required")
	}

	cfg := fluxvm.DefaultConfig()
	cfg.CatalogPath = "/run/fluxvm-embed/catalog.json"
	cfg.AdvertisementsPath = "/run/fluxvm-embed/service-advertisements.json"
	if *uplink != "" {
		// Attached by Open; Dataplane.AddNorthSouthInterface does the same
		// later on.
		cfg.NorthSouthInterfaces = []string{*uplink}
	}
	if *snat != "" {
		a, err := netip.ParseAddr(*snat)
		if err != nil {
			log.Fatal(err)
		}
		cfg.SNATAddress = a
	}
	if err := cfg.Validate(); err != nil {
		log.Fatal(err)
	}
	opts := fluxvm.OptionsFrom(cfg)
	opts.Logger = slog.Default()
	d, err := fluxvm.Open(context.Background(), opts)
	if err != nil {
		log.Fatal(err)
	}
	defer d.Close()

	// Interfaces come from the embedder, as VMs start and stop.
	if _, err := d.AddInterface(context.Background(), fluxvm.VMEdgeInterface{Name: *ifname, VMID: *vmID}); err != nil {
		log.Fatal(err)
	}
	if *svcFile != "" {
		f, err := os.Open(*svcFile)
		if err != nil {
			log.Fatal(err)
		}
		svc, err := fluxvm.DecodeService(f)
		f.Close()
		if err != nil {
			log.Fatal(err)
		}
		st, err := d.ApplyService(context.Background(), svc)
		if err != nil {
			log.Fatal(err)
		}
		for _, fe := range st.Frontends {
			fmt.Printf("%s %s -> %d eligible backends\n", fe.VIP, fe.Protocol, fe.Eligible)
		}
	}

	token := os.Getenv("FLUXVM_ADMIN_TOKEN")
	if token == "" {
		log.Fatal("set FLUXVM_ADMIN_TOKEN")
	}
	h, err := api.New(api.RolesOf(d), api.Options{AdminTokens: []string{token}})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/v1/", h)
	mux.Handle("/metrics", h)
	// The handler bounds request bodies itself (api.Options.BodyTimeout);
	// the server bounds headers and idle connections.
	srv := &http.Server{Addr: *listen, Handler: mux, ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10}
	go func() {
		if err := srv.ListenAndServe(); err != nil && err != http.ErrServerClosed {
			log.Fatal(err)
		}
	}()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	<-ctx.Done()
	srv.Shutdown(context.Background())
}
