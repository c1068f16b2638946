package main

import (
	"bytes"
	"encoding/json"
	"encoding/pem"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
)

const testToken = "s3cret-admin"

// seen is one request the fake node received.
type seen struct {
	method, path, query, auth, ctype, body string
}

// answer is what the fake node sends for a route.
type answer struct {
	status int
	body   []byte
}

// fakeNode is an httptest server answering canned JSON, made by
// marshalling the SDK's own types, keyed by "METHOD path".
type fakeNode struct {
	*httptest.Server
	mu       sync.Mutex
	requests []seen
	answers  map[string]answer
}

func newFakeNode(t *testing.T, answers map[string]answer) *fakeNode {
	t.Helper()
	n := &fakeNode{answers: answers}
	n.Server = httptest.NewServer(http.HandlerFunc(n.serve))
	t.Cleanup(n.Close)
	return n
}

func (n *fakeNode) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	n.mu.Lock()
	n.requests = append(n.requests, seen{r.Method, r.URL.EscapedPath(), r.URL.RawQuery, r.Header.Get("Authorization"), r.Header.Get("Content-Type"), string(body)})
	a, ok := n.answers[r.Method+" "+r.URL.EscapedPath()]
	n.mu.Unlock()
	if !ok {
		a = errAnswer(api.CodeNotFound, "no such route: "+r.Method+" "+r.URL.Path, "")
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(a.status)
	_, _ = w.Write(a.body)
}

// last is the last request the node received.
func (n *fakeNode) last(t *testing.T) seen {
	t.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.requests) == 0 {
		t.Fatal("the node received no request")
	}
	return n.requests[len(n.requests)-1]
}

// ok is a 200 answer of v as the server writes it (compact JSON and a
// newline).
func ok(t *testing.T, v any) answer {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return answer{status: http.StatusOK, body: append(b, '\n')}
}

// errAnswer is an error answer of the API.
func errAnswer(code api.Code, msg, field string) answer {
	b, _ := json.Marshal(api.ErrorResponse{Error: api.ErrorDetail{Code: code, Message: msg, Field: field}})
	return answer{status: code.Status(), body: append(b, '\n')}
}

// result is what one run printed and returned.
type result struct {
	code           int
	stdout, stderr string
}

// ctl runs the CLI with env (nil: only the test token in FLUXVM_TOKEN).
func ctl(env map[string]string, stdin string, args ...string) result {
	if env == nil {
		env = map[string]string{envToken: testToken}
	}
	var out, errb bytes.Buffer
	g := func(k string) string { return env[k] }
	code := runWithStdin(args, strings.NewReader(stdin), &out, &errb, g)
	return result{code, out.String(), errb.String()}
}

// runWithStdin is run with a stdin for apply -.
func runWithStdin(args []string, stdin io.Reader, stdout, stderr io.Writer, env func(string) string) int {
	testStdin = stdin
	defer func() { testStdin = nil }()
	return run(args, stdout, stderr, env)
}

func ptr[T any](v T) *T { return &v }

var applied = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)

func sampleServices() []fluxvm.ServiceStatus {
	return []fluxvm.ServiceStatus{
		{
			Service: fluxvm.Service{
				Name: "api", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.20")},
				Ports: []fluxvm.ServicePort{{Port: 443, Protocol: fluxvm.TCP}},
				Backends: []fluxvm.Backend{
					{Address: netip.MustParseAddr("10.1.0.1"), Port: 8443},
					{Address: netip.MustParseAddr("10.1.0.2"), Port: 8443, State: fluxvm.BackendDraining, DrainUntilUnixMs: applied.Add(time.Minute).UnixMilli()},
					{Address: netip.MustParseAddr("10.1.0.3"), Port: 8443, Enabled: ptr(false)},
				},
			},
			Revision: 7, AppliedAt: applied,
			Frontends: []fluxvm.FrontendStatus{{VIP: netip.MustParseAddrPort("10.96.0.20:443"), Protocol: fluxvm.TCP, ServiceID: 2, Eligible: 1, Backends: 3, MaglevSize: 251, GuardOpen: true},
				{VIP: netip.MustParseAddrPort("10.96.0.20:443"), Protocol: fluxvm.UDP, ServiceID: 3, Eligible: 1, Backends: 3, MaglevSize: 251, RepairPending: true}},
		},
		{
			Service: fluxvm.Service{
				Name: "web", Enabled: ptr(false),
				VIPs:  []netip.Addr{netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00::10")},
				Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}, {Port: 53, Protocol: fluxvm.UDP}},
			},
			Revision: 12, AppliedAt: applied,
		},
	}
}

