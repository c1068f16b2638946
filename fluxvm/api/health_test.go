package api_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/health"
)

func sampleHealth() fluxvm.HealthReport {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	check := at.Add(time.Second)
	return fluxvm.HealthReport{Services: []fluxvm.ServiceHealth{{
		Name:        "web",
		HealthCheck: fluxvm.HealthCheck{Kind: "tcp", TimeoutMs: 1000, IntervalMs: 2000, UnhealthyThreshold: 3, HealthyThreshold: 2},
		Backends: []fluxvm.BackendHealth{
			{Address: netip.MustParseAddr("10.40.1.21"), Port: 8080, IntentState: fluxvm.BackendReady,
				Observed: health.Healthy, ConsecutiveSuccesses: 4, LastChange: at, LastCheck: &check, EffectiveState: fluxvm.BackendReady},
			{Address: netip.MustParseAddr("10.40.1.22"), Port: 8080, IntentState: fluxvm.BackendReady,
				Observed: health.Unhealthy, ConsecutiveFailures: 3, LastError: "dial tcp 10.40.1.22:8080: connect: connection refused",
				LastChange: at, LastCheck: &check, EffectiveState: fluxvm.BackendUnhealthy},
		},
	}}}
}

func TestHealthReport(t *testing.T) {
	e := newEnv(t)
	// No health-checked service: an empty list, not null.
	w := e.do(req{method: "GET", path: "/v1/network/services/health", token: readToken})
	if w.Code != 200 || strings.TrimSpace(w.Body.String()) != `{"services":[]}` {
		t.Errorf("empty report: %d %s", w.Code, w.Body)
	}
	e.dp.health = sampleHealth()
	w = e.do(req{method: "GET", path: "/v1/network/services/health", token: readToken})
	got := decodeOK[fluxvm.HealthReport](t, w, 200)
	if !reflect.DeepEqual(got, e.dp.health) {
		t.Errorf("report\n got %+v\nwant %+v", got, e.dp.health)
	}
	body := w.Body.String()
	for _, want := range []string{`"observed":"unhealthy"`, `"effective_state":"unhealthy"`, `"intent_state":"ready"`,
		`"last_change":"2026-01-02T03:04:05Z"`, `"consecutive_failures":3`, `"last_error":"dial tcp`} {
		if !strings.Contains(body, want) {
			t.Errorf("body lacks %s: %s", want, body)
		}
	}
	if e.dp.reconciles != 0 {
		t.Errorf("GET ran a round")
	}
}

func TestReconcileHealth(t *testing.T) {
	e := newEnv(t)
	e.dp.health = sampleHealth()
	const path = "/v1/network/services/health/reconcile"
	for _, r := range []req{
		{method: "POST", path: path, token: adminToken},
		{method: "POST", path: path, token: adminToken, body: "{}"},
	} {
		got := decodeOK[fluxvm.HealthReport](t, e.do(r), 200)
		if !reflect.DeepEqual(got, e.dp.health) {
			t.Errorf("report %+v", got)
		}
	}
	if e.dp.reconciles != 2 {
		t.Errorf("%d rounds, want 2", e.dp.reconciles)
	}
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: `{"service":"web"}`}), 400, api.CodeInvalidRequest, "service")
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: `{}`, contentType: "text/plain"}), 415, api.CodeUnsupportedMediaType, "")
	wantError(t, e.do(req{method: "POST", path: path, token: readToken}), 403, api.CodeForbidden, "")
	wantError(t, e.do(req{method: "GET", path: path, token: adminToken}), 405, api.CodeMethodNotAllowed, "")
	if e.dp.reconciles != 2 {
		t.Errorf("rejected requests ran a round: %d", e.dp.reconciles)
	}
	// A round cut short because the request ended is not an internal
	// error: 503, and nothing logged as one.
	for _, cause := range []error{context.Canceled, context.DeadlineExceeded} {
		e.dp.reconcileErr = fmt.Errorf("round: %w", cause)
		wantError(t, e.do(req{method: "POST", path: path, token: adminToken}), 503, api.CodeUnavailable, "")
	}
	e.dp.reconcileErr = errors.New("boom")
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken}), 500, api.CodeInternal, "")
}
