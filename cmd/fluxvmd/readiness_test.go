package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// readinessScript is scripts/test-production-readiness.sh, from this
// package's directory (where go test runs).
const readinessScript = "../../scripts/test-production-readiness.sh"

// TestProductionReadinessScript runs scripts/test-production-readiness.sh
// against the real daemon in a lab node: every check passes on a healthy
// node (VIP probe from the client VM included), and a wrong token, a
// dead VIP, an unexpected program generation and a detached interface
// each make it print the failing check and exit 1.
func TestProductionReadinessScript(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, tool := range []string{"bash", "curl", "jq", "nsenter", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			if testenv.Required() {
				t.Fatalf("%s not found: the readiness script needs it", tool)
			}
			t.Skipf("%s not found: the readiness script needs it", tool)
		}
	}
	_, bpftoolErr := exec.LookPath("bpftool")
	bin := buildDaemon(t)
	l, cli, be := clientAndBackend(t)
	// xdp_mode native below: the loader attaches XDP to the uplink only
	// while its veth peer sends plain frames.
	addPlainExternal(t, l)
	dir := t.TempDir()
	pinRoot := filepath.Join(testenv.PinRoot(t), "service")
	cfg := filepath.Join(dir, "fluxvmd.toml")
	conf := fmt.Sprintf(`[sandbox.dataplane.service]
pin_root = %q
catalog_path = %q
advertisements_path = %q
node_name = "lab-node"
vm_edge_interfaces = [
  { name = "vm1", vm_id = "client" },  # a comment
  { name = "vm2", vm_id = "backend" },
]
north_south_interfaces = ["uplink"]
xdp_mode = "native"
snat_address = "10.250.0.100"
`, pinRoot, filepath.Join(dir, "catalog.json"), filepath.Join(dir, "service-advertisements.json"))
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(dir, "read-token")
	if err := os.WriteFile(tokenFile, []byte("# the node's read token\n"+token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, bin, cfg, l)
	applyWeb(t, d, netip.MustParseAddr("10.96.0.10"), be)

	base := []string{"-c", cfg, "--netns", l.Node.Name, "--timeout", "2",
		"--expect-schema", fmt.Sprint(bpf.SchemaVersion), "--expect-generation", fmt.Sprint(bpf.ProgramGeneration)}
	run := func(extra ...string) (string, int) {
		t.Helper()
		cmd := exec.Command("bash", append([]string{readinessScript}, append(append([]string{}, base...), extra...)...)...)
		// Only the token the test names: none from the environment.
		for _, e := range os.Environ() {
			if !strings.HasPrefix(e, "FLUXVM_") {
				cmd.Env = append(cmd.Env, e)
			}
		}
		out, err := cmd.CombinedOutput()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		t.Logf("readiness %s: exit %d\n%s", strings.Join(extra, " "), code, out)
		return string(out), code
	}
	hasLine := func(out, prefix string) bool {
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, prefix) {
				return true
			}
		}
		return false
	}

	// A healthy node: every check passes, the VIP answers from the
	// client VM.
	vip := "10.96.0.10:80"
	out, code := run("-t", tokenFile, "--vip", vip, "--vip-netns", cli.NS.Name)
	if code != 0 {
		t.Errorf("healthy node: exit %d, want 0", code)
	}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if !strings.HasPrefix(line, "PASS ") && !strings.HasPrefix(line, "summary: ") {
			t.Errorf("healthy node: %q is not a PASS", line)
		}
	}
	for _, want := range []string{"PASS rest:", "PASS auth:", "PASS pin_root:", "PASS pins:", "PASS schema:", "PASS generation:",
		"PASS interface vm1:", "PASS interface vm2:", "PASS interface uplink:", "PASS xdp uplink:",
		"PASS links:", "PASS advertisements:", "PASS health:", "PASS vip " + vip + ":", "summary: "} {
		if !hasLine(out, want) {
			t.Errorf("healthy node: no line %q", want)
		}
	}
	if bpftoolErr == nil && !strings.Contains(out, fmt.Sprintf("the pinned fluxvm_meta %d", bpf.ProgramGeneration)) {
		t.Errorf("healthy node: the generation check did not read the pinned meta map")
	}

	// A wrong token: the REST check fails and says so.
	bad := filepath.Join(dir, "wrong-token")
	if err := os.WriteFile(bad, []byte("not-the-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, code = run("-t", bad)
	if code != 1 || !hasLine(out, "FAIL rest: ") || !strings.Contains(out, "401") {
		t.Errorf("wrong token: exit %d, want 1 and a FAIL rest line with 401:\n%s", code, out)
	}

	// A dead VIP, and a binary deployed that is not the one running (a
	// program generation the daemon does not report): two failures.
	out, code = run("-t", tokenFile, "--vip", "10.96.0.99:80", "--vip-netns", cli.NS.Name, "--timeout", "1",
		"--expect-generation", fmt.Sprint(bpf.ProgramGeneration+1))
	if code != 1 || !hasLine(out, "FAIL vip 10.96.0.99:80: ") || !hasLine(out, "FAIL generation: ") {
		t.Errorf("dead VIP and unexpected generation: exit %d, want 1, a FAIL vip and a FAIL generation line:\n%s", code, out)
	}
	if !strings.Contains(out, "summary: ") || !strings.Contains(out, " 2 fail,") {
		t.Errorf("dead VIP and unexpected generation: want a summary with 2 fail:\n%s", out)
	}

	// No configuration file: interfaces, pin root and XDP mode come from
	// the status (uplink runs XDP native), and a healthy node passes.
	out, code = run("-t", tokenFile, "-c", filepath.Join(dir, "nonexistent.toml"))
	if code != 0 {
		t.Errorf("healthy node without a configuration: exit %d, want 0", code)
	}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if !strings.HasPrefix(line, "PASS ") && !strings.HasPrefix(line, "summary: ") &&
			!strings.HasPrefix(line, "SKIP config:") && !strings.HasPrefix(line, "SKIP vip:") {
			t.Errorf("healthy node without a configuration: %q is not a PASS", line)
		}
	}
	for _, want := range []string{"PASS interface vm1:", "PASS interface uplink:", "PASS xdp uplink: native"} {
		if !hasLine(out, want) {
			t.Errorf("healthy node without a configuration: no line %q", want)
		}
	}

	if bpftoolErr == nil {
		// bpftool finds the meta map but its lookup gives nothing
		// parseable: the versions cannot be compared with the pins,
		// which must not pass on the running-vs-expected figures alone.
		fake := filepath.Join(dir, "fakebin")
		if err := os.MkdirAll(fake, 0o755); err != nil {
			t.Fatal(err)
		}
		real, _ := exec.LookPath("bpftool")
		script := fmt.Sprintf("#!/bin/sh\nif [ \"$1 $2\" = \"map lookup\" ]; then echo '{\"key\": garbage'; exit 0; fi\nexec %s \"$@\"\n", real)
		if err := os.WriteFile(filepath.Join(fake, "bpftool"), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
		t.Setenv("PATH", fake+":"+os.Getenv("PATH"))
		out, code = run("-t", tokenFile)
		os.Setenv("PATH", strings.TrimPrefix(os.Getenv("PATH"), fake+":"))
		if code != 1 || !hasLine(out, "FAIL schema: ") || !hasLine(out, "FAIL generation: ") || !strings.Contains(out, "could not be read") {
			t.Errorf("unreadable pinned meta: exit %d, want 1 and FAIL schema and generation lines:\n%s", code, out)
		}
	}

	body, err := d.Request("GET", "/v1/network/services/status", nil)
	if err != nil {
		t.Fatal(err)
	}
	var st fluxvm.Status
	if err := json.Unmarshal(body, &st); err != nil {
		t.Fatal(err)
	}
	idx := 0
	for _, ifc := range st.Interfaces {
		if ifc.Name == "vm1" {
			idx = ifc.Index
		}
	}
	if bpftoolErr == nil {
		// vm1's to_vm link detached in the kernel, its pin left in
		// place: the pin still names the program, the kernel attaches
		// it nowhere.
		pin := filepath.Join(pinRoot, "links", fmt.Sprintf("tcx_%d_to_vm", idx))
		if b, err := exec.Command("bpftool", "link", "detach", "pinned", pin).CombinedOutput(); err != nil {
			t.Fatalf("bpftool link detach pinned %s: %v: %s", pin, err, b)
		}
		out, code = run("-t", tokenFile)
		if code != 1 || !hasLine(out, "FAIL interface vm1: ") || !strings.Contains(out, "detached") {
			t.Errorf("vm1's to_vm link detached: exit %d, want 1 and a FAIL interface vm1 line saying so:\n%s", code, out)
		}
		if !hasLine(out, "PASS interface vm2: ") {
			t.Errorf("vm1's to_vm link detached: vm2 should still pass:\n%s", out)
		}
	}

	// vm1 detached: its from_vm link unpinned (which detaches it).
	if err := os.Remove(filepath.Join(pinRoot, "links", fmt.Sprintf("tcx_%d_from_vm", idx))); err != nil {
		t.Fatal(err)
	}
	out, code = run("-t", tokenFile)
	if code != 1 || !hasLine(out, "FAIL interface vm1: ") || !strings.Contains(out, "tcx_") {
		t.Errorf("vm1 detached: exit %d, want 1 and a FAIL interface vm1 line naming the link pin:\n%s", code, out)
	}
	if !hasLine(out, "PASS interface vm2: ") {
		t.Errorf("vm1 detached: vm2 should still pass:\n%s", out)
	}
}

// TestReadinessScriptTokenQuoting: a token with " and \ reaches the API
// as it is (curl's config on stdin quotes it), against a stand-in API that
// accepts only that exact header. Unprivileged: only the REST check is
// looked at.
func TestReadinessScriptTokenQuoting(t *testing.T) {
	for _, tool := range []string{"bash", "curl", "jq"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not found: the readiness script needs it", tool)
		}
	}
	const tok = `to"k\\en\"x`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+tok {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		fmt.Fprint(w, `{"schema_version": 1, "program_generation": 1, "pin_root": "", "interfaces": []}`)
	}))
	defer srv.Close()
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(tok+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", readinessScript, "-a", srv.URL, "-c", filepath.Join(dir, "none.toml"), "-t", tokenFile, "--timeout", "2")
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "FLUXVM_") {
			cmd.Env = append(cmd.Env, e)
		}
	}
	out, _ := cmd.CombinedOutput()
	if !strings.Contains(string(out), "PASS rest: ") || !strings.Contains(string(out), "PASS auth: ") {
		t.Errorf("token %q: want PASS rest and PASS auth:\n%s", tok, out)
	}
}