// golden compares output with want, showing both on a difference.
func golden(t *testing.T, got, want string) {
	t.Helper()
	if got != want {
		t.Errorf("output:\n%s\nwant:\n%s", got, want)
	}
}

func TestTables(t *testing.T) {
	svcs := sampleServices()
	stats := fluxvm.Stats{
		Services: map[string]fluxvm.Counters{"web": {}, "api": {Packets: 10, Bytes: 1500, NewFlows: 2}},
		Drops:    map[string]uint64{"no_backend": 3, "policy_denied": 0},
		Parser:   map[string]uint64{"ha_emitted": 0},
	}
	node := newFakeNode(t, map[string]answer{
		"GET /v1/network/services":       ok(t, svcs),
		"GET /v1/network/services/api":   ok(t, svcs[0]),
		"GET /v1/network/services/stats": ok(t, stats),
		"GET /v1/network/services/health": ok(t, fluxvm.HealthReport{Services: []fluxvm.ServiceHealth{{
			Name: "api", HealthCheck: fluxvm.HealthCheck{Kind: "tcp"},
			Backends: []fluxvm.BackendHealth{{Address: netip.MustParseAddr("10.1.0.1"), Port: 8443, IntentState: fluxvm.BackendReady, Observed: "unhealthy", ConsecutiveFailures: 3, LastError: "connection refused", LastChange: applied}},
		}}}),
		"GET /v1/network/services/ha": ok(t, fluxvm.HAStatus{
			Enabled: true, Epoch: 4, Queue: fluxvm.HAQueueStatus{Read: 9},
			Journals: map[string]ha.JournalStats{"api": {Journal: "j1", Epoch: 4, FirstSeq: 1, LastSeq: 5, Acked: 3, Batches: 5, Ops: 40}},
			Cursors:  map[string]ha.Cursor{"api": {Journal: "p1", Seq: 17, Epoch: 3}},
		}),
		"GET /v1/vms/vm-1/network/services/stats": ok(t, fluxvm.VMStats{VMID: "vm-1", Interfaces: []string{"tap1"}, Counters: fluxvm.Counters{Packets: 4, Bytes: 400}}),
	})
	addr := []string{"-addr", node.URL}
	tests := []struct {
		name string
		args []string
		path string
		want string
	}{
		{"services", []string{"services"}, "/v1/network/services", "" +
			"NAME  ENABLED  VIPS                 PORTS          BACKENDS  REVISION\n" +
			"api   yes      10.96.0.20           443/tcp        1/3       7\n" +
			"web   no       10.96.0.10,fd00::10  80/tcp,53/udp  0/0       12\n"},
		{"service", []string{"service", "api"}, "/v1/network/services/api", "" +
			"Name:      api\n" +
			"Enabled:   yes\n" +
			"Exposure:  -\n" +
			"Mode:      -\n" +
			"VIPs:      10.96.0.20\n" +
			"Ports:     443/tcp\n" +
			"Backends:  1 ready of 3\n" +
			"Revision:  7\n" +
			"Applied:   2026-11-30T12:00:00Z\n" +
			"\n" +
			"FRONTEND        PROTO  ID  ELIGIBLE  BACKENDS  MAGLEV  OPEN\n" +
			"10.96.0.20:443  tcp    2   1         3         251     yes\n" +
			"10.96.0.20:443  udp    3   1         3         251     no (repair pending)\n" +
			"\n" +
			"BACKEND        WEIGHT  ENABLED  STATE     DRAIN UNTIL\n" +
			"10.1.0.1:8443  1       yes      ready     -\n" +
			"10.1.0.2:8443  1       yes      draining  2026-11-30T12:01:00Z\n" +
			"10.1.0.3:8443  1       no       ready     -\n"},
		{"stats nonzero", []string{"stats"}, "/v1/network/services/stats", "" +
			"SERVICE  PACKETS  BYTES  REPLY PKTS  REPLY BYTES  NEW FLOWS  FAILOVERS  DROPS\n" +
			"api      10       1500   0           0            2          0          0\n" +
			"\n" +
			"DROP REASON  COUNT\n" +
			"no_backend   3\n" +
			"\n" +
			"EVENT  COUNT\n"},
		{"stats all", []string{"stats", "-all"}, "/v1/network/services/stats", "" +
			"SERVICE  PACKETS  BYTES  REPLY PKTS  REPLY BYTES  NEW FLOWS  FAILOVERS  DROPS\n" +
			"api      10       1500   0           0            2          0          0\n" +
			"web      0        0      0           0            0          0          0\n" +
			"\n" +
			"DROP REASON    COUNT\n" +
			"no_backend     3\n" +
			"policy_denied  0\n" +
			"\n" +
			"EVENT       COUNT\n" +
			"ha_emitted  0\n"},
		{"stats vm", []string{"stats", "-vm", "vm-1"}, "/v1/vms/vm-1/network/services/stats", "" +
			"VM:          vm-1\n" +
			"Interfaces:  tap1\n" +
			"\n" +
			"PACKETS  BYTES  REPLY PKTS  REPLY BYTES  NEW FLOWS  FAILOVERS  DROPS\n" +
			"4        400    0           0            0          0          0\n"},
		{"health", []string{"health"}, "/v1/network/services/health", "" +
			"SERVICE  BACKEND        INTENT  OBSERVED   SUCCESSES  FAILURES  LAST CHANGE           LAST ERROR\n" +
			"api      10.1.0.1:8443  ready   unhealthy  0          3         2026-11-30T12:00:00Z  connection refused\n"},
		{"ha", []string{"ha"}, "/v1/network/services/ha", "" +
			"Replication:  on, epoch 4\n" +
			"Queue:        read 9, skipped 0, dropped 0\n" +
			"GC deletes:   0\n" +
			"\n" +
			"SERVICE  JOURNAL  EPOCH  FENCED  FIRST  LAST  ACKED  BATCHES  OPS  OPEN OPS  DROPPED BATCHES\n" +
			"api      j1       4      no      1      5     3      5        40   0         0\n" +
			"\n" +
			"SERVICE  CURSOR JOURNAL  SEQ  EPOCH\n" +
			"api      p1              17   3\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := ctl(nil, "", append(addr, tt.args...)...)
			if r.code != 0 {
				t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
			}
			got := node.last(t)
			if got.method != http.MethodGet || got.path != tt.path || got.auth != "Bearer "+testToken {
				t.Errorf("request %+v, want GET %s with the token", got, tt.path)
			}
			golden(t, r.stdout, tt.want)
		})
	}
}

