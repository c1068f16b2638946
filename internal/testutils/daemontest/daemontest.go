//go:build linux

// Package daemontest runs the fluxvmd binary inside a lab's node namespace
// for tests: build it, start it with a configuration, talk to its REST API
// on the namespace's loopback, stop it with SIGTERM.
package daemontest

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/daemonlog"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// Package is fluxvmd's import path, for Build.
const Package = "github.com/fluxvm/servicefabric/cmd/fluxvmd"

// APIAddr is where the tests' configurations make fluxvmd listen (inside
// the node namespace).
const APIAddr = "127.0.0.1:7788"

// Build builds fluxvmd, in the main module as it ships (its own go.mod,
// also for a test module of its own), into the test's temporary directory
// and returns the binary's path.
func Build(t testing.TB) string {
	t.Helper()
	return BuildCommand(t, "./cmd/fluxvmd")
}

// BuildCommand builds the main package in dir (relative to the main
// module's root, e.g. "./examples/l7proxy") into the test's temporary
// directory and returns the binary's path.
func BuildCommand(t testing.TB, dir string) string {
	t.Helper()
	_, here, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("daemontest: where is the module?")
	}
	bin := filepath.Join(t.TempDir(), filepath.Base(dir))
	cmd := exec.Command("go", "build", "-o", bin, dir)
	cmd.Dir = filepath.Join(filepath.Dir(here), "..", "..", "..")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", dir, err, out)
	}
	return bin
}

// Daemon is fluxvmd running inside a lab's node namespace.
type Daemon struct {
	T     testing.TB
	Cmd   *exec.Cmd
	Out   *Output      // what it printed
	HTTP  *http.Client // dials inside the node namespace
	Token string       // its admin token
	// scheme is "https" for StartTLS, else "" (http).
	scheme string
}

// Output is a daemon's output, safe to read while it writes.
type Output = daemonlog.Output

// Start runs bin with configuration file cfg and admin token token inside
// l's node namespace and waits until its API answers. It is stopped
// (Stop) when the test ends.
func Start(t testing.TB, bin, cfg string, l *lab.Lab, token string) *Daemon {
	t.Helper()
	return StartTLS(t, bin, cfg, l, token, nil)
}

// StartTLS is Start for a daemon whose API serves HTTPS (api.tls_cert_file
// and tls_key_file): its client trusts the certificates of roots. A nil
// roots is Start (plain HTTP).
func StartTLS(t testing.TB, bin, cfg string, l *lab.Lab, token string, roots *x509.CertPool) *Daemon {
	t.Helper()
	d := &Daemon{T: t, Out: daemonlog.New(), Token: token}
	d.Cmd = exec.Command(bin, "-config", cfg)
	d.Cmd.Env = append(os.Environ(), "FLUXVM_ADMIN_TOKEN="+token)
	d.Cmd.Stdout, d.Cmd.Stderr = d.Out, d.Out
	// Started from a thread inside the node namespace, the daemon lives
	// there but shares our mount namespace and so the host's bpffs.
	// (`ip netns exec` would remount /sys and hide it.)
	if err := l.Node.Do(d.Cmd.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Stop)
	tr := &http.Transport{DialContext: l.Node.DialContext}
	if roots != nil {
		d.scheme = "https"
		tr.TLSClientConfig = &tls.Config{RootCAs: roots}
	}
	d.HTTP = &http.Client{Timeout: 10 * time.Second, Transport: tr}
	select {
	case <-d.Out.Serving():
	case <-time.After(20 * time.Second):
		t.Fatalf("daemon did not come up within 20s:\n%s", d.Out)
	}
	if _, err := d.Request("GET", "/v1/network/services/status", nil); err != nil {
		t.Fatalf("daemon logged that it serves, but: %v\n%s", err, d.Out)
	}
	return d
}

// Request sends method path with body as JSON (nil: none) and the admin
// token; a status of 300 or more is an error carrying the body.
func (d *Daemon) Request(method, path string, body any) ([]byte, error) {
	var r io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		r = bytes.NewReader(b)
	}
	scheme := "http"
	if d.scheme != "" {
		scheme = d.scheme
	}
	req, err := http.NewRequest(method, scheme+"://"+APIAddr+path, r)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+d.Token)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := d.HTTP.Do(req)
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

// Stop sends SIGTERM and waits up to 15 s for a clean exit (then kills it);
// an exit other than 0 fails the test. A stopped daemon stays stopped.
func (d *Daemon) Stop() {
	if d.Cmd.ProcessState != nil {
		return
	}
	d.Cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- d.Cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			d.T.Errorf("daemon exited with %v:\n%s", err, d.Out)
		}
	case <-time.After(15 * time.Second):
		d.Cmd.Process.Kill()
		<-done
		d.T.Errorf("daemon did not stop on SIGTERM:\n%s", d.Out)
	}
}