// TestReadinessScriptXDPAutoFallback: with xdp_mode auto, an uplink the
// daemon left with TC alone because an offload would hide VLAN tags from
// XDP (xdp_problem in the status) is a WARN that says why, not a FAIL;
// XDP off without a reason still FAILs.
func TestReadinessScriptXDPAutoFallback(t *testing.T) {
	for _, tool := range []string{"bash", "curl", "jq"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not found: the readiness script needs it", tool)
		}
	}
	const problem = "bpf: attach xdp on eth9: its driver takes VLAN tags out of the frames it receives (rx-vlan-hw-parse on)"
	for _, tc := range []struct {
		name, problem, want string
	}{
		{"with the reason", problem, "WARN xdp eth9: off, TC alone (xdp_mode auto): " + problem + "\n"},
		{"without a reason", "", "FAIL xdp eth9: runs off, xdp_mode is auto\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := json.Marshal(fluxvm.Status{SchemaVersion: 1, Generation: 1, Interfaces: []fluxvm.InterfaceStatus{{
				Name: "eth9", Kind: fluxvm.InterfaceNorthSouth, Index: 9, XDP: "off", XDPProblem: tc.problem,
				Hooks: []fluxvm.HookStatus{{Hook: "ns_in", Mode: "tcx"}, {Hook: "ns_out", Mode: "tcx"}}}}})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(st) }))
			defer srv.Close()
			dir := t.TempDir()
			cfg := filepath.Join(dir, "fluxvmd.toml")
			conf := fmt.Sprintf("[sandbox.dataplane.service]\npin_root = %q\nnorth_south_interfaces = [\"eth9\"]\nxdp_mode = \"auto\"\n", filepath.Join(dir, "pins"))
			if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
				t.Fatal(err)
			}
			tokenFile := filepath.Join(dir, "token")
			if err := os.WriteFile(tokenFile, []byte("tok\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command("bash", readinessScript, "-a", srv.URL, "-c", cfg, "-t", tokenFile, "--timeout", "2")
			for _, e := range os.Environ() {
				if !strings.HasPrefix(e, "FLUXVM_") {
					cmd.Env = append(cmd.Env, e)
				}
			}
			out, _ := cmd.CombinedOutput()
			if !strings.Contains(string(out), tc.want) {
				t.Errorf("want %q in:\n%s", tc.want, out)
			}
		})
	}
}