// TestTablesDecode runs the commands whose tables are checked by
// content only: they decode the SDK's types and name what matters.
func TestTablesDecode(t *testing.T) {
	gcAt := applied
	node := newFakeNode(t, map[string]answer{
		"GET /v1/network/services/status": ok(t, fluxvm.Status{
			SchemaVersion: 6, Generation: 3, Tier: "M", PinRoot: "/sys/fs/bpf/fluxvm", Services: 2, Seeds: fluxvm.SeedStatus{FlowHash: 777, Maglev: 42},
			Load: fluxvm.LoadStatus{Features: []string{"flow_records", "edt"}},
			SNAT: fluxvm.SNATStatus{Address4: netip.MustParseAddr("192.0.2.1"), PortMin: 32768, PortMax: 60999},
			Interfaces: []fluxvm.InterfaceStatus{{Name: "eth0", Kind: "north-south", Index: 2, Hooks: []fluxvm.HookStatus{{Hook: "ns_in", Mode: "tcx"}}, XDP: "native"},
				{Name: "eth1", Kind: "north-south", Index: 3, Hooks: []fluxvm.HookStatus{{Hook: "ns_in", Mode: "tcx"}}, XDP: "off", XDPProblem: "rx-vlan-hw-parse on"}},
			HA:     fluxvm.HAStatus{Enabled: true, Epoch: 9, SupersededBy: 10},
			LastGC: &fluxvm.GCResult{At: gcAt, Scanned: 100, Expired: 5},
			Pressure: &fluxvm.PressureStatus{SoftPercent: 80, HardPercent: 95, Level: "soft", Rounds: 2, Maps: map[string]fluxvm.MapPressure{
				"fluxvm_fct4": {Entries: 55000, MaxEntries: 65536, Percent: 83.9}, "fluxvm_nat4": {Percent: 12.5}, "fluxvm_sock_fwd": {Percent: 99}}},
		}),
		"GET /v1/network/services/advertisements": ok(t, advert.Snapshot{SchemaVersion: 1, Generation: 5, Node: "edge-1", Timestamp: applied,
			Entries: []advert.Entry{{VIP: netip.MustParseAddr("198.51.100.7"), Prefix: netip.MustParsePrefix("198.51.100.7/32"), Family: advert.FamilyIPv4, Service: "web",
				Ports: []advert.Port{{Port: 80, Protocol: "tcp"}}, Advertised: false, Reason: "no_ready_backend"}}}),
		"GET /v1/network/services/policies": ok(t, fluxvm.PoliciesStatus{IPCachePrefixes: 12, IPCacheRevision: 3,
			Policies: []fluxvm.PolicyStatus{{Service: "web", Enabled: true, Revision: 2, DefaultAction: fluxvm.PolicyDeny, AllowIdentities: []fluxvm.Identity{100, 200}, Rules: 4}}}),
		"GET /v1/network/services/web/policy": ok(t, fluxvm.PolicyStatus{Service: "web", Enabled: true, Revision: 2, DefaultAction: fluxvm.PolicyAllow, DenyIdentities: []fluxvm.Identity{7}}),
		"GET /v1/network/services/flows": ok(t, api.FlowsResponse{Limit: 10, Records: []flows.Record{{Seq: 1, Service: "web", Protocol: "tcp",
			Client: netip.MustParseAddrPort("10.0.0.5:40000"), VIP: netip.MustParseAddrPort("10.96.0.10:80"), Backend: netip.MustParseAddrPort("10.1.0.1:8080"),
			Verdict: flows.Forwarded, Hook: "from_vm", LastSeen: applied, Forward: flows.Counts{Packets: 3, Bytes: 180}}}}),
	})
	tests := []struct {
		args  []string
		path  string
		query string
		wants []string
	}{
		{[]string{"status"}, "/v1/network/services/status", "", []string{
			"Schema:           6\n", "Tier:             M\n", "Features:         flow_records, edt\n", "Seeds:            hash_seed=0x309 maglev_seed=0x2a\n", "SNAT:             192.0.2.1 ports 32768-60999\n",
			"HA:               on, epoch 9, FENCED (superseded by epoch 10)\n",
			"Map pressure:     soft (soft 80%, hard 95%), fullest fluxvm_fct4 83.9%, 2 rounds\n", "Last GC:          2026-11-30T12:00:00Z, 100 scanned, 5 expired\n",
			"eth0       north-south  2        -   ns_in/tcx  native  -\n", "eth1       north-south  3        -   ns_in/tcx  off     xdp off: rx-vlan-hw-parse on\n"}},
		{[]string{"advertisements"}, "/v1/network/services/advertisements", "", []string{
			"Generation:  5\n", "Node:        edge-1\n", "198.51.100.7  198.51.100.7/32  web      -         80/tcp  no          no_ready_backend\n"}},
		{[]string{"policies"}, "/v1/network/services/policies", "", []string{
			"IPCache:   12 prefixes, revision 3\n", "web      yes      2         deny     100,200  -     no          4      -           -   0       0\n"}},
		{[]string{"policy", "web"}, "/v1/network/services/web/policy", "", []string{
			"Default action:    allow\n", "Deny identities:   7\n"}},
		{[]string{"flows", "-service", "web", "-verdict", "forwarded", "-backend", "10.1.0.1", "-limit", "10", "-since", "2026-11-30T11:00:00Z"},
			"/v1/network/services/flows", "backend=10.1.0.1&limit=10&service=web&since=2026-11-30T11%3A00%3A00Z&verdict=forwarded", []string{
				"2026-11-30T12:00:00Z  web      tcp    10.0.0.5:40000  10.96.0.10:80  10.1.0.1:8080  forwarded  -       3     180    0           0\n"}},
		{[]string{"flows"}, "/v1/network/services/flows", "", []string{"LAST SEEN"}},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := ctl(nil, "", append([]string{"-addr", node.URL}, tt.args...)...)
			if r.code != 0 {
				t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
			}
			got := node.last(t)
			if got.method != http.MethodGet || got.path != tt.path || got.query != tt.query {
				t.Errorf("request %s %s?%s, want GET %s?%s", got.method, got.path, got.query, tt.path, tt.query)
			}
			for _, w := range tt.wants {
				if !strings.Contains(r.stdout, w) {
					t.Errorf("output lacks %q:\n%s", w, r.stdout)
				}
			}
		})
	}
}

