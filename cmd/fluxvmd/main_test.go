package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/lab"
	"github.com/fluxvm/servicefabric/internal/testenv"
)

const token = "test-admin-token-0123456789"

// daemon is fluxvmd running inside the lab's node namespace.
type daemon struct {
	t    *testing.T
	cmd  *exec.Cmd
	out  *bytes.Buffer
	node *lab.Lab
	http *http.Client
}

func startDaemon(t *testing.T, bin, cfg string, l *lab.Lab) *daemon {
	t.Helper()
	d := &daemon{t: t, out: &bytes.Buffer{}, node: l}
	d.cmd = exec.Command(bin, "-config", cfg)
	d.cmd.Env = append(os.Environ(), "FLUXVM_ADMIN_TOKEN="+token)
	d.cmd.Stdout, d.cmd.Stderr = d.out, d.out
	// Started from a thread inside the node namespace, the daemon lives
	// there but shares our mount namespace and so the host's bpffs.
	// (`ip netns exec` would remount /sys and hide it.)
	if err := l.Node.Do(d.cmd.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.stop() })
	// The API listens on loopback inside the node namespace.
	d.http = &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (c net.Conn, err error) {
			err = l.Node.Do(func() error {
				c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
				return err
			})
			return c, err
		},
	}}
	for deadline := time.Now().Add(20 * time.Second); ; {
		if _, err := d.request("GET", "/v1/network/services/status", nil); err == nil {
			return d
		}
		if time.Now().After(deadline) || d.cmd.ProcessState != nil {
			t.Fatalf("daemon did not come up:\n%s", d.out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (d *daemon) request(method, path string, body any) ([]byte, error) {
	var r io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		r = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, "http://127.0.0.1:7788"+path, r)
	req.Header.Set("Authorization", "Bearer "+token)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := d.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode >= 300 {
		return out, fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, out)
	}
	return out, nil
}

func (d *daemon) stop() {
	if d.cmd.ProcessState != nil {
		return
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- d.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			d.t.Errorf("daemon exited with %v:\n%s", err, d.out)
		}
	case <-time.After(15 * time.Second):
		d.cmd.Process.Kill()
		d.t.Errorf("daemon did not stop on SIGTERM:\n%s", d.out)
	}
}

// TestDaemonRestartKeepsFlows runs the real binary in a lab node: it
// applies a service over REST, stops and restarts with a connection open
// through the VIP, and finally cleans up.
func TestDaemonRestartKeepsFlows(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := filepath.Join(t.TempDir(), "fluxvmd")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	l := lab.NewForTest(t)
	cli, be := l.AddVMForTest(t, 1), l.AddVMForTest(t, 2)
	srv, err := be.Serve(8080)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	pinRoot := filepath.Join(testenv.PinRoot(t), "service")
	cfg := filepath.Join(t.TempDir(), "fluxvmd.toml")
	conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = "S"
pin_root = %q
catalog_path = %q
vm_edge_interfaces = [ { name = "vm1", vm_id = "client" }, { name = "vm2", vm_id = "backend" } ]
`, pinRoot, filepath.Join(t.TempDir(), "catalog.json"))
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}

	d := startDaemon(t, bin, cfg, l)
	svc := fluxvm.Service{
		Name: "web", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
		Ports:    []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
		Backends: []fluxvm.Backend{{Address: be.Addr4, Port: 8080}},
	}
	if _, err := d.request("POST", "/v1/network/services", svc); err != nil {
		t.Fatal(err)
	}
	vip := netip.MustParseAddrPort("10.96.0.10:80")
	c, err := cli.DialTCP(vip, 3*time.Second)
	if err != nil {
		t.Fatalf("through the VIP: %v\n%s", err, d.out)
	}
	defer c.Close()
	if err := c.Echo([]byte("one"), 3*time.Second); err != nil {
		t.Fatal(err)
	}

	d.stop()
	if err := c.Echo([]byte("daemon stopped"), 3*time.Second); err != nil {
		t.Fatalf("flow broke when the daemon stopped: %v", err)
	}
	d = startDaemon(t, bin, cfg, l)
	if err := c.Echo([]byte("daemon restarted"), 3*time.Second); err != nil {
		t.Fatalf("flow broke when the daemon restarted: %v\n%s", err, d.out)
	}
	body, err := d.request("GET", "/v1/network/services/web", nil)
	if err != nil {
		t.Fatalf("catalog not restored: %v", err)
	}
	var st fluxvm.ServiceStatus
	if err := json.Unmarshal(body, &st); err != nil || len(st.Frontends) != 1 || !st.Frontends[0].GuardOpen {
		t.Errorf("restored service %s (%v)", body, err)
	}
	c2, err := cli.DialTCP(vip, 3*time.Second)
	if err != nil {
		t.Fatalf("new flow after restart: %v", err)
	}
	c2.Close()
	d.stop()

	cmd := exec.Command(bin, "-config", cfg, "cleanup")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := l.Node.Do(cmd.Run); err != nil {
		t.Fatalf("cleanup: %v\n%s", err, out.String())
	}
	if _, err := os.Stat(pinRoot); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin root left after cleanup: %v", err)
	}
}
