package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/daemontest"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

const token = "test-admin-token-0123456789"

// daemon is fluxvmd running inside the lab's node namespace
// (daemontest), with this package's admin token.
type daemon = daemontest.Daemon

// clientAndBackend is a lab with a client VM (1) and a backend VM (2)
// serving the lab's echo protocol on port 8080.
func clientAndBackend(t *testing.T) (l *lab.Lab, cli, be *lab.VM) {
	t.Helper()
	l = lab.NewForTest(t)
	cli, be = l.AddVMForTest(t, 1), l.AddVMForTest(t, 2)
	srv, err := be.Serve(8080)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return l, cli, be
}

// addPlainExternal adds the lab's external host and makes its end of the
// uplink (eth0) send plain frames, without a VLAN tag or a partial
// checksum beside them, as native XDP on the uplink needs
// (bpf.ErrXDPOffload).
func addPlainExternal(t *testing.T, l *lab.Lab) *lab.VM {
	t.Helper()
	ext, err := l.AddExternal()
	if err != nil {
		t.Fatal(err)
	}
	if err := lab.SendPlainFrames(ext.NS, "eth0"); err != nil {
		t.Fatal(err)
	}
	return ext
}

// applyWeb applies service web (vip:80/TCP -> be:8080) over REST.
func applyWeb(t *testing.T, d *daemon, vip netip.Addr, be *lab.VM) {
	t.Helper()
	svc := fluxvm.Service{
		Name: "web", VIPs: []netip.Addr{vip},
		Ports:    []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
		Backends: []fluxvm.Backend{{Address: be.Addr4, Port: 8080}},
	}
	if _, err := d.Request("POST", "/v1/network/services", svc); err != nil {
		t.Fatal(err)
	}
}