func TestJSONOutput(t *testing.T) {
	svcs := sampleServices()
	node := newFakeNode(t, map[string]answer{"GET /v1/network/services": ok(t, svcs)})
	want, err := json.MarshalIndent(svcs, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"-addr", node.URL, "-o", "json", "services"},
		{"-addr", node.URL, "services", "-o", "json"}, // global flags after the command
	} {
		r := ctl(nil, "", args...)
		if r.code != 0 {
			t.Fatalf("%v: exit %d, stderr %q", args, r.code, r.stderr)
		}
		golden(t, r.stdout, string(want)+"\n")
	}
}

func TestMutations(t *testing.T) {
	svcs := sampleServices()
	node := newFakeNode(t, map[string]answer{
		"POST /v1/network/services":                  ok(t, svcs[0]),
		"DELETE /v1/network/services/web":            {status: http.StatusNoContent},
		"POST /v1/network/services/conntrack/gc":     ok(t, fluxvm.GCResult{At: applied, Duration: 2 * time.Millisecond, Scanned: 50, Expired: 4}),
		"POST /v1/network/services/health/reconcile": ok(t, fluxvm.HealthReport{Services: []fluxvm.ServiceHealth{}}),
	})
	svcJSON := `{"name":"api","vips":["10.96.0.20"],"ports":[{"port":443,"protocol":"tcp"}],"backends":[]}`
	file := filepath.Join(t.TempDir(), "api.json")
	if err := os.WriteFile(file, []byte(svcJSON), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name         string
		args         []string
		stdin        string
		method, path string
		body         string
		wants        []string
	}{
		{"apply file", []string{"apply", file}, "", "POST", "/v1/network/services", svcJSON, []string{"applied service api, revision 7\n", "Backends:  1 ready of 3\n"}},
		{"apply stdin", []string{"apply", "-"}, svcJSON, "POST", "/v1/network/services", svcJSON, []string{"applied service api, revision 7\n"}},
		{"delete", []string{"delete", "web"}, "", "DELETE", "/v1/network/services/web", "", []string{"deleted service web\n"}},
		{"delete json", []string{"-o", "json", "delete", "web"}, "", "DELETE", "/v1/network/services/web", "", nil},
		{"gc", []string{"gc"}, "", "POST", "/v1/network/services/conntrack/gc", "", []string{"Duration:         2ms\n", "Scanned:          50\n", "Expired:          4\n"}},
		{"health-reconcile", []string{"health-reconcile"}, "", "POST", "/v1/network/services/health/reconcile", "", []string{"SERVICE  BACKEND"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := ctl(nil, tt.stdin, append([]string{"-addr", node.URL}, tt.args...)...)
			if r.code != 0 {
				t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
			}
			got := node.last(t)
			if got.method != tt.method || got.path != tt.path || got.body != tt.body || got.auth != "Bearer "+testToken {
				t.Errorf("request %+v, want %s %s body %q", got, tt.method, tt.path, tt.body)
			}
			if tt.body != "" && got.ctype != "application/json" {
				t.Errorf("Content-Type %q", got.ctype)
			}
			for _, w := range tt.wants {
				if !strings.Contains(r.stdout, w) {
					t.Errorf("output lacks %q:\n%s", w, r.stdout)
				}
			}
			if tt.wants == nil && r.stdout != "" {
				t.Errorf("output %q, want none", r.stdout)
			}
		})
	}
}

