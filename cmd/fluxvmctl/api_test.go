package main

import (
	"bytes"
	"context"
	"io"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
)

// stubDataplane answers the read routes and the argument-less mutations
// of the real REST handler (stubHA its replication routes); the methods
// it does not override panic (the embedded role interfaces are nil), so a
// command calling another route fails the test.
type stubDataplane struct {
	api.ServiceStore
	api.Observer
	api.Admin
	api.FlowReader
	api.PolicyStore
	api.Snapshots
	services []fluxvm.ServiceStatus
}

// roles are the stub's roles, stubHA for replication.
func (d *stubDataplane) roles() api.Roles {
	return api.Roles{Services: d, Observer: d, Admin: d, Flows: d, Policies: d, Snapshots: d, Replication: stubHA{}}
}

// stubHA is the replication of stubDataplane.
type stubHA struct{}

func (d *stubDataplane) Services() []fluxvm.ServiceStatus { return d.services }
func (d *stubDataplane) Service(name string) (fluxvm.ServiceStatus, error) {
	for _, s := range d.services {
		if s.Service.Name == name {
			return s, nil
		}
	}
	return fluxvm.ServiceStatus{}, fluxvm.ErrNotFound
}
func (d *stubDataplane) DeleteService(_ context.Context, name string) error {
	_, err := d.Service(name)
	return err
}
func (d *stubDataplane) Status() fluxvm.Status {
	return fluxvm.Status{SchemaVersion: 6, Tier: "S", Pressure: &fluxvm.PressureStatus{SoftPercent: 80, HardPercent: 95, Level: "ok",
		Maps: map[string]fluxvm.MapPressure{"fluxvm_fct4": {Entries: 10, MaxEntries: 100, Percent: 10}}}}
}
func (d *stubDataplane) Stats(context.Context) (fluxvm.Stats, error) { return fluxvm.Stats{}, nil }
func (d *stubDataplane) Health() fluxvm.HealthReport                 { return fluxvm.HealthReport{} }
func (d *stubDataplane) Advertisements() advert.Snapshot             { return advert.Snapshot{SchemaVersion: 1} }
func (stubHA) Status() fluxvm.HAStatus                               { return fluxvm.HAStatus{} }
func (d *stubDataplane) Flows(context.Context, int, flows.Filter) ([]flows.Record, error) {
	return nil, nil
}
func (d *stubDataplane) Policies(context.Context) (fluxvm.PoliciesStatus, error) {
	return fluxvm.PoliciesStatus{}, nil
}
func (d *stubDataplane) GC(context.Context) (fluxvm.GCResult, error) {
	return fluxvm.GCResult{Scanned: 1}, nil
}
func (d *stubDataplane) ReconcileHealth(context.Context) (fluxvm.HealthReport, error) {
	return fluxvm.HealthReport{}, nil
}

func (d *stubDataplane) ReconcilePressure(context.Context) (fluxvm.PressureRound, error) {
	return fluxvm.PressureRound{At: applied, Level: "hard", Over: []string{"fluxvm_fct4"},
		Compaction: &fluxvm.PressureCompaction{Deferred: "an HA import is writing the flow maps"}}, nil
}

// ApplyPolicies reports the policies it is given (none: a reconcile).
func (d *stubDataplane) ApplyPolicies(_ context.Context, ps ...fluxvm.Policy) (fluxvm.PoliciesStatus, error) {
	st := fluxvm.PoliciesStatus{IPCacheRevision: 1}
	for _, p := range ps {
		st.Policies = append(st.Policies, fluxvm.PolicyStatus{Service: p.Service, Enabled: p.IsEnabled(), DefaultAction: p.DefaultAction, AllowIdentities: p.AllowIdentities})
	}
	return st, nil
}
func (d *stubDataplane) DeletePolicy(_ context.Context, name string) error {
	if name != "api" {
		return fluxvm.ErrNotFound
	}
	return nil
}
func (d *stubDataplane) Envoy(name string) (fluxvm.EnvoyDocument, error) {
	if name != "api" {
		return fluxvm.EnvoyDocument{}, fluxvm.ErrNotFound
	}
	return fluxvm.EnvoyDocument{Service: name, Mode: fluxvm.L7Observe, Protocol: fluxvm.L7HTTP, Revision: 3}, nil
}
func (stubHA) UpdateLease(_ context.Context, l fluxvm.HALease) (fluxvm.HAStatus, error) {
	return fluxvm.HAStatus{Enabled: true, Epoch: l.Epoch, SupersededBy: l.SupersededBy}, nil
}

