package main

import (
	"encoding/json"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// previousRelease is the last commit before issue 34 changed the
// datapath's objects (stage headers, the parse result in scratch,
// load-time features, maps sized by need). TestUpgradeKeepsFlows runs its
// daemon first. Move it on when a later change alters the objects or the
// pinned maps again.
const previousRelease = "296965f"

// buildRelease builds cmd/fluxvmd as it was at commit rev, from the
// repository this test runs in. Without the commit in the history (a
// shallow clone) the test cannot know the previous objects: it skips,
// saying so, or fails when privileged tests are required (CI).
func buildRelease(t *testing.T, rev string) string {
	t.Helper()
	root, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		skipOrFail(t, "upgrade test: not in a git checkout: %v", err)
	}
	repo := strings.TrimSpace(string(root))
	if out, err := exec.Command("git", "-C", repo, "cat-file", "-e", rev+"^{commit}").CombinedOutput(); err != nil {
		skipOrFail(t, "upgrade test: commit %s is not in this clone's history (shallow clone?): %v %s", rev, err, out)
	}
	src := t.TempDir()
	archive := exec.Command("git", "-C", repo, "archive", "--format=tar", rev)
	untar := exec.Command("tar", "-x", "-C", src)
	pipe, err := archive.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	untar.Stdin = pipe
	if err := untar.Start(); err != nil {
		t.Fatal(err)
	}
	if err := archive.Run(); err != nil {
		t.Fatalf("git archive %s: %v", rev, err)
	}
	if err := untar.Wait(); err != nil {
		t.Fatalf("untar %s: %v", rev, err)
	}
	bin := filepath.Join(t.TempDir(), "fluxvmd-"+rev)
	build := exec.Command("go", "build", "-o", bin, "./cmd/fluxvmd")
	build.Dir = src
	build.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build fluxvmd at %s: %v\n%s", rev, err, out)
	}
	return bin
}

// skipOrFail skips the test with the reason, or fails it when privileged
// tests must run (testenv.Required, as in CI).
func skipOrFail(t *testing.T, format string, args ...any) {
	t.Helper()
	if testenv.Required() {
		t.Fatalf(format, args...)
	}
	t.Skipf(format, args...)
}

// TestUpgradeKeepsFlows upgrades a node from the previous release's
// daemon (and so its BPF objects and pinned maps) to this one's with
// flows open: an east-west TCP connection through a VIP and a
// north-south one (DNAT + SNAT) from the external host. Both must keep
// working while the old daemon is stopped and after the new one starts.
// They must also keep their backend when that backend is then drained
// (new flows go to the other one): that holds only if the new datapath
// found their conntrack entries, since a flow that lost its entry would
// be picked again, onto the other backend, and reset there.
func TestUpgradeKeepsFlows(t *testing.T) {
	testenv.RequirePrivileged(t)
	old := buildRelease(t, previousRelease)
	bin := buildDaemon(t)
	l := lab.NewForTest(t)
	cli, be1, be2 := l.AddVMForTest(t, 1), l.AddVMForTest(t, 2), l.AddVMForTest(t, 3)
	for _, vm := range []*lab.VM{be1, be2} {
		srv, err := vm.Serve(8080)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Close() })
	}
	ext := addPlainExternal(t, l)

	dir, pinRoot := t.TempDir(), filepath.Join(testenv.PinRoot(t), "service")
	cfg := filepath.Join(dir, "fluxvmd.toml")
	conf := `[sandbox.dataplane.service]
map_tier = "S"
pin_root = "` + pinRoot + `"
catalog_path = "` + filepath.Join(dir, "catalog.json") + `"
advertisements_path = "` + filepath.Join(dir, "adv.json") + `"
node_name = "lab-node"
vm_edge_interfaces = [ { name = "vm1", vm_id = "client" }, { name = "vm2", vm_id = "be1" }, { name = "vm3", vm_id = "be2" } ]
north_south_interfaces = ["uplink"]
snat_address = "10.250.0.100"
snat_port_min = 62000
snat_port_max = 62999
`
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	services := func(draining bool) []fluxvm.Service {
		backends := []fluxvm.Backend{{Address: be1.Addr4, Port: 8080}}
		if draining {
			backends[0].State, backends[0].DrainUntilUnixMs = fluxvm.BackendDraining, time.Now().Add(time.Hour).UnixMilli()
			backends = append(backends, fluxvm.Backend{Address: be2.Addr4, Port: 8080})
		}
		return []fluxvm.Service{{
			Name: "web", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
			Ports:    []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
			Backends: backends,
		}, {
			Name: "edge", Exposure: fluxvm.ExposureNorthSouth,
			VIPs:     []netip.Addr{netip.MustParseAddr("10.96.0.30")},
			Ports:    []fluxvm.ServicePort{{Port: 443, Protocol: fluxvm.TCP}},
			Backends: backends,
		}}
	}
	apply := func(d *daemon, draining bool) {
		t.Helper()
		for _, s := range services(draining) {
			if _, err := d.Request("POST", "/v1/network/services", s); err != nil {
				t.Fatalf("apply %s: %v", s.Name, err)
			}
		}
	}
	webVIP, edgeVIP := netip.MustParseAddrPort("10.96.0.10:80"), netip.MustParseAddrPort("10.96.0.30:443")

	d := startDaemon(t, old, cfg, l)
	apply(d, false)
	flows := []struct {
		name string
		from *lab.VM
		vip  netip.AddrPort
		c    *lab.Conn
	}{{"east-west", cli, webVIP, nil}, {"north-south", ext, edgeVIP, nil}}
	for i := range flows {
		c, err := flows[i].from.DialTCP(flows[i].vip, 3*time.Second)
		if err != nil {
			t.Fatalf("%s through %s with the previous release: %v\n%s", flows[i].name, flows[i].vip, err, d.Out)
		}
		t.Cleanup(func() { c.Close() })
		if c.Backend != be1.Name {
			t.Fatalf("%s: answered by %s, want %s (its only backend)", flows[i].name, c.Backend, be1.Name)
		}
		flows[i].c = c
	}
	echo := func(when string) {
		t.Helper()
		for _, f := range flows {
			if err := f.c.Echo([]byte(f.name+" "+when), 3*time.Second); err != nil {
				t.Fatalf("%s flow broke %s: %v\n%s", f.name, when, err, d.Out)
			}
		}
	}
	echo("with the previous release")
	d.Stop()
	echo("with the previous release's daemon stopped")

	d = startDaemon(t, bin, cfg, l)
	echo("after the upgrade")
	// The upgraded daemon loaded what its configuration uses: no HA,
	// flow records or EDT; the east-west IPv4 conntrack map kept the
	// previous release's entries.
	body, err := d.Request("GET", "/v1/network/services/status", nil)
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Load struct {
			Features []string `json:"features"`
		} `json:"load"`
	}
	if err := json.Unmarshal(body, &st); err != nil {
		t.Fatal(err)
	}
	if len(st.Load.Features) != 0 {
		t.Errorf("upgraded daemon loaded features %v, want none (none configured)", st.Load.Features)
	}

	apply(d, true)
	echo("after their backend started draining")
	for _, f := range flows {
		c, err := f.from.DialTCP(f.vip, 3*time.Second)
		if err != nil {
			t.Fatalf("new %s flow after the upgrade: %v", f.name, err)
		}
		got := c.Backend
		c.Close()
		if got != be2.Name {
			t.Errorf("new %s flow answered by %s, want %s (%s drains): the drain did not take effect, so the kept flows prove nothing", f.name, got, be2.Name, be1.Name)
		}
	}
}