func TestErrors(t *testing.T) {
	node := newFakeNode(t, map[string]answer{
		"GET /v1/network/services/nope":   errAnswer(api.CodeNotFound, `service "nope" not found`, ""),
		"POST /v1/network/services":       errAnswer(api.CodeInvalidRequest, "backends[1].port: must be 1..65535", "backends[1].port"),
		"DELETE /v1/network/services/web": errAnswer(api.CodeForbidden, "this route needs an admin token", ""),
		"GET /v1/network/services/status": {status: http.StatusBadGateway, body: []byte("bad gateway\n")},
	})
	file := filepath.Join(t.TempDir(), "svc.json")
	if err := os.WriteFile(file, []byte(`{}`), 0o600); err != nil {
		t.Fatal(err)
	}
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()

	tests := []struct {
		name   string
		env    map[string]string
		args   []string
		code   int
		stderr string // a substring; "" checks the code only
	}{
		{"not found", nil, []string{"-addr", node.URL, "service", "nope"}, 1, "fluxvmctl: not_found: service \"nope\" not found\n"},
		{"field", nil, []string{"-addr", node.URL, "apply", file}, 1, "fluxvmctl: invalid_request: backends[1].port: must be 1..65535 (field backends[1].port)\n"},
		{"forbidden", nil, []string{"-addr", node.URL, "delete", "web"}, 1, "fluxvmctl: forbidden: this route needs an admin token\n"},
		{"not the API's body", nil, []string{"-addr", node.URL, "status"}, 1, "502 Bad Gateway: bad gateway"},
		{"unreachable", nil, []string{"-addr", deadURL, "services"}, 1, "node " + deadURL + " unreachable"},
		{"apply missing file", nil, []string{"-addr", node.URL, "apply", "/nonexistent/svc.json"}, 1, "read the service"},
		{"unknown command", nil, []string{"frobnicate"}, 2, `unknown command "frobnicate"`},
		{"no command", nil, nil, 2, "usage: fluxvmctl"},
		{"missing argument", nil, []string{"service"}, 2, "usage: fluxvmctl service NAME"},
		{"reserved name", nil, []string{"-addr", node.URL, "service", "status"}, 2, `"status" is reserved for a route`},
		{"extra argument", nil, []string{"services", "web"}, 2, "services takes no argument"},
		{"bad output", nil, []string{"-o", "yaml", "services"}, 2, `-o "yaml": want table or json`},
		{"bad flag", nil, []string{"stats", "-bogus"}, 2, "flag provided but not defined: -bogus"},
		{"bad addr", nil, []string{"-addr", "ftp://x", "services"}, 2, "want http://host:port"},
		{"bad timeout", nil, []string{"-addr", node.URL, "-timeout", "0s", "services"}, 2, "-timeout must be positive"},
		{"no token", map[string]string{}, []string{"-addr", node.URL, "services"}, 2, "no token"},
		{"negative since", nil, []string{"-addr", node.URL, "flows", "-since", "-5m"}, 2, "must not be negative"},
		{"help", nil, []string{"-h"}, 0, "commands:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := ctl(tt.env, "", tt.args...)
			if r.code != tt.code {
				t.Errorf("exit %d, want %d; stderr %q", r.code, tt.code, r.stderr)
			}
			if !strings.Contains(r.stderr, tt.stderr) {
				t.Errorf("stderr %q lacks %q", r.stderr, tt.stderr)
			}
			if tt.code != 0 && r.stdout != "" {
				t.Errorf("stdout %q on an error", r.stdout)
			}
		})
	}
}