// writeConfig writes dir/fluxvmd.toml for the lab of clientAndBackend:
// tier S, a fresh pin root, the catalog and advertisement files in dir
// (catalog.json, adv.json), node lab-node, VM edges vm1 (client) and vm2
// (backend), then the lines of extra. It returns the file's path and the
// pin root.
func writeConfig(t *testing.T, dir, extra string) (path, pinRoot string) {
	t.Helper()
	pinRoot = filepath.Join(testenv.PinRoot(t), "service")
	path = filepath.Join(dir, "fluxvmd.toml")
	conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = "S"
pin_root = %q
catalog_path = %q
advertisements_path = %q
node_name = "lab-node"
vm_edge_interfaces = [ { name = "vm1", vm_id = "client" }, { name = "vm2", vm_id = "backend" } ]
`, pinRoot, filepath.Join(dir, "catalog.json"), filepath.Join(dir, "adv.json"))
	if err := os.WriteFile(path, []byte(conf+extra), 0o600); err != nil {
		t.Fatal(err)
	}
	return path, pinRoot
}

func startDaemon(t *testing.T, bin, cfg string, l *lab.Lab) *daemon {
	t.Helper()
	return daemontest.Start(t, bin, cfg, l, token)
}

// TestDaemonRestartKeepsFlows runs the real binary in a lab node: it
// applies a service over REST, stops and restarts with a connection open
// through the VIP, and finally cleans up.
func TestDaemonRestartKeepsFlows(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	l, cli, be := clientAndBackend(t)

	if _, err := l.AddExternal(); err != nil {
		t.Fatal(err)
	}

	// Never the default /run/fluxvm: the test writes only its own files.
	dir := t.TempDir()
	advPath := filepath.Join(dir, "adv.json")
	cfg, pinRoot := writeConfig(t, dir, `north_south_interfaces = ["uplink"]
snat_address = "10.250.0.100"
snat_address_v6 = "fd00:250::100"
snat_port_min = 62000
snat_port_max = 62999
hash_seed = 1234567
maglev_seed = 99
`)

	d := startDaemon(t, bin, cfg, l)
	// The status shows the north-south interface and the SNAT settings.
	body, err := d.Request("GET", "/v1/network/services/status", nil)
	if err != nil {
		t.Fatal(err)
	}
	var status fluxvm.Status
	if err := json.Unmarshal(body, &status); err != nil {
		t.Fatal(err)
	}
	kinds := map[string]string{}
	for _, ifc := range status.Interfaces {
		kinds[ifc.Name] = ifc.Kind
	}
	if kinds["uplink"] != "north-south" || kinds["vm1"] != "vm-edge" || kinds["vm2"] != "vm-edge" {
		t.Errorf("status interfaces %s", body)
	}
	wantSNAT := fluxvm.SNATStatus{Address4: netip.MustParseAddr("10.250.0.100"), Address6: netip.MustParseAddr("fd00:250::100"), PortMin: 62000, PortMax: 62999}
	if !reflect.DeepEqual(status.SNAT, wantSNAT) {
		t.Errorf("status snat %+v, want %+v", status.SNAT, wantSNAT)
	}
	if status.Advertisements.Path != advPath || status.Advertisements.Generation != 1 {
		t.Errorf("status advertisements %+v", status.Advertisements)
	}
	// The configured seeds, as an HA peer would compare them.
	if !strings.Contains(string(body), `"seeds":{"hash_seed":1234567,"maglev_seed":99}`) {
		t.Errorf("status seeds: %s", body)
	}
	applyWeb(t, d, netip.MustParseAddr("10.96.0.10"), be)
	// A north-south service that asks to be advertised: the REST answer
	// is the file, byte for byte.
	ns := fluxvm.Service{
		Name: "edge", Exposure: fluxvm.ExposureNorthSouth, Advertise: true,
		VIPs:     []netip.Addr{netip.MustParseAddr("10.96.0.30")},
		Ports:    []fluxvm.ServicePort{{Port: 443, Protocol: fluxvm.TCP}},
		Backends: []fluxvm.Backend{{Address: be.Addr4, Port: 8080}},
	}
	if _, err := d.Request("POST", "/v1/network/services", ns); err != nil {
		t.Fatal(err)
	}
	body, err = d.Request("GET", "/v1/network/services/advertisements", nil)
	if err != nil {
		t.Fatal(err)
	}
	file, err := os.ReadFile(advPath)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(body, file) {
		t.Errorf("GET advertisements differs from the file:\n%s\n%s", body, file)
	}
	snap, err := advert.Decode(file)
	if err != nil {
		t.Fatal(err)
	}
	if got := snap.AdvertisedPrefixes(); len(got) != 1 || got[0] != netip.MustParsePrefix("10.96.0.30/32") || snap.Node != "lab-node" {
		t.Errorf("advertisements %s", file)
	}
	advGen := snap.Generation
	vip := netip.MustParseAddrPort("10.96.0.10:80")
	c, err := cli.DialTCP(vip, 3*time.Second)
	if err != nil {
		t.Fatalf("through the VIP: %v\n%s", err, d.Out)
	}
	defer c.Close()
	if err := c.Echo([]byte("one"), 3*time.Second); err != nil {
		t.Fatal(err)
	}

	d.Stop()
	if s, err := advert.Read(advPath); err != nil || s.Generation != advGen || len(s.AdvertisedPrefixes()) != 1 {
		t.Errorf("after stop the snapshot is %+v (%v), want generation %d as last published", s, err, advGen)
	}
	if err := c.Echo([]byte("daemon stopped"), 3*time.Second); err != nil {
		t.Fatalf("flow broke when the daemon stopped: %v", err)
	}
	d = startDaemon(t, bin, cfg, l)
	if err := c.Echo([]byte("daemon restarted"), 3*time.Second); err != nil {
		t.Fatalf("flow broke when the daemon restarted: %v\n%s", err, d.Out)
	}
	body, err = d.Request("GET", "/v1/network/services/web", nil)
	if err != nil {
		t.Fatalf("catalog not restored: %v", err)
	}
	var st fluxvm.ServiceStatus
	if err := json.Unmarshal(body, &st); err != nil || len(st.Frontends) != 1 || !st.Frontends[0].GuardOpen {
		t.Errorf("restored service %s (%v)", body, err)
	}
	// The restarted daemon reports the memory of the two services'
	// Maglev tables, as the kernel counts it for the pinned maps.
	body, err = d.Request("GET", "/v1/network/services/status", nil)
	if err != nil {
		t.Fatal(err)
	}
	status = fluxvm.Status{}
	if err := json.Unmarshal(body, &status); err != nil || status.Memory == nil {
		t.Fatalf("status after restart: %s (%v)", body, err)
	}
	wantInner := pinnedMaglevMemory(t, pinRoot)
	if status.Memory.MaglevInner != wantInner || wantInner.Count != 2 {
		t.Errorf("status memory: Maglev tables %+v, the pinned fluxvm_maglev holds %+v (want 2 tables)", status.Memory.MaglevInner, wantInner)
	}
	metrics, err := d.Request("GET", "/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"fluxvm_maglev_inner_maps 2\n",
		fmt.Sprintf("fluxvm_map_memory_bytes{map=%q} %g\n", "fluxvm_maglev_inner", float64(wantInner.Bytes)),
	} {
		if !strings.Contains(string(metrics), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// The restarted daemon finds the same content: no rewrite.
	body, err = d.Request("GET", "/v1/network/services/advertisements", nil)
	if s, derr := advert.Decode(body); err != nil || derr != nil || s.Generation != advGen {
		t.Errorf("advertisements after restart: %s (%v, %v), want generation %d", body, err, derr, advGen)
	}
	c2, err := cli.DialTCP(vip, 3*time.Second)
	if err != nil {
		t.Fatalf("new flow after restart: %v", err)
	}
	c2.Close()
	d.Stop()

	cmd := exec.Command(bin, "-config", cfg, "cleanup")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := l.Node.Do(cmd.Run); err != nil {
		t.Fatalf("cleanup: %v\n%s", err, out.String())
	}
	if _, err := os.Stat(pinRoot); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin root left after cleanup: %v", err)
	}
	if s, err := advert.Read(advPath); err != nil || len(s.Entries) != 0 || s.Generation != advGen+1 {
		t.Errorf("after cleanup the snapshot is %+v (%v), want no entries", s, err)
	}
}

// pinnedMaglevMemory sums the fdinfo memlock of the Maglev tables in the
// pinned fluxvm_maglev of pinRoot, read by this process: the kernel's
// figures, independent of the daemon's reading.
func pinnedMaglevMemory(t *testing.T, pinRoot string) fluxvm.InnerMapsMemory {
	t.Helper()
	outer, err := ebpf.LoadPinnedMap(filepath.Join(pinRoot, "maps", "fluxvm_maglev"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer outer.Close()
	var in fluxvm.InnerMapsMemory
	for slot := range outer.MaxEntries() {
		var inner *ebpf.Map
		if err := outer.Lookup(slot, &inner); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				continue
			}
			t.Fatal(err)
		}
		b := testenv.FdinfoMemlock(t, inner.FD())
		inner.Close()
		in.Count++
		in.Bytes += b
		in.LargestBytes = max(in.LargestBytes, b)
	}
	return in
}

// TestCheckConfig runs the check-config command on valid and invalid
// north-south settings: a valid file is summarised, an invalid one fails
// naming the key.
func TestCheckConfig(t *testing.T) {
	const head = "[sandbox.dataplane.service]\n"
	tests := []struct {
		name string
		doc  string
		want string // substring of the error; "" = valid
	}{
		{name: "defaults", doc: head},
		{name: "north-south dual-stack", doc: head + `north_south_interfaces = ["eth1"]
snat_address = "203.0.113.10"
snat_address_v6 = "2001:db8:10::10"
snat_port_min = 40000
snat_port_max = 49999
`},
		{name: "snat_address_v6 IPv4", doc: head + "snat_address_v6 = \"203.0.113.10\"\n", want: "sandbox.dataplane.service.snat_address_v6"},
		{name: "two IPv6 SNAT addresses", doc: head + "snat_address = \"2001:db8::1\"\nsnat_address_v6 = \"2001:db8::2\"\n", want: "sandbox.dataplane.service.snat_address:"},
		{name: "port below 1024", doc: head + "snat_port_min = 80\n", want: "sandbox.dataplane.service.snat_port_min"},
		{name: "ports reversed", doc: head + "snat_port_min = 65000\nsnat_port_max = 64000\n", want: "sandbox.dataplane.service.snat_port_min"},
		{name: "north-south also a VM edge", doc: head + "north_south_interfaces = [\"tap1\"]\nvm_edge_interfaces = [{ name = \"tap1\", vm_id = \"a\" }]\n",
			want: "sandbox.dataplane.service.north_south_interfaces[0]"},
		{name: "cgroup_path without cgroup_connect", doc: head + "cgroup_path = \"/sys/fs/cgroup\"\n", want: "sandbox.dataplane.service.cgroup_path"},
		{name: "cgroup_path not on cgroup v2", doc: head + "cgroup_connect = true\ncgroup_path = \"" + t.TempDir() + "\"\n", want: "not on a cgroup v2 filesystem"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "fluxvmd.toml")
			if err := os.WriteFile(path, []byte(tt.doc), 0o600); err != nil {
				t.Fatal(err)
			}
			err := run(context.Background(), []string{"-config", path, "check-config"})
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("valid configuration refused: %v", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("error %v, want one naming %s", err, tt.want)
			}
		})
	}
	cfg, err := parseConfig([]byte(tests[1].doc))
	if err != nil {
		t.Fatal(err)
	}
	out := describeConfig(cfg.Config)
	for _, want := range []string{"configuration is valid", "north_south_interfaces: eth1", "snat IPv4 address: 203.0.113.10",
		"snat IPv6 address: 2001:db8:10::10", "snat ports: 40000..49999", "seeds: hash_seed 0, maglev_seed 0", "advertisements_path: /run/fluxvm/service-advertisements.json"} {
		if !strings.Contains(out, want) {
			t.Errorf("check-config output lacks %q:\n%s", want, out)
		}
	}
	if out := describeConfig(cfg.Config); !strings.Contains(out, "socket load balancing: off") {
		t.Errorf("check-config output lacks socket load balancing off:\n%s", out)
	}
	cfg.CgroupConnect, cfg.CgroupPath = true, "/sys/fs/cgroup/unified/agents"
	if out := describeConfig(cfg.Config); !strings.Contains(out, "socket load balancing: on, on cgroup /sys/fs/cgroup/unified/agents") {
		t.Errorf("check-config output lacks the cgroup:\n%s", out)
	}
}

// buildDaemon builds this package's binary into the test's temporary
// directory and returns its path.
func buildDaemon(t *testing.T) string { return daemontest.Build(t) }
