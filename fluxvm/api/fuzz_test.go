package api_test

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// FuzzApplyService sends arbitrary bodies to POST /v1/network/services:
// the handler must answer 200 or a client error with the documented JSON
// shape, never panic or answer 500.
func FuzzApplyService(f *testing.F) {
	for _, seed := range []string{
		validService,
		`{}`, `[]`, `null`, ``, `{"name":"a","vips":["::1"],"ports":[{"port":1,"protocol":"udp"}]}`,
		`{"name":"web","backends":[{"address":"10.0.0.1","port":70000}]}`,
		`{"name":"web","name":"web"}`, `{"name":"web"} trailing`, "\xff\xfe",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		e := newEnv(t, func(o *api.Options) { o.MaxBodyBytes = 4096 })
		w := e.do(req{method: "POST", path: "/v1/network/services", token: adminToken, body: string(body),
			header: http.Header{"Content-Type": {"application/json"}}})
		switch w.Code {
		case http.StatusOK:
			return
		case http.StatusBadRequest, http.StatusRequestEntityTooLarge:
		default:
			t.Fatalf("status %d for %q: %s", w.Code, body, w.Body)
		}
		var resp api.ErrorResponse
		if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil || resp.Error.Code.Status() != w.Code || resp.Error.Message == "" {
			t.Fatalf("error body %q (%v) for status %d", w.Body, err, w.Code)
		}
	})
}

// FuzzApplyPolicies sends arbitrary bodies to POST
// /v1/network/services/policies (one policy or an array, told apart by
// the first non-space byte): the handler must answer 200 or a client
// error with the documented JSON shape, never panic or answer 500.
func FuzzApplyPolicies(f *testing.F) {
	for _, seed := range []string{
		validPolicy, "[" + validPolicy + "]", " \n[" + validPolicy + "," + validPolicy + "]",
		`{}`, `[]`, `[null]`, `null`, ``, ` `, `[{}]`,
		`{"service":"web","default_action":"allow","allow_identities":[0]}`,
		`{"service":"web","default_action":"deny","deny_identities":[16777216, -1, 1.5]}`,
		`{"service":"nope","default_action":"deny"}`,
		`{"service":"web","default_action":"deny","l7":{"mode":"enforce","protocol":"http"}}`,
		`{"service":"web","service":"web"}`, `{"service":"web"} trailing`, `[1,2,3]`, "\xff\xfe",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		e := newEnv(t, func(o *api.Options) { o.MaxBodyBytes = 4096 })
		e.mustApply("web")
		w := e.do(req{method: "POST", path: "/v1/network/services/policies", token: adminToken, body: string(body),
			header: http.Header{"Content-Type": {"application/json"}}})
		switch w.Code {
		case http.StatusOK:
			return
		case http.StatusBadRequest, http.StatusConflict, http.StatusRequestEntityTooLarge, http.StatusUnprocessableEntity:
		default:
			t.Fatalf("status %d for %q: %s", w.Code, body, w.Body)
		}
		var resp api.ErrorResponse
		if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil || resp.Error.Code.Status() != w.Code || resp.Error.Message == "" {
			t.Fatalf("error body %q (%v) for status %d", w.Body, err, w.Code)
		}
	})
}