func TestTokenResolution(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "token")
	if err := os.WriteFile(file, []byte("# the admin token\n\n  from-file  \nsecond\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("# nothing\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	all := map[string]string{envToken: "tok", envAdminToken: "admin", envReadToken: "read"}
	tests := []struct {
		name string
		file string
		env  map[string]string
		want string // "": an error
	}{
		{"file over env", file, all, "from-file"},
		{"FLUXVM_TOKEN first", "", all, "tok"},
		{"then the admin token", "", map[string]string{envAdminToken: "admin", envReadToken: "read"}, "admin"},
		{"then the read token", "", map[string]string{envReadToken: "read"}, "read"},
		{"none", "", map[string]string{}, ""},
		{"empty file", empty, all, ""},
		{"missing file", filepath.Join(dir, "nope"), all, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tokenFrom(tt.file, func(k string) string { return tt.env[k] })
			if tt.want == "" {
				if err == nil {
					t.Fatalf("token %q, want an error", got)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("token %q, %v; want %q", got, err, tt.want)
			}
		})
	}

	// End to end: the header carries the token of the file.
	node := newFakeNode(t, map[string]answer{"GET /v1/network/services": ok(t, []fluxvm.ServiceStatus{})})
	if r := ctl(all, "", "-addr", node.URL, "-token-file", file, "services"); r.code != 0 {
		t.Fatalf("exit %d: %s", r.code, r.stderr)
	}
	if got := node.last(t).auth; got != "Bearer from-file" {
		t.Errorf("Authorization %q", got)
	}
}

func TestAddr(t *testing.T) {
	node := newFakeNode(t, map[string]answer{"GET /v1/network/services": ok(t, []fluxvm.ServiceStatus{})})
	host := strings.TrimPrefix(node.URL, "http://")
	tests := []struct {
		name string
		env  map[string]string
		args []string
	}{
		{"FLUXVM_ADDR", map[string]string{envToken: testToken, envAddr: node.URL}, []string{"services"}},
		{"flag over env", map[string]string{envToken: testToken, envAddr: "http://127.0.0.1:1"}, []string{"-addr", node.URL, "services"}},
		{"host:port", nil, []string{"-addr", host, "services"}},
		{"trailing slash", nil, []string{"-addr", node.URL + "/", "services"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := ctl(tt.env, "", tt.args...)
			if r.code != 0 {
				t.Fatalf("exit %d: %s", r.code, r.stderr)
			}
			if got := node.last(t).path; got != "/v1/network/services" {
				t.Errorf("path %q", got)
			}
		})
	}
}

func TestCAFile(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("[]\n"))
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshake refused without -ca-file
	srv.StartTLS()
	defer srv.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	if err := os.WriteFile(ca, pemBytes, 0o600); err != nil {
		t.Fatal(err)
	}
	if r := ctl(nil, "", "-addr", srv.URL, "-ca-file", ca, "services"); r.code != 0 {
		t.Fatalf("with -ca-file: exit %d: %s", r.code, r.stderr)
	}
	if r := ctl(nil, "", "-addr", srv.URL, "services"); r.code != 1 || !strings.Contains(r.stderr, "certificate") {
		t.Fatalf("without -ca-file: exit %d: %s", r.code, r.stderr)
	}
}

func TestParseSince(t *testing.T) {
	now := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	tests := []struct{ in, want string }{
		{"5m", "2026-12-01T09:55:00Z"},
		{"1h30m", "2026-12-01T08:30:00Z"},
		{"2026-11-30T11:00:00Z", "2026-11-30T11:00:00Z"},
	}
	for _, tt := range tests {
		got, err := parseSince(tt.in, now)
		if err != nil || got != tt.want {
			t.Errorf("parseSince(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
}