func (stubHA) Join(context.Context) (fluxvm.HAStatus, error) {
	return fluxvm.HAStatus{Enabled: true, Group: true, Joined: true}, nil
}

// snapshotBytes is what the stub's ExportFlows streams.
var snapshotBytes = bytes.Repeat([]byte("FXVMHA-snapshot-"), 4096)

func (d *stubDataplane) ExportFlows(_ context.Context, name string, w io.Writer) (ha.ExportResult, error) {
	if _, err := d.Service(name); err != nil {
		return ha.ExportResult{}, err
	}
	_, err := w.Write(snapshotBytes)
	return ha.ExportResult{Flows: 3, Expired: 1}, err
}

// ImportFlows counts the bytes of the stream as its flows.
func (d *stubDataplane) ImportFlows(_ context.Context, name string, r io.Reader, prune bool) (ha.ImportResult, error) {
	n, err := io.Copy(io.Discard, r)
	res := ha.ImportResult{Header: ha.Header{Service: name, Node: "edge-2", Epoch: 4}, Flows: uint64(n), Written: uint64(n)}
	if prune {
		res.Pruned = 1
	}
	return res, err
}
func (stubHA) FlowDelta(_ context.Context, service string, req fluxvm.FlowDeltaRequest) (ha.Delta, error) {
	journal, seq, maxOps := req.Journal, req.Seq, req.MaxOps
	if journal == "" {
		return ha.Delta{Service: service, Journal: "j1", Epoch: 4, From: seq, To: seq, ResetRequired: true}, nil
	}
	ops := []ha.Op{{Kind: ha.OpDelete}, {Kind: ha.OpDelete}}
	return ha.Delta{Service: service, Journal: journal, Epoch: 4, From: seq, To: seq + 1,
		Batches: []ha.Batch{{Seq: seq + 1, Epoch: 4, Ops: ops[:min(maxOps, len(ops))]}}}, nil
}
func (stubHA) ImportFlowDelta(_ context.Context, _ string, dl ha.Delta) (fluxvm.HADeltaResult, error) {
	n := 0
	for _, b := range dl.Batches {
		n += len(b.Ops)
	}
	return fluxvm.HADeltaResult{Cursor: ha.Cursor{Journal: dl.Journal, Seq: dl.To, Epoch: dl.Epoch}, Applied: ha.ImportResult{Flows: uint64(n)}}, nil
}
func (stubHA) AckFlowDelta(_ context.Context, _ string, seq uint64) (ha.JournalStats, error) {
	return ha.JournalStats{Journal: "j1", Epoch: 4, LastSeq: seq + 2, Acked: seq}, nil
}

// stubExporter takes every record.
type stubExporter struct{}

func (stubExporter) Export(_ context.Context, recs []flows.Record) (otlp.Report, error) {
	return otlp.Report{Records: len(recs), Batches: 1, Encoding: "proto"}, nil
}

