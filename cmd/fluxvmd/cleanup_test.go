package main

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/cgtest"
	"github.com/fluxvm/servicefabric/internal/testutils/daemontest"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestCleanupAfterInterfacesAreGone: `fluxvmd cleanup` must remove what
// FluxVM owns also when configured interfaces no longer exist under their
// names (a VM's tap replaced, the uplink renamed); those are exactly the
// moments an operator cleans up. The catalog of a north-south service is
// left from the run, and the advertisement file is emptied. FluxVM's fq
// (kept at stop) is removed from every interface. Both attach modes.
func TestCleanupAfterInterfacesAreGone(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	for _, mode := range []bpf.AttachMode{bpf.AttachTCX, bpf.AttachClsBPF} {
		t.Run(string(mode), func(t *testing.T) {
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
		attach_mode = %q
		pin_root = %q
		catalog_path = %q
		advertisements_path = %q
		vm_edge_interfaces = [ { name = "vm2", vm_id = "backend" } ]
		north_south_interfaces = ["uplink"]
		snat_address = "10.250.0.100"
		`, mode, pinRoot, catalog, advPath)
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
		})
	}
}

// TestCleanupEveryOption turns on every optional key at once (HA with its
// north-south edge, XDP, socket load balancing on a cgroup of the test,
// EDT with fq managed, flow records with OTLP export, the ipcache file,
// pressure thresholds, TLS on the API), in both attach modes: check-config
// accepts the file, the real daemon serves east-west and north-south
// traffic and renews its HA lease (the lease file), stops, and `fluxvmd
// cleanup` with the same file exits 0 and leaves no pin, pin root or
// parent of it that the daemon made, TCX or XDP program, cls_bpf filter,
// fq of ours, socket hook, catalog or lease file. (It used to exit 1 with
// "ha_epoch: flow-state replication needs the north-south edge", and in
// cls_bpf mode "detach ns_in/ns_out from <if>: not attached".)
func TestCleanupEveryOption(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	for _, mode := range []bpf.AttachMode{bpf.AttachTCX, bpf.AttachClsBPF} {
		t.Run(string(mode), func(t *testing.T) {
			l, cli, be := clientAndBackend(t)
			// Native XDP on the uplink needs plain frames.
			ext := addPlainExternal(t, l)
			rc := newLogsReceiver(t, l)
			cg := cgtest.New(t)
			dir := t.TempDir()
			ipcache := filepath.Join(dir, "ipcache.json")
			writeIPCache(t, ipcache, cli.Addr4, 1001)
			certFile, keyFile, roots := writeTLSCert(t, dir)
			parent := filepath.Join(testenv.PinRoot(t), "fluxvm")
			pinRoot := filepath.Join(parent, "service")
			catalog := filepath.Join(dir, "catalog.json")
			cfg := filepath.Join(dir, "fluxvmd.toml")
			conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = "S"
attach_mode = %q
pin_root = %q
catalog_path = %q
advertisements_path = %q
node_name = "lab-node"
vm_edge_interfaces = [ { name = "vm1", vm_id = "client" }, { name = "vm2", vm_id = "backend" } ]
north_south_interfaces = ["uplink"]
snat_address = "10.250.0.100"
xdp_mode = "native"
ha_epoch = 1
cgroup_connect = true
cgroup_path = %q
edt_enabled = true
edt_manage_fq = true
edt_interfaces = ["uplink"]
edt_horizon_fallback = true
flow_sample_rate = 1
otlp_endpoint = "http://%s"
otlp_interval = "1s"
ipcache_file = %q
pressure_soft_percent = 60
pressure_hard_percent = 90

[sandbox.dataplane.service.api]
tls_cert_file = %q
tls_key_file = %q
`, mode, pinRoot, catalog, filepath.Join(dir, "adv.json"), cg.Path, rc.addr, ipcache, certFile, keyFile)
			if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
				t.Fatal(err)
			}
			if out, err := runDaemonCommand(l, bin, cfg, "check-config"); err != nil {
				t.Fatalf("check-config: %v\n%s", err, out)
			}

			d := daemontest.StartTLS(t, bin, cfg, l, token, roots)
			vip := netip.MustParseAddr("10.96.0.10")
			applyWeb(t, d, vip, be)
			edge := fluxvm.Service{
				Name: "edge", Exposure: fluxvm.ExposureNorthSouth,
				VIPs:     []netip.Addr{netip.MustParseAddr("10.96.0.30")},
				Ports:    []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
				Backends: []fluxvm.Backend{{Address: be.Addr4, Port: 8080}},
			}
			if _, err := d.Request("POST", "/v1/network/services", edge); err != nil {
				t.Fatal(err)
			}
			for _, c := range []struct {
				from *lab.VM
				to   netip.AddrPort
			}{{cli, netip.AddrPortFrom(vip, 80)}, {ext, netip.AddrPortFrom(edge.VIPs[0], 80)}} {
				conn, err := c.from.DialTCP(c.to, 3*time.Second)
				if err != nil {
					t.Fatalf("%s to %s: %v\n%s", c.from.Name, c.to, err, d.Out)
				}
				if err := conn.Echo([]byte("through "+c.to.String()), 3*time.Second); err != nil {
					t.Fatalf("%s to %s: %v", c.from.Name, c.to, err)
				}
				conn.Close()
			}
			if _, err := d.Request("POST", "/v1/network/services/ha/lease", fluxvm.HALease{Epoch: 2}); err != nil {
				t.Fatal(err)
			}
			lease := catalog + fluxvm.LeaseFileSuffix
			// What the checks below look for is there while the daemon
			// runs: they can see it.
			for _, p := range []string{pinRoot, lease} {
				if _, err := os.Stat(p); err != nil {
					t.Fatal(err)
				}
			}
			before := leftovers(t, l, cg.Path)
			for _, want := range [][2]string{{"vm1: ", "fluxvm_from_vm"}, {"uplink: ", "fluxvm_ns_in"}, {"uplink: XDP", ""}, {"cgroup: ", ""}} {
				if !slices.ContainsFunc(before, func(s string) bool { return strings.HasPrefix(s, want[0]) && strings.Contains(s, want[1]) }) {
					t.Errorf("while the daemon runs, no %q among %q", want, before)
				}
			}
			d.Stop()
			// A kernel without sch_fq runs edt_interfaces in horizon
			// mode (edt_horizon_fallback): FluxVM's root qdisc (handle
			// f1d0:, kept at stop) is then stood in for by a pfifo.
			if !slices.ContainsFunc(before, func(s string) bool { return strings.HasPrefix(s, "uplink: root qdisc") }) {
				t.Log("no fq on uplink (kernel without sch_fq): a pfifo f1d0: stands in for it")
				if err := l.Node.Do(func() error {
					link, err := netlink.LinkByName("uplink")
					if err != nil {
						return err
					}
					return netlink.QdiscAdd(&netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: link.Attrs().Index,
						Parent: netlink.HANDLE_ROOT, Handle: netlink.MakeHandle(0xf1d0, 0)}, QdiscType: "pfifo"})
				}); err != nil {
					t.Fatal(err)
				}
			}

			out, err := runDaemonCommand(l, bin, cfg, "cleanup")
			if err != nil {
				t.Fatalf("cleanup: %v\n%s", err, out)
			}
			for _, l := range leftovers(t, l, cg.Path) {
				t.Errorf("left after cleanup: %s", l)
			}
			files, _ := filepath.Glob(catalog + "*")
			for _, p := range append(files, pinRoot, parent, lease) {
				if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s left after cleanup: %v", p, err)
				}
			}
			if !strings.Contains(out, "HA lease file removed") || !strings.Contains(out, "epoch=2") {
				t.Errorf("cleanup did not say which lease it forgot:\n%s", out)
			}
		})
	}
}

// TestCleanupWhileRunning: `fluxvmd cleanup` against the pin root of a
// running fluxvmd fails (exit 1) saying the pin root is in use by that
// daemon's pid, and changes nothing: the VIP keeps answering and the pins
// and catalog stay. (It used to tear the running daemon's datapath down.)
func TestCleanupWhileRunning(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	l, cli, be := clientAndBackend(t)
	dir := t.TempDir()
	cfg, pinRoot := writeConfig(t, dir, "")
	d := startDaemon(t, bin, cfg, l)
	vip := netip.MustParseAddr("10.96.0.10")
	applyWeb(t, d, vip, be)
	out, err := runDaemonCommand(l, bin, cfg, "cleanup")
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("cleanup against a running daemon: %v, want exit 1\n%s", err, out)
	}
	if want := fmt.Sprintf("held by pid %d (fluxvmd): pin root in use", d.Cmd.Process.Pid); !strings.Contains(out, want) {
		t.Errorf("cleanup said %q, want it to contain %q", out, want)
	}
	conn, err := cli.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
	if err != nil {
		t.Fatalf("the VIP after the refused cleanup: %v", err)
	}
	conn.Close()
	if _, err := os.Stat(filepath.Join(pinRoot, "maps", "fluxvm_meta")); err != nil {
		t.Errorf("pins after the refused cleanup: %v", err)
	}
	if files, _ := filepath.Glob(filepath.Join(dir, "catalog.json*")); len(files) == 0 {
		t.Error("catalog gone after the refused cleanup")
	}
	if _, err := d.Request("GET", "/v1/network/services/web", nil); err != nil {
		t.Errorf("the daemon after the refused cleanup: %v", err)
	}
}

// TestCleanupConfigNoLongerValid: a configuration edited after the run
// into one that no longer validates (an unknown key, a port out of range,
// HA without the north-south edge) can still be cleaned up: cleanup reads
// only where the state lives. Bad values of those keys are refused,
// changing nothing.
func TestCleanupConfigNoLongerValid(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	for _, mode := range []bpf.AttachMode{bpf.AttachTCX, bpf.AttachClsBPF} {
		t.Run(string(mode), func(t *testing.T) {
			l, _, be := clientAndBackend(t)
			dir := t.TempDir()
			cfg, pinRoot := writeConfig(t, dir, fmt.Sprintf("attach_mode = %q\n", mode))
			d := startDaemon(t, bin, cfg, l)
			applyWeb(t, d, netip.MustParseAddr("10.96.0.10"), be)
			d.Stop()
			good, err := os.ReadFile(cfg)
			if err != nil {
				t.Fatal(err)
			}
			// A relative pin_root is refused, and nothing changes.
			bad := strings.Replace(string(good), "pin_root = ", "pin_root = \"service\"\n# ", 1)
			if err := os.WriteFile(cfg, []byte(bad), 0o600); err != nil {
				t.Fatal(err)
			}
			if out, err := runDaemonCommand(l, bin, cfg, "cleanup"); err == nil || !strings.Contains(out, "pin_root") {
				t.Errorf("cleanup with a relative pin_root: %v\n%s", err, out)
			}
			if _, err := os.Stat(pinRoot); err != nil {
				t.Errorf("pin root after the refused cleanup: %v", err)
			}
			invalid := string(good) + "ha_epoch = 1\nsnat_port_min = 70000\nno_such_key = true\n"
			if err := os.WriteFile(cfg, []byte(invalid), 0o600); err != nil {
				t.Fatal(err)
			}
			if out, err := runDaemonCommand(l, bin, cfg, "check-config"); err == nil {
				t.Fatalf("check-config accepted the edited file:\n%s", out)
			}
			if out, err := runDaemonCommand(l, bin, cfg, "cleanup"); err != nil {
				t.Fatalf("cleanup with a file that no longer validates: %v\n%s", err, out)
			}
			for _, left := range leftovers(t, l, "") {
				t.Errorf("left after cleanup: %s", left)
			}
			files, _ := filepath.Glob(filepath.Join(dir, "catalog.json*"))
			for _, p := range append(files, pinRoot) {
				if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s left after cleanup: %v", p, err)
				}
			}
		})
	}
}

// runDaemonCommand runs `fluxvmd -config cfg cmd` in the lab's node
// namespace and returns what it printed.
func runDaemonCommand(l *lab.Lab, bin, cfg, cmd string) (string, error) {
	c := exec.Command(bin, "-config", cfg, cmd)
	var out bytes.Buffer
	c.Stdout, c.Stderr = &out, &out
	err := l.Node.Do(c.Run)
	return out.String(), err
}

// leftovers lists FluxVM's attachments and qdiscs in the lab's node
// namespace and its socket hooks on the cgroup at cgroup (when set).
func leftovers(t *testing.T, l *lab.Lab, cgroup string) []string {
	t.Helper()
	var left []string
	if err := l.Node.Do(func() (err error) {
		left, err = testenv.FluxVMLeftovers()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if cgroup != "" {
		hooks, err := testenv.CgroupProgramNames(cgroup)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range hooks {
			left = append(left, "cgroup: "+h)
		}
	}
	return left
}

// writeTLSCert writes a self-signed certificate for 127.0.0.1 and its key
// into dir (owner-only) and returns their paths and a pool that trusts it.
func writeTLSCert(t *testing.T, dir string) (certFile, keyFile string, roots *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "fluxvmd test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, IsCA: true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	roots = x509.NewCertPool()
	roots.AddCert(cert)
	return certFile, keyFile, roots
}
