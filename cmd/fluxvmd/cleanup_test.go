package main

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestCleanupAfterInterfacesAreGone: `fluxvmd cleanup` must remove what
// FluxVM owns also when configured interfaces no longer exist under their
// names (a VM's tap replaced, the uplink renamed); those are exactly the
// moments an operator cleans up. The catalog of a north-south service is
// left from the run, and the advertisement file is emptied. FluxVM's fq
// (kept at stop) is removed from every interface.
func TestCleanupAfterInterfacesAreGone(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	l := lab.NewForTest(t)
	be := l.AddVMForTest(t, 2)
	if _, err := l.AddExternal(); err != nil {
		t.Fatal(err)
	}
	pinRoot := filepath.Join(testenv.PinRoot(t), "service")
	catalog := filepath.Join(t.TempDir(), "catalog.json")
	advPath := filepath.Join(t.TempDir(), "service-advertisements.json")
	cfg := filepath.Join(t.TempDir(), "fluxvmd.toml")
	conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = "S"
pin_root = %q
catalog_path = %q
advertisements_path = %q
vm_edge_interfaces = [ { name = "vm2", vm_id = "backend" } ]
north_south_interfaces = ["uplink"]
snat_address = "10.250.0.100"
`, pinRoot, catalog, advPath)
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, bin, cfg, l)
	ns := fluxvm.Service{
		Name: "edge", Exposure: fluxvm.ExposureNorthSouth, Advertise: true,
		VIPs:     []netip.Addr{netip.MustParseAddr("10.96.0.30")},
		Ports:    []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
		Backends: []fluxvm.Backend{{Address: be.Addr4, Port: 8080}},
	}
	if _, err := d.Request("POST", "/v1/network/services", ns); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Request("GET", "/v1/network/services/advertisements", nil); err != nil {
		t.Fatal(err)
	}
	d.Stop()

	// Neither configured name exists any more: the interfaces are renamed
	// (taken down first, as the kernel wants), their programs still
	// attached.
	err := l.Node.Do(func() error {
		for _, name := range []string{"vm2", "uplink"} {
			link, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetDown(link); err != nil {
				return err
			}
			if err := netlink.LinkSetName(link, name+"-old"); err != nil {
				return err
			}
			// And FluxVM's fq (handle f1d0:, kept at stop) on it, pfifo
			// standing in for fq, which a kernel may not have.
			q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: link.Attrs().Index, Parent: netlink.HANDLE_ROOT, Handle: netlink.MakeHandle(0xf1d0, 0)}, QdiscType: "pfifo"}
			if err := netlink.QdiscAdd(q); err != nil {
				return fmt.Errorf("%s: root f1d0: pfifo: %w", name, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(bin, "-config", cfg, "cleanup")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := l.Node.Do(cmd.Run); err != nil {
		t.Fatalf("cleanup with the configured interfaces gone: %v\n%s", err, out.String())
	}
	if _, err := os.Stat(pinRoot); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin root left after cleanup: %v", err)
	}
	err = l.Node.Do(func() error {
		for _, name := range []string{"vm2-old", "uplink-old"} {
			link, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			qs, err := netlink.QdiscList(link)
			if err != nil {
				return err
			}
			for _, q := range qs {
				if q.Attrs().Handle == netlink.MakeHandle(0xf1d0, 0) {
					t.Errorf("%s: FluxVM's root qdisc (%s f1d0:) left after cleanup", name, q.Type())
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(catalog); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("catalog left after cleanup: %v", err)
	}
	if s, err := advert.Read(advPath); err != nil || len(s.Entries) != 0 {
		t.Errorf("after cleanup the snapshot is %+v (%v), want no entries", s, err)
	}
}
