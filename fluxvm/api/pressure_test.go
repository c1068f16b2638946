package api_test

import (
	"errors"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

func TestReconcilePressure(t *testing.T) {
	e := newEnv(t)
	e.dp.pressureRound = fluxvm.PressureRound{
		At: time.Date(2026, 12, 2, 1, 0, 0, 0, time.UTC), Level: fluxvm.PressureSoft, Over: []string{"fluxvm_fct4"},
		After: map[string]float64{"fluxvm_fct4": 68.7}, GC: &fluxvm.GCResult{Scanned: 58000},
		Shed: conntrack.ShedCounts{Closed: 5000, HalfOpen: 3000, IdleUDP: 5000}, Horizon: fluxvm.Duration{Duration: 45 * time.Second},
	}
	const path = "/v1/network/services/pressure/reconcile"
	for _, r := range []req{
		{method: "POST", path: path, token: adminToken},
		{method: "POST", path: path, token: adminToken, body: "{}"},
	} {
		got := decodeOK[fluxvm.PressureRound](t, e.do(r), 200)
		if !reflect.DeepEqual(got, e.dp.pressureRound) {
			t.Errorf("round %+v, want %+v", got, e.dp.pressureRound)
		}
	}
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: `{"map":"fluxvm_fct4"}`}), 400, api.CodeInvalidRequest, "map")
	wantError(t, e.do(req{method: "POST", path: path, token: readToken}), 403, api.CodeForbidden, "")
	wantError(t, e.do(req{method: "GET", path: path, token: adminToken}), 405, api.CodeMethodNotAllowed, "")
	if e.dp.pressureRounds != 2 {
		t.Errorf("%d rounds, want 2 (the refused requests ran none)", e.dp.pressureRounds)
	}
	e.dp.pressureErr = fmt.Errorf("fluxvm: pressure: %w", fluxvm.ErrClosed)
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken}), 503, api.CodeUnavailable, "")
	e.dp.pressureErr = errors.New("boom")
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken}), 500, api.CodeInternal, "")
}