// TestRealHandler runs the commands against the real api.New handler:
// their routes, methods, bodies and tokens are the ones it serves, and
// its access levels and error bodies reach the CLI as documented.
func TestRealHandler(t *testing.T) {
	h, err := api.New((&stubDataplane{services: sampleServices()}).roles(), api.Options{AdminTokens: []string{"admin-token"}, ReadTokens: []string{"read-token"}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	read := map[string]string{envReadToken: "read-token"}
	admin := map[string]string{envAdminToken: "admin-token"}
	tests := []struct {
		env    map[string]string
		args   []string
		code   int
		stdout string // a substring
		stderr string // a substring
	}{
		{read, []string{"services"}, 0, "api   yes", ""},
		{read, []string{"service", "api"}, 0, "Backends:  1 ready of 3", ""},
		{read, []string{"service", "nope"}, 1, "", "fluxvmctl: not_found: "},
		{read, []string{"status"}, 0, "Tier:", ""},
		{read, []string{"stats", "-all"}, 0, "SERVICE", ""},
		{read, []string{"health"}, 0, "SERVICE", ""},
		{read, []string{"flows", "-verdict", "dropped", "-limit", "5", "-since", "1m"}, 0, "LAST SEEN", ""},
		{read, []string{"flows", "-verdict", "bogus"}, 1, "", "fluxvmctl: invalid_request: verdict: "},
		{read, []string{"flows", "-limit", "0"}, 1, "", "(field limit)"},
		{read, []string{"advertisements"}, 0, "Generation:", ""},
		{read, []string{"policies"}, 0, "IPCache:", ""},
		{read, []string{"ha"}, 0, "Replication:  off", ""},
		{read, []string{"gc"}, 1, "", "fluxvmctl: forbidden: this route needs an admin token"},
		{admin, []string{"gc"}, 0, "Scanned:", ""},
		{admin, []string{"health-reconcile"}, 0, "SERVICE", ""},
		{admin, []string{"delete", "web"}, 0, "deleted service web", ""},
		{map[string]string{envToken: "wrong"}, []string{"services"}, 1, "", "fluxvmctl: unauthorized: invalid bearer token"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := ctl(tt.env, "", append([]string{"-addr", srv.URL}, tt.args...)...)
			if r.code != tt.code || !strings.Contains(r.stdout, tt.stdout) || !strings.Contains(r.stderr, tt.stderr) {
				t.Errorf("exit %d, stdout %q, stderr %q; want exit %d, %q, %q", r.code, r.stdout, r.stderr, tt.code, tt.stdout, tt.stderr)
			}
		})
	}
}

// TestRealHandlerMore runs the commands of the other routes (policies,
// pressure, lease, transfer, telemetry) against the real api.New
// handler.
func TestRealHandlerMore(t *testing.T) {
	h, err := api.New((&stubDataplane{services: sampleServices()}).roles(), api.Options{AdminTokens: []string{"admin-token"}, ReadTokens: []string{"read-token"}, Exporter: stubExporter{}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	read := map[string]string{envReadToken: "read-token"}
	admin := map[string]string{envAdminToken: "admin-token"}
	dir := t.TempDir()
	policy := filepath.Join(dir, "policy.json")
	if err := os.WriteFile(policy, []byte(`{"service":"api","default_action":"deny","allow_identities":[1001],"deny_identities":[]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	snap := filepath.Join(dir, "api.fxvmha")
	tests := []struct {
		env    map[string]string
		stdin  string
		args   []string
		code   int
		stdout string // a substring
		stderr string // a substring
	}{
		{admin, "", []string{"policies", "apply", policy}, 0, "api      yes      0         deny     1001", ""},
		{admin, `[{"service":"api","default_action":"allow"},{"service":"web","default_action":"deny"}]`, []string{"policies", "apply", "-"}, 0, "the node holds 2 policies", ""},
		{admin, `{"service":"nope","default_action":"deny"}`, []string{"policies", "apply", "-"}, 1, "", "fluxvmctl: missing_prerequisite: service: service \"nope\" does not exist"},
		{read, "", []string{"policies", "apply", policy}, 1, "", "forbidden"},
		{admin, "", []string{"policies", "reconcile"}, 0, "IPCache:   0 prefixes, revision 1", ""},
		{admin, "", []string{"policy", "delete", "api"}, 0, "deleted the policy of service api", ""},
		{admin, "", []string{"policy", "delete", "web"}, 1, "", "fluxvmctl: not_found: "},
		{read, "", []string{"envoy", "api"}, 0, `"service": "api",` + "\n" + `  "mode": "observe"`, ""},
		{read, "", []string{"envoy", "web"}, 1, "", "fluxvmctl: not_found: "},
		{read, "", []string{"pressure"}, 0, "fluxvm_fct4  10       100  10.0%", ""},
		{read, "", []string{"-o", "json", "pressure"}, 0, `"soft_percent": 80`, ""},
		{admin, "", []string{"pressure", "reconcile"}, 0, "Compaction:  deferred: an HA import is writing the flow maps (0s)", ""},
		{admin, "", []string{"ha", "lease", "-epoch", "5"}, 0, "Replication:  on, epoch 5", ""},
		{admin, "", []string{"ha", "lease", "-superseded-by", "9"}, 0, "FENCED (superseded by epoch 9)", ""},
		{read, "", []string{"conntrack", "export", "api", "-out", snap}, 0, "exported 3 flows of api (65536 bytes) to " + snap + "; left out: 1 expired", ""},
		{read, "", []string{"-o", "json", "conntrack", "export", "api", "-out", snap}, 0, `"flows": 3`, ""},
		{read, "", []string{"conntrack", "export", "nope", "-out", snap + ".2"}, 1, "", "fluxvmctl: not_found: "},
		{admin, "", []string{"conntrack", "import", "api", snap, "-prune"}, 0, "Flows read:      65536", ""},
		{admin, "", []string{"conntrack", "import", "api", snap, "-prune"}, 0, "Pruned:          1", ""},
		{admin, "some bytes", []string{"conntrack", "import", "api", "-"}, 0, "Source node:     edge-2", ""},
		{read, "", []string{"conntrack", "import", "api", snap}, 1, "", "forbidden"},
		{read, "", []string{"delta", "api", "-journal", "j1", "-seq", "5", "-max-ops", "1"}, 0, "6    4      1    0        1", ""},
		{read, "", []string{"delta", "api"}, 0, "Reset required:  YES", ""},
		{admin, `{"service":"api","journal":"j1","epoch":4,"from":5,"to":6,"batches":[{"seq":6,"epoch":4,"ops":[]}]}`, []string{"delta", "import", "api", "-"}, 0, "Cursor:          journal j1, seq 6, epoch 4", ""},
		{admin, `{"service":"web","journal":"j1","epoch":4,"from":5,"to":6}`, []string{"delta", "import", "api", "-"}, 1, "", "fluxvmctl: service_mismatch: "},
		{admin, "", []string{"delta", "ack", "api", "6"}, 0, "api      j1       4      no      0      8     6", ""},
		{admin, "", []string{"telemetry", "export", "-limit", "10"}, 0, "Read:      0", ""},
		{read, "", []string{"telemetry", "export"}, 1, "", "forbidden"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := ctl(tt.env, tt.stdin, append([]string{"-addr", srv.URL}, tt.args...)...)
			if r.code != tt.code || !strings.Contains(r.stdout, tt.stdout) || !strings.Contains(r.stderr, tt.stderr) {
				t.Errorf("exit %d, stdout %q, stderr %q; want exit %d, %q, %q", r.code, r.stdout, r.stderr, tt.code, tt.stdout, tt.stderr)
			}
		})
	}
	if got, err := os.ReadFile(snap); err != nil || !bytes.Equal(got, snapshotBytes) {
		t.Errorf("the exported file holds %d bytes (%v), want the %d of the stream", len(got), err, len(snapshotBytes))
	}
	if _, err := os.Stat(snap + ".2"); !os.IsNotExist(err) {
		t.Errorf("a failed export left %s: %v", snap+".2", err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "*.partial")); len(left) != 0 {
		t.Errorf("partial files left: %v", left)
	}

	// A delta, as -o json prints it, is what delta import takes.
	d := ctl(read, "", "-addr", srv.URL, "-o", "json", "delta", "api", "-journal", "j7", "-seq", "41")
	if d.code != 0 {
		t.Fatalf("delta: exit %d: %s", d.code, d.stderr)
	}
	imp := ctl(admin, d.stdout, "-addr", srv.URL, "delta", "import", "api", "-")
	if imp.code != 0 || !strings.Contains(imp.stdout, "journal j7, seq 42, epoch 4") || !strings.Contains(imp.stdout, "Flows read:      2") {
		t.Errorf("delta import of the delta: exit %d, stdout %q, stderr %q", imp.code, imp.stdout, imp.stderr)
	}
}
