package main

import (
	"context"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// stubDataplane answers the read routes and the argument-less mutations
// of the real REST handler; the methods it does not override panic (the
// embedded interface is nil), so a command calling another route fails
// the test.
type stubDataplane struct {
	api.Dataplane
	services []fluxvm.ServiceStatus
}

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
func (d *stubDataplane) Status() fluxvm.Status           { return fluxvm.Status{SchemaVersion: 6, Tier: "S"} }
func (d *stubDataplane) Stats() (fluxvm.Stats, error)    { return fluxvm.Stats{}, nil }
func (d *stubDataplane) Health() fluxvm.HealthReport     { return fluxvm.HealthReport{} }
func (d *stubDataplane) Advertisements() advert.Snapshot { return advert.Snapshot{SchemaVersion: 1} }
func (d *stubDataplane) HAStatus() fluxvm.HAStatus       { return fluxvm.HAStatus{} }
func (d *stubDataplane) Flows(int, flows.Filter) ([]flows.Record, error) {
	return nil, nil
}
func (d *stubDataplane) Policies() (fluxvm.PoliciesStatus, error) {
	return fluxvm.PoliciesStatus{}, nil
}
func (d *stubDataplane) GC(context.Context) (fluxvm.GCResult, error) {
	return fluxvm.GCResult{Scanned: 1}, nil
}
func (d *stubDataplane) ReconcileHealth(context.Context) (fluxvm.HealthReport, error) {
	return fluxvm.HealthReport{}, nil
}

// TestRealHandler runs the commands against the real api.New handler:
// their routes, methods, bodies and tokens are the ones it serves, and
// its access levels and error bodies reach the CLI as documented.
func TestRealHandler(t *testing.T) {
	h, err := api.New(&stubDataplane{services: sampleServices()}, api.Options{AdminTokens: []string{"admin-token"}, ReadTokens: []string{"read-token"}})
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
