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

// fuzzJSONRoute sends arbitrary bodies to a JSON route of the HA state
// transfer: the handler must answer 200 or one of the client errors
// allowed, with the documented JSON shape, never panic or answer 500.
func fuzzJSONRoute(t *testing.T, path string, body []byte, allowed ...int) {
	e := newEnv(t, func(o *api.Options) { o.MaxBodyBytes, o.MaxDeltaBytes = 4096, 8192 })
	e.mustApply("web")
	w := e.do(req{method: "POST", path: path, token: adminToken, body: string(body),
		header: http.Header{"Content-Type": {"application/json"}}})
	if w.Code == http.StatusOK {
		return
	}
	ok := false
	for _, s := range allowed {
		ok = ok || s == w.Code
	}
	if !ok {
		t.Fatalf("status %d for %q: %s", w.Code, body, w.Body)
	}
	var resp api.ErrorResponse
	if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil || resp.Error.Code.Status() != w.Code || resp.Error.Message == "" {
		t.Fatalf("error body %q (%v) for status %d", w.Body, err, w.Code)
	}
}

// FuzzImportDelta sends arbitrary bodies to POST
// /v1/network/services/web/conntrack/delta/import (decoded strictly,
// then checked against the fake's real ha.Cursor).
func FuzzImportDelta(f *testing.F) {
	valid := `{"service":"web","journal":"j1","epoch":3,"from":0,"to":1,"batches":[{"seq":1,"epoch":3,"ops":[` +
		`{"op":1,"flow":{"client":"10.1.0.1:1025","vip":"10.96.0.10:80","proto":6,"backend":"10.40.1.21:8080","kind":2,"state":2,"age":1,"idle":1,"ttl":60000000000}},` +
		`{"op":2,"key":{"client":"10.1.0.2:1026","vip":"10.96.0.10:80","proto":6}}]}]}`
	for _, seed := range []string{
		valid, `{}`, `[]`, `null`, ``, `{"service":"web"}`, `{"service":"api","journal":"j1","epoch":3}`,
		`{"service":"web","journal":"j1","epoch":3,"from":0,"to":0,"reset_required":true}`,
		`{"service":"web","journal":"j1","epoch":0,"from":0,"to":0}`,
		`{"service":"web","journal":"j1","epoch":3,"from":4,"to":5,"batches":[{"seq":5,"epoch":3,"ops":[{"op":9}]}]}`,
		`{"service":"web","service":"web"}`, `{"service":"web"} trailing`, `{"batches":[{"ops":[{"flow":{"vip":"::1:80"}}]}]}`, "\xff\xfe",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		fuzzJSONRoute(t, "/v1/network/services/web/conntrack/delta/import", body,
			http.StatusBadRequest, http.StatusConflict, http.StatusRequestEntityTooLarge)
	})
}

// FuzzAckDelta sends arbitrary bodies to POST
// /v1/network/services/web/conntrack/delta/ack.
func FuzzAckDelta(f *testing.F) {
	for _, seed := range []string{
		`{"seq":3}`, `{"seq":0}`, `{"seq":9}`, `{}`, `{"seq":null}`, `{"seq":-1}`, `{"seq":1.5}`, `{"seq":"3"}`,
		`{"seq":18446744073709551616}`, `{"seq":1,"seq":2}`, `{"seq":1} {}`, `[]`, ``, "\xff\xfe",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		fuzzJSONRoute(t, "/v1/network/services/web/conntrack/delta/ack", body,
			http.StatusBadRequest, http.StatusConflict, http.StatusRequestEntityTooLarge)
	})
}

// FuzzUpdateLease sends arbitrary bodies to POST
// /v1/network/services/ha/lease.
func FuzzUpdateLease(f *testing.F) {
	for _, seed := range []string{
		`{"epoch":4}`, `{"epoch":2}`, `{"superseded_by":9}`, `{"epoch":5,"superseded_by":9}`, `{}`, `{"epoch":-1}`,
		`{"epoch":1e3}`, `{"epoch":4,"epoch":5}`, `{"epoch":4,"term":1}`, `{"epoch":4} x`, `null`, ``, "\xff\xfe",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		fuzzJSONRoute(t, "/v1/network/services/ha/lease", body,
			http.StatusBadRequest, http.StatusConflict, http.StatusRequestEntityTooLarge)
	})
}
