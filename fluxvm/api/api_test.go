package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
)

// The node's dataplane is what the handler serves: every role, its HA()
// replication.
var _ = api.Roles{Services: (*fluxvm.Dataplane)(nil), Observer: (*fluxvm.Dataplane)(nil), Admin: (*fluxvm.Dataplane)(nil),
	Flows: (*fluxvm.Dataplane)(nil), Policies: (*fluxvm.Dataplane)(nil), Snapshots: (*fluxvm.Dataplane)(nil),
	Replication: fluxvm.HA{}}

const (
	adminToken = "admin-secret-token"
	readToken  = "read-secret"
)

// validService is a well-formed apply request.
const validService = `{
  "name": "web",
  "vips": ["10.96.0.10"],
  "ports": [{"port": 80, "protocol": "tcp"}],
  "backends": [
    {"address": "10.40.1.21", "port": 8080},
    {"address": "10.40.1.22", "port": 8080, "weight": 2, "state": "draining", "drain_until_unix_ms": 1788850000000}
  ]
}`

type testEnv struct {
	t   testing.TB
	dp  *fakeDataplane
	h   http.Handler
	log *bytes.Buffer
}

func newEnv(t testing.TB, opts ...func(*api.Options)) *testEnv {
	t.Helper()
	var logs bytes.Buffer
	o := api.Options{
		AdminTokens: []string{adminToken},
		ReadTokens:  []string{readToken},
		Logger:      slog.New(slog.NewTextHandler(&logs, nil)),
	}
	for _, f := range opts {
		f(&o)
	}
	dp := newFake()
	h, err := api.New(dp.roles(), o)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return &testEnv{t: t, dp: dp, h: h, log: &logs}
}

type req struct {
	method, path, token, body, contentType string
	header                                 http.Header
}

func (e *testEnv) do(r req) *httptest.ResponseRecorder {
	e.t.Helper()
	return serve(e.h, r)
}

// serve runs one request through h.
func serve(h http.Handler, r req) *httptest.ResponseRecorder {
	var body io.Reader
	if r.body != "" {
		body = strings.NewReader(r.body)
	}
	hr := httptest.NewRequest(r.method, r.path, body)
	if r.token != "" {
		hr.Header.Set("Authorization", "Bearer "+r.token)
	}
	if r.contentType != "" {
		hr.Header.Set("Content-Type", r.contentType)
	} else if r.body != "" {
		hr.Header.Set("Content-Type", "application/json")
	}
	for k, v := range r.header {
		hr.Header[k] = v
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, hr)
	return w
}

// mustApply applies validService (renamed) as admin.
func (e *testEnv) mustApply(name string) {
	e.t.Helper()
	body := strings.Replace(validService, `"web"`, fmt.Sprintf("%q", name), 1)
	if w := e.do(req{method: "POST", path: "/v1/network/services", token: adminToken, body: body}); w.Code != http.StatusOK {
		e.t.Fatalf("apply %s: %d %s", name, w.Code, w.Body)
	}
}

// wantError checks an error response: status, code, optional field, and
// the headers every response carries.
func wantError(t *testing.T, w *httptest.ResponseRecorder, status int, code api.Code, field string) api.ErrorDetail {
	t.Helper()
	if w.Code != status {
		t.Fatalf("status = %d, want %d; body %s", w.Code, status, w.Body)
	}
	checkCommonHeaders(t, w)
	var resp api.ErrorResponse
	dec := json.NewDecoder(bytes.NewReader(w.Body.Bytes()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&resp); err != nil {
		t.Fatalf("error body %q: %v", w.Body, err)
	}
	if resp.Error.Code != code {
		t.Errorf("code = %q, want %q (message %q)", resp.Error.Code, code, resp.Error.Message)
	}
	if code.Status() != status {
		t.Errorf("code %q documents status %d, response has %d", code, code.Status(), status)
	}
	if resp.Error.Message == "" {
		t.Error("empty message")
	}
	if field != "*" && resp.Error.Field != field {
		t.Errorf("field = %q, want %q", resp.Error.Field, field)
	}
	return resp.Error
}

func checkCommonHeaders(t *testing.T, w *httptest.ResponseRecorder) {
	t.Helper()
	if got := w.Header().Get("Cache-Control"); got != "no-store" {
		t.Errorf("Cache-Control = %q, want no-store", got)
	}
	if w.Code != http.StatusNoContent {
		if got := w.Header().Get("Content-Type"); got != "application/json" {
			t.Errorf("Content-Type = %q, want application/json", got)
		}
	}
}

func decodeOK[T any](t *testing.T, w *httptest.ResponseRecorder, status int) T {
	t.Helper()
	if w.Code != status {
		t.Fatalf("status = %d, want %d; body %s", w.Code, status, w.Body)
	}
	checkCommonHeaders(t, w)
	var v T
	if err := json.Unmarshal(w.Body.Bytes(), &v); err != nil {
		t.Fatalf("decode %q: %v", w.Body, err)
	}
	return v
}

func TestNewOptions(t *testing.T) {
	dp := newFake().roles()
	noReplication := dp
	noReplication.Replication = nil
	for _, tc := range []struct {
		name string
		dp   api.Roles
		opts api.Options
		ok   bool
	}{
		{"admin only", dp, api.Options{AdminTokens: []string{"a"}}, true},
		{"read only", dp, api.Options{ReadTokens: []string{"r"}}, true},
		{"both", dp, api.Options{AdminTokens: []string{"a"}, ReadTokens: []string{"r"}}, true},
		{"duplicate in one list", dp, api.Options{AdminTokens: []string{"a", "a"}}, true},
		{"no tokens", dp, api.Options{}, false},
		{"empty lists", dp, api.Options{AdminTokens: []string{}, ReadTokens: []string{}}, false},
		{"empty token", dp, api.Options{AdminTokens: []string{""}}, false},
		{"token with space", dp, api.Options{AdminTokens: []string{"a b"}}, false},
		{"token with newline", dp, api.Options{ReadTokens: []string{"a\n"}}, false},
		{"admin and read", dp, api.Options{AdminTokens: []string{"x"}, ReadTokens: []string{"x"}}, false},
		{"negative body limit", dp, api.Options{AdminTokens: []string{"a"}, MaxBodyBytes: -1}, false},
		{"negative snapshot limit", dp, api.Options{AdminTokens: []string{"a"}, MaxSnapshotBytes: -1}, false},
		{"negative delta limit", dp, api.Options{AdminTokens: []string{"a"}, MaxDeltaBytes: -1}, false},
		{"snapshot and delta limits", dp, api.Options{AdminTokens: []string{"a"}, MaxSnapshotBytes: 1 << 30, MaxDeltaBytes: 1 << 10}, true},
		{"body timeout", dp, api.Options{AdminTokens: []string{"a"}, BodyTimeout: time.Second}, true},
		{"negative body timeout", dp, api.Options{AdminTokens: []string{"a"}, BodyTimeout: -time.Second}, false},
		{"no role", api.Roles{}, api.Options{AdminTokens: []string{"a"}}, false},
		{"a role missing", noReplication, api.Options{AdminTokens: []string{"a"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := api.New(tc.dp, tc.opts)
			if tc.ok && (err != nil || h == nil) {
				t.Fatalf("New: %v", err)
			}
			if !tc.ok && err == nil {
				t.Fatal("New succeeded, want an error")
			}
			if err != nil && strings.Contains(err.Error(), "x") && tc.name == "admin and read" {
				t.Errorf("error leaks the token: %v", err)
			}
		})
	}
}

func TestListServices(t *testing.T) {
	e := newEnv(t)
	empty := decodeOK[[]fluxvm.ServiceStatus](t, e.do(req{method: "GET", path: "/v1/network/services", token: readToken}), 200)
	if empty == nil || len(empty) != 0 {
		t.Fatalf("empty list = %#v, want []", empty)
	}
	if w := e.do(req{method: "GET", path: "/v1/network/services", token: readToken}); strings.TrimSpace(w.Body.String()) != "[]" {
		t.Errorf("empty list body = %q, want []", w.Body)
	}
	for _, n := range []string{"zeta", "alpha", "mid"} {
		e.mustApply(n)
	}
	list := decodeOK[[]fluxvm.ServiceStatus](t, e.do(req{method: "GET", path: "/v1/network/services", token: readToken}), 200)
	var names []string
	for _, s := range list {
		names = append(names, s.Service.Name)
	}
	if want := []string{"alpha", "mid", "zeta"}; !reflect.DeepEqual(names, want) {
		t.Errorf("names = %v, want %v (sorted)", names, want)
	}
}

func TestApplyService(t *testing.T) {
	e := newEnv(t)
	w := e.do(req{method: "POST", path: "/v1/network/services", token: adminToken, body: validService})
	st := decodeOK[fluxvm.ServiceStatus](t, w, 200)
	if st.Service.Name != "web" || len(st.Service.Backends) != 2 || len(st.Frontends) != 1 {
		t.Fatalf("status = %+v", st)
	}
	b := e.dp.applied[0].Backends[1]
	if b.EffectiveWeight() != 2 || b.State != fluxvm.BackendDraining || b.DrainUntilUnixMs != 1788850000000 {
		t.Errorf("decoded backend = %+v", b)
	}
	if got := st.Frontends[0].VIP.String(); got != "10.96.0.10:80" {
		t.Errorf("frontend = %s", got)
	}
	// Applying again is an update: still 200.
	st2 := decodeOK[fluxvm.ServiceStatus](t, e.do(req{method: "POST", path: "/v1/network/services", token: adminToken, body: validService}), 200)
	if st2.Revision <= st.Revision {
		t.Errorf("revision %d after %d", st2.Revision, st.Revision)
	}
	// Content-Type parameters are accepted.
	w = e.do(req{method: "POST", path: "/v1/network/services", token: adminToken, body: validService,
		contentType: "application/json; charset=utf-8"})
	if w.Code != 200 {
		t.Errorf("with charset: %d %s", w.Code, w.Body)
	}
}

func TestApplyServiceErrors(t *testing.T) {
	for _, tc := range []struct {
		name        string
		body        string
		contentType string
		applyErr    error
		status      int
		code        api.Code
		field       string
		msgContains string
		noApply     bool // the dataplane must not be called
	}{
		{name: "unknown field", body: `{"name":"web","vips":[],"ports":[],"backends":[],"bogus_field":1}`,
			status: 400, code: api.CodeInvalidRequest, field: "bogus_field", msgContains: "unknown field", noApply: true},
		{name: "unknown nested field", body: `{"name":"web","vips":[],"ports":[],"backends":[{"address":"10.0.0.1","port":1,"colour":"red"}]}`,
			status: 400, code: api.CodeInvalidRequest, field: "backends[0].colour", msgContains: "unknown field", noApply: true},
		{name: "syntax error", body: `{"name":`, status: 400, code: api.CodeInvalidRequest, field: "*", noApply: true},
		{name: "not an object", body: `[1,2]`, status: 400, code: api.CodeInvalidRequest, field: "*", noApply: true},
		{name: "wrong type", body: `{"name":5}`, status: 400, code: api.CodeInvalidRequest, field: "name", noApply: true},
		{name: "bad address", body: `{"name":"web","vips":["10.0.0.300"],"ports":[],"backends":[]}`,
			status: 400, code: api.CodeInvalidRequest, field: "vips[0]", noApply: true},
		{name: "trailing data", body: validService + `{}`, status: 400, code: api.CodeInvalidRequest, field: "*", noApply: true},
		{name: "empty body", body: "", contentType: "application/json", status: 400, code: api.CodeInvalidRequest, field: "*", noApply: true},
		{name: "text/plain", body: validService, contentType: "text/plain", status: 415, code: api.CodeUnsupportedMediaType, noApply: true},
		{name: "form", body: "a=b", contentType: "application/x-www-form-urlencoded", status: 415, code: api.CodeUnsupportedMediaType, noApply: true},
		{name: "garbage content type", body: validService, contentType: "application/json; ===", status: 415, code: api.CodeUnsupportedMediaType, noApply: true},
		{name: "validation error", body: validService,
			applyErr: fmt.Errorf("validate: %w", &fluxvm.ValidationError{Field: "backends[1].port", Reason: "must not be 0", Kind: fluxvm.ErrInvalid}),
			status:   400, code: api.CodeInvalidRequest, field: "backends[1].port", msgContains: "must not be 0"},
		{name: "plain invalid", body: validService, applyErr: fmt.Errorf("bad vip: %w", fluxvm.ErrInvalid),
			status: 400, code: api.CodeInvalidRequest, msgContains: "bad vip"},
		{name: "unsupported", body: validService,
			applyErr: &fluxvm.ValidationError{Field: "mode", Reason: "dsr is not built", Kind: fluxvm.ErrUnsupported},
			status:   422, code: api.CodeUnsupported, field: "mode"},
		{name: "conflict", body: validService, applyErr: fmt.Errorf("frontend 10.96.0.10:80/tcp used by api: %w", fluxvm.ErrConflict),
			status: 409, code: api.CodeConflict, msgContains: "used by api"},
		{name: "missing prerequisite", body: validService,
			applyErr: &fluxvm.ValidationError{Field: "max_egress_mbps", Reason: "needs edt_enabled", Kind: fluxvm.ErrPrerequisite},
			status:   422, code: api.CodeMissingPrerequisite, field: "max_egress_mbps"},
		{name: "too large from the dataplane", body: validService, applyErr: &fluxvm.ValidationError{Reason: "too big", Kind: fluxvm.ErrTooLarge},
			status: 413, code: api.CodePayloadTooLarge},
		{name: "malformed from the dataplane", body: validService, applyErr: &fluxvm.ValidationError{Field: "name", Reason: "bad", Kind: fluxvm.ErrMalformed},
			status: 400, code: api.CodeInvalidRequest, field: "name"},
		{name: "limit", body: validService, applyErr: &fluxvm.ValidationError{Field: "backends", Reason: "more than 1024", Kind: fluxvm.ErrLimit},
			status: 422, code: api.CodeLimitExceeded, field: "backends"},
		{name: "internal", body: validService, applyErr: errors.New("map update: EPERM secret-detail"),
			status: 500, code: api.CodeInternal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.dp.applyErr = tc.applyErr
			r := req{method: "POST", path: "/v1/network/services", token: adminToken, body: tc.body, contentType: tc.contentType}
			if tc.body == "" {
				r.header = http.Header{"Content-Type": {tc.contentType}}
			}
			d := wantError(t, e.do(r), tc.status, tc.code, tc.field)
			if !strings.Contains(d.Message, tc.msgContains) {
				t.Errorf("message %q does not contain %q", d.Message, tc.msgContains)
			}
			if tc.noApply && len(e.dp.applied) != 0 {
				t.Errorf("dataplane called with %+v", e.dp.applied)
			}
			if tc.code == api.CodeInternal {
				if strings.Contains(d.Message, "secret-detail") {
					t.Errorf("internal message leaks the cause: %q", d.Message)
				}
				if !strings.Contains(e.log.String(), "secret-detail") {
					t.Errorf("internal cause not logged: %s", e.log)
				}
			}
		})
	}
}

func TestBodyTooLarge(t *testing.T) {
	e := newEnv(t, func(o *api.Options) { o.MaxBodyBytes = 64 })
	big := `{"name":"` + strings.Repeat("x", 100) + `"}`
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services", token: adminToken, body: big}), 413, api.CodePayloadTooLarge, "")

	// Without a Content-Length the limit is enforced while reading.
	hr := httptest.NewRequest("POST", "/v1/network/services", io.MultiReader(strings.NewReader(big)))
	hr.ContentLength = -1
	hr.Header.Set("Authorization", "Bearer "+adminToken)
	hr.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	e.h.ServeHTTP(w, hr)
	wantError(t, w, 413, api.CodePayloadTooLarge, "")

	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/conntrack/gc", token: adminToken,
		body: `{` + strings.Repeat(" ", 100) + `}`}), 413, api.CodePayloadTooLarge, "")
	if len(e.dp.applied) != 0 || e.dp.gcRuns != 0 {
		t.Errorf("dataplane called: %d applies, %d GCs", len(e.dp.applied), e.dp.gcRuns)
	}

	// The default limit is 1 MiB.
	e = newEnv(t)
	huge := `{"name":"` + strings.Repeat("x", 1<<20) + `"}`
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services", token: adminToken, body: huge}), 413, api.CodePayloadTooLarge, "")
}

func TestGetService(t *testing.T) {
	e := newEnv(t)
	e.mustApply("web")
	st := decodeOK[fluxvm.ServiceStatus](t, e.do(req{method: "GET", path: "/v1/network/services/web", token: readToken}), 200)
	if st.Service.Name != "web" {
		t.Errorf("got %+v", st)
	}
	d := wantError(t, e.do(req{method: "GET", path: "/v1/network/services/nope", token: readToken}), 404, api.CodeNotFound, "")
	if !strings.Contains(d.Message, "nope") {
		t.Errorf("message %q does not name the service", d.Message)
	}
}

func TestDeleteService(t *testing.T) {
	e := newEnv(t)
	e.mustApply("web")
	w := e.do(req{method: "DELETE", path: "/v1/network/services/web", token: adminToken})
	if w.Code != http.StatusNoContent || w.Body.Len() != 0 {
		t.Fatalf("delete: %d %q", w.Code, w.Body)
	}
	if w.Header().Get("Cache-Control") != "no-store" {
		t.Error("no Cache-Control on 204")
	}
	if !reflect.DeepEqual(e.dp.deleted, []string{"web"}) {
		t.Errorf("deleted %v", e.dp.deleted)
	}
	wantError(t, e.do(req{method: "DELETE", path: "/v1/network/services/web", token: adminToken}), 404, api.CodeNotFound, "")
	wantError(t, e.do(req{method: "GET", path: "/v1/network/services/web", token: adminToken}), 404, api.CodeNotFound, "")
}

func TestStatus(t *testing.T) {
	e := newEnv(t)
	e.mustApply("web")
	st := decodeOK[fluxvm.Status](t, e.do(req{method: "GET", path: "/v1/network/services/status", token: readToken}), 200)
	if st.SchemaVersion != 4 || st.Generation != 8 || st.Tier != "M" || st.Services != 1 {
		t.Errorf("status = %+v", st)
	}
}

// TestPanic checks that a panicking dataplane gets a JSON 500, not a
// dropped connection, and that the panic is logged.
func TestPanic(t *testing.T) {
	e := newEnv(t)
	e.dp.statusPanic = true
	d := wantError(t, e.do(req{method: "GET", path: "/v1/network/services/status", token: readToken}), 500, api.CodeInternal, "")
	if strings.Contains(d.Message, "exploded") {
		t.Errorf("message leaks the panic: %q", d.Message)
	}
	if !strings.Contains(e.log.String(), "status exploded") {
		t.Errorf("panic not logged:\n%s", e.log)
	}
}

func TestStats(t *testing.T) {
	e := newEnv(t)
	w := e.do(req{method: "GET", path: "/v1/network/services/stats", token: readToken})
	// Nil maps are sent as empty objects, never null.
	if got := strings.TrimSpace(w.Body.String()); got != `{"services":{},"drops":{},"parser":{}}` {
		t.Errorf("empty stats = %s", got)
	}
	e.dp.stats = fluxvm.Stats{
		Services: map[string]fluxvm.Counters{"web": {Packets: 5, Bytes: 500}},
		Drops:    map[string]uint64{"no_backend": 2},
		Parser:   map[string]uint64{"ipv4": 7},
	}
	st := decodeOK[fluxvm.Stats](t, e.do(req{method: "GET", path: "/v1/network/services/stats", token: readToken}), 200)
	if !reflect.DeepEqual(st, e.dp.stats) {
		t.Errorf("stats = %+v", st)
	}
	e.dp.statsErr = errors.New("read per-cpu map: boom")
	wantError(t, e.do(req{method: "GET", path: "/v1/network/services/stats", token: readToken}), 500, api.CodeInternal, "")
}

func TestGC(t *testing.T) {
	e := newEnv(t)
	for _, r := range []req{
		{method: "POST", path: "/v1/network/services/conntrack/gc", token: adminToken},
		{method: "POST", path: "/v1/network/services/conntrack/gc", token: adminToken, body: "{}"},
		{method: "POST", path: "/v1/network/services/conntrack/gc", token: adminToken, body: " {} \n"},
	} {
		res := decodeOK[fluxvm.GCResult](t, e.do(r), 200)
		if res.Scanned != 10 || res.Expired != 3 || res.Drained != 1 {
			t.Errorf("gc result %+v", res)
		}
	}
	if e.dp.gcRuns != 3 {
		t.Errorf("gc runs = %d", e.dp.gcRuns)
	}
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/conntrack/gc", token: adminToken, body: `{"full":true}`}),
		400, api.CodeInvalidRequest, "full")
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/conntrack/gc", token: adminToken, body: `{}`, contentType: "text/plain"}),
		415, api.CodeUnsupportedMediaType, "")
	if e.dp.gcRuns != 3 {
		t.Errorf("rejected requests ran GC: %d runs", e.dp.gcRuns)
	}
	e.dp.gcErr = errors.New("iterate fct4: EIO")
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/conntrack/gc", token: adminToken}), 500, api.CodeInternal, "")
	// A GC cut short because the request ended (the client went away, or
	// an embedder's deadline) is not an internal error of the node.
	for _, cause := range []error{context.Canceled, context.DeadlineExceeded} {
		e.dp.gcErr = fmt.Errorf("fluxvm: gc: iterate fct4: %w", cause)
		wantError(t, e.do(req{method: "POST", path: "/v1/network/services/conntrack/gc", token: adminToken}), 503, api.CodeUnavailable, "")
	}
}

func TestVMStats(t *testing.T) {
	e := newEnv(t)
	e.dp.vms["vm-1"] = fluxvm.VMStats{VMID: "vm-1", Interfaces: []string{"tap1"}, Counters: fluxvm.Counters{Packets: 9}}
	st := decodeOK[fluxvm.VMStats](t, e.do(req{method: "GET", path: "/v1/vms/vm-1/network/services/stats", token: readToken}), 200)
	if !reflect.DeepEqual(st, e.dp.vms["vm-1"]) {
		t.Errorf("vm stats = %+v", st)
	}
	wantError(t, e.do(req{method: "GET", path: "/v1/vms/vm-2/network/services/stats", token: readToken}), 404, api.CodeNotFound, "")
}

// TestLiteralSegmentsWin checks that /status and /stats are not read as a
// service name, even when a service of that name exists.
func TestLiteralSegmentsWin(t *testing.T) {
	e := newEnv(t)
	e.mustApply("status")
	e.mustApply("stats")
	w := e.do(req{method: "GET", path: "/v1/network/services/status", token: readToken})
	if !strings.Contains(w.Body.String(), `"schema_version":4`) {
		t.Errorf("/status served %s", w.Body)
	}
	w = e.do(req{method: "GET", path: "/v1/network/services/stats", token: readToken})
	if !strings.Contains(w.Body.String(), `"parser":`) {
		t.Errorf("/stats served %s", w.Body)
	}
	// The literal routes are GET only: other methods still match {name}
	// (ServeMux picks the most specific pattern among those that match the
	// method), so DELETE removes a service that happens to be named so
	// (restored from an older catalog: validation refuses the name).
	if w := e.do(req{method: "DELETE", path: "/v1/network/services/status", token: adminToken}); w.Code != http.StatusNoContent {
		t.Errorf("DELETE status: %d %s", w.Code, w.Body)
	}
	if !reflect.DeepEqual(e.dp.deleted, []string{"status"}) {
		t.Errorf("deleted %v", e.dp.deleted)
	}
	// Other names still reach {name}.
	wantError(t, e.do(req{method: "GET", path: "/v1/network/services/statuses", token: readToken}), 404, api.CodeNotFound, "")
}

// TestReservedWordsAreRoutes checks that no reserved word of the REST
// surface (fluxvm.ReservedNames) is ever answered as a service by the
// {name} routes: GET is the word's own route when this build has one,
// else 404 "no such route", even when the dataplane holds a service of
// that name (restored from an older catalog); DELETE removes such a
// service and is otherwise 404 "no such route".
func TestReservedWordsAreRoutes(t *testing.T) {
	literal := map[string]bool{"status": true, "stats": true, "health": true, "advertisements": true, "flows": true, "policies": true, "ha": true}
	for _, w := range fluxvm.ReservedNames() {
		t.Run(w, func(t *testing.T) {
			e := newEnv(t)
			path := "/v1/network/services/" + w
			w0 := e.do(req{method: "GET", path: path, token: readToken})
			if literal[w] {
				if w0.Code != http.StatusOK || strings.Contains(w0.Body.String(), `"service"`) {
					t.Errorf("GET %s: %d %s", path, w0.Code, w0.Body)
				}
			} else {
				d := wantError(t, w0, 404, api.CodeNotFound, "")
				if !strings.Contains(d.Message, "no such route") || !strings.Contains(d.Message, "reserved") {
					t.Errorf("GET %s: message %q does not say the route does not exist", path, d.Message)
				}
			}
			d := wantError(t, e.do(req{method: "DELETE", path: path, token: adminToken}), 404, api.CodeNotFound, "")
			if !strings.Contains(d.Message, "no such route") {
				t.Errorf("DELETE %s: message %q", path, d.Message)
			}

			// A service of that name restored from an older catalog.
			e.mustApply(w)
			w1 := e.do(req{method: "GET", path: path, token: readToken})
			if w1.Code == http.StatusOK && strings.Contains(w1.Body.String(), `"revision"`) {
				t.Errorf("GET %s answered the service: %s", path, w1.Body)
			}
			if !literal[w] {
				wantError(t, w1, 404, api.CodeNotFound, "")
			}
			if list := decodeOK[[]fluxvm.ServiceStatus](t, e.do(req{method: "GET", path: "/v1/network/services", token: readToken}), 200); len(list) != 1 || list[0].Service.Name != w {
				t.Errorf("list %+v", list)
			}
			if w2 := e.do(req{method: "DELETE", path: path, token: adminToken}); w2.Code != http.StatusNoContent {
				t.Errorf("DELETE %s of a restored service: %d %s", path, w2.Code, w2.Body)
			}
			if !reflect.DeepEqual(e.dp.deleted, []string{w}) {
				t.Errorf("deleted %v", e.dp.deleted)
			}
		})
	}
}

func TestRoutingErrors(t *testing.T) {
	e := newEnv(t)
	wantError(t, e.do(req{method: "GET", path: "/v1/nope", token: readToken}), 404, api.CodeNotFound, "")
	wantError(t, e.do(req{method: "GET", path: "/", token: readToken}), 404, api.CodeNotFound, "")
	wantError(t, e.do(req{method: "GET", path: "/v1/network/services/a/b", token: readToken}), 404, api.CodeNotFound, "")

	w := e.do(req{method: "PUT", path: "/v1/network/services", token: adminToken, body: validService})
	wantError(t, w, 405, api.CodeMethodNotAllowed, "")
	if allow := w.Header().Get("Allow"); !strings.Contains(allow, "GET") || !strings.Contains(allow, "POST") {
		t.Errorf("Allow = %q", allow)
	}
	w = e.do(req{method: "GET", path: "/v1/network/services/conntrack/gc", token: adminToken})
	wantError(t, w, 405, api.CodeMethodNotAllowed, "")
	if allow := w.Header().Get("Allow"); allow != "POST" {
		t.Errorf("Allow = %q", allow)
	}
	w = e.do(req{method: "POST", path: "/metrics", token: adminToken, body: "{}"})
	wantError(t, w, 405, api.CodeMethodNotAllowed, "")

	// An unclean path is redirected to the clean one (ServeMux), without
	// a body.
	w = e.do(req{method: "GET", path: "/v1//network/services", token: readToken})
	if w.Code != http.StatusTemporaryRedirect || w.Header().Get("Location") != "/v1/network/services" || w.Body.Len() != 0 {
		t.Errorf("unclean path: %d %v %q", w.Code, w.Header(), w.Body)
	}
	// A trailing slash is another path.
	wantError(t, e.do(req{method: "GET", path: "/v1/network/services/", token: readToken}), 404, api.CodeNotFound, "")

	// HEAD works wherever GET does.
	if w := e.do(req{method: "HEAD", path: "/v1/network/services", token: readToken}); w.Code != 200 {
		t.Errorf("HEAD: %d", w.Code)
	}
}

// TestAuthMatrix checks every kind of credential against a read and a
// mutation route.
func TestAuthMatrix(t *testing.T) {
	type cred struct {
		name   string
		header []string // Authorization values; nil = none
	}
	creds := []cred{
		{"no header", nil},
		{"empty header", []string{""}},
		{"basic scheme", []string{"Basic " + adminToken}},
		{"no scheme", []string{adminToken}},
		{"bearer without token", []string{"Bearer"}},
		{"bearer with blank token", []string{"Bearer   "}},
		{"unknown token", []string{"Bearer wrong-token"}},
		{"token prefix", []string{"Bearer " + adminToken[:len(adminToken)-1]}},
		{"token with suffix", []string{"Bearer " + adminToken + "x"}},
		{"read token", []string{"Bearer " + readToken}},
		{"admin token", []string{"Bearer " + adminToken}},
		{"lowercase scheme", []string{"bearer " + adminToken}},
	}
	type call struct {
		name  string
		r     req
		okFor map[string]int // credential → success status; all others fail
	}
	admin := map[string]int{"admin token": 0, "lowercase scheme": 0}
	read := map[string]int{"admin token": 0, "lowercase scheme": 0, "read token": 0}
	calls := []call{
		{"list", req{method: "GET", path: "/v1/network/services"}, read},
		{"get", req{method: "GET", path: "/v1/network/services/web"}, read},
		{"status", req{method: "GET", path: "/v1/network/services/status"}, read},
		{"stats", req{method: "GET", path: "/v1/network/services/stats"}, read},
		{"vm stats", req{method: "GET", path: "/v1/vms/vm-1/network/services/stats"}, read},
		{"metrics", req{method: "GET", path: "/metrics"}, read},
		{"apply", req{method: "POST", path: "/v1/network/services", body: validService}, admin},
		{"gc", req{method: "POST", path: "/v1/network/services/conntrack/gc"}, admin},
		{"health", req{method: "GET", path: "/v1/network/services/health"}, read},
		{"reconcile health", req{method: "POST", path: "/v1/network/services/health/reconcile"}, admin},
		{"reconcile pressure", req{method: "POST", path: "/v1/network/services/pressure/reconcile"}, admin},
		{"snat peers", req{method: "POST", path: "/v1/network/services/snat/peers", body: `{"addresses":[]}`}, admin},
		{"advertisements", req{method: "GET", path: "/v1/network/services/advertisements"}, read},
		{"delete", req{method: "DELETE", path: "/v1/network/services/web"}, admin},
		{"policies", req{method: "GET", path: "/v1/network/services/policies"}, read},
		{"apply policy", req{method: "POST", path: "/v1/network/services/policies", body: validPolicy}, admin},
		{"apply policies", req{method: "POST", path: "/v1/network/services/policies", body: "[" + validPolicy + "]"}, admin},
		{"reconcile policies", req{method: "POST", path: "/v1/network/services/policies/reconcile"}, admin},
		{"get policy", req{method: "GET", path: "/v1/network/services/web/policy"}, read},
		{"delete policy", req{method: "DELETE", path: "/v1/network/services/web/policy"}, admin},
		{"envoy", req{method: "GET", path: "/v1/network/services/web/l7/envoy"}, read},
		{"flows", req{method: "GET", path: "/v1/network/services/flows"}, read},
		{"ha status", req{method: "GET", path: "/v1/network/services/ha"}, read},
		{"ha lease", req{method: "POST", path: "/v1/network/services/ha/lease", body: `{"epoch":4}`}, admin},
		{"ha join", req{method: "POST", path: "/v1/network/services/ha/join"}, admin},
		{"conntrack export", req{method: "GET", path: "/v1/network/services/web/conntrack/export"}, read},
		{"conntrack import", req{method: "POST", path: "/v1/network/services/web/conntrack/import", body: authSnapshot, contentType: "application/octet-stream"}, admin},
		{"conntrack delta", req{method: "GET", path: "/v1/network/services/web/conntrack/delta?journal=j1"}, read},
		{"conntrack delta import", req{method: "POST", path: "/v1/network/services/web/conntrack/delta/import", body: authDelta}, admin},
		{"conntrack delta ack", req{method: "POST", path: "/v1/network/services/web/conntrack/delta/ack", body: `{"seq":2}`}, admin},
		{"unknown route", req{method: "GET", path: "/v1/unknown"}, nil},
	}
	// Every route of the table is in the matrix.
	covered := map[string]bool{}
	for _, c := range calls {
		covered[c.r.method+" "+c.r.path] = true
	}
	// The telemetry export answers 422 without an exporter, which this
	// matrix does not configure: flows_test.go checks its access.
	exempt := map[string]bool{"POST /v1/network/services/telemetry/export": true}
	for _, rt := range api.RoutePatterns() {
		if exempt[rt] {
			continue
		}
		method, pattern, _ := strings.Cut(rt, " ")
		found := false
		for k := range covered {
			m, p, _ := strings.Cut(k, " ")
			p, _, _ = strings.Cut(p, "?")
			if m == method && matchPattern(pattern, p) {
				found = true
			}
		}
		if !found {
			t.Errorf("route %s is not in the auth matrix", rt)
		}
	}
	for _, c := range calls {
		for _, cr := range creds {
			t.Run(c.name+"/"+cr.name, func(t *testing.T) {
				e := newEnv(t)
				e.mustApply("web")
				e.dp.applied = nil
				e.dp.vms["vm-1"] = fluxvm.VMStats{VMID: "vm-1"}
				e.dp.policies["web"] = fluxvm.Policy{Service: "web", DefaultAction: fluxvm.PolicyDeny, L7: &fluxvm.L7Policy{Mode: fluxvm.L7Enforce, Protocol: "http"}}
				r := c.r
				r.header = http.Header{}
				if cr.header != nil {
					r.header["Authorization"] = cr.header
				}
				w := e.do(r)
				_, ok := c.okFor[cr.name]
				valid := cr.name == "read token" || cr.name == "admin token" || cr.name == "lowercase scheme"
				switch {
				case ok:
					if w.Code >= 300 {
						t.Fatalf("status %d, want success; %s", w.Code, w.Body)
					}
				case !valid:
					wantError(t, w, 401, api.CodeUnauthorized, "")
					wa := w.Header().Get("WWW-Authenticate")
					if !strings.HasPrefix(wa, "Bearer") {
						t.Errorf("WWW-Authenticate = %q", wa)
					}
					if strings.Contains(w.Body.String(), "wrong-token") || strings.Contains(w.Body.String(), adminToken) {
						t.Errorf("body echoes the token: %s", w.Body)
					}
				case c.name == "unknown route":
					wantError(t, w, 404, api.CodeNotFound, "")
				default: // read token on a mutation
					wantError(t, w, 403, api.CodeForbidden, "")
				}
				if !ok && (len(e.dp.applied) != 0 || len(e.dp.deleted) != 0 || e.dp.gcRuns != 0 || e.dp.reconciles != 0 ||
					len(e.dp.policyApplies) != 0 || len(e.dp.ipcacheSets) != 0 || len(e.dp.policyDeletes) != 0 ||
					len(e.dp.ha.leases) != 0 || len(e.dp.ha.imports) != 0 || len(e.dp.ha.deltaImports) != 0 || len(e.dp.ha.acks) != 0 ||
					len(e.dp.ha.deltaReads) != 0 || e.dp.ha.exported != 0) {
					t.Errorf("refused request reached the dataplane")
				}
			})
		}
	}
}

// authSnapshot is a snapshot of two flows of "web"; authDelta a delta
// of the fake's journal continuing an empty cursor.
var (
	authSnapshot = func() string {
		var buf bytes.Buffer
		sw, err := ha.NewWriter(&buf, ha.Header{Node: "b", Service: "web", Epoch: 3, Seeds: &ha.Seeds{}})
		if err != nil {
			panic(err)
		}
		for i := range 2 {
			fl := fakeFlow(i)
			if err := sw.Write(&fl); err != nil {
				panic(err)
			}
		}
		if err := sw.Close(); err != nil {
			panic(err)
		}
		return buf.String()
	}()
	authDelta = func() string {
		f := newFake()
		f.services["web"] = fluxvm.ServiceStatus{}
		d, err := fakeReplication{f}.FlowDelta(context.Background(), "web", fluxvm.FlowDeltaRequest{Journal: "j1", MaxOps: 2})
		if err != nil {
			panic(err)
		}
		b, err := json.Marshal(d)
		if err != nil {
			panic(err)
		}
		return string(b)
	}()
)

// matchPattern reports whether path matches a ServeMux path pattern
// whose wildcards are whole segments.
func matchPattern(pattern, path string) bool {
	ps, qs := strings.Split(pattern, "/"), strings.Split(path, "/")
	if len(ps) != len(qs) {
		return false
	}
	for i := range ps {
		if !strings.HasPrefix(ps[i], "{") && ps[i] != qs[i] {
			return false
		}
	}
	return true
}

// TestAuthBeforeBody checks that a request that fails authentication
// gets 401 whatever its body and content type, and a read token gets 403
// before any body check.
func TestAuthBeforeBody(t *testing.T) {
	e := newEnv(t, func(o *api.Options) { o.MaxBodyBytes = 16 })
	big := strings.Repeat("x", 100)
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services", body: big, contentType: "text/plain"}), 401, api.CodeUnauthorized, "")
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services", token: readToken, body: big, contentType: "text/plain"}), 403, api.CodeForbidden, "")
}

func TestRequestLog(t *testing.T) {
	e := newEnv(t)
	e.do(req{method: "GET", path: "/v1/network/services", token: readToken})
	e.do(req{method: "POST", path: "/v1/network/services", token: adminToken, body: validService})
	e.do(req{method: "GET", path: "/v1/network/services", token: "wrong-token-value"})
	logs := e.log.String()
	for _, want := range []string{
		"method=GET path=/v1/network/services status=200",
		"method=POST path=/v1/network/services status=200",
		"status=401",
		"duration=",
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("log lacks %q:\n%s", want, logs)
		}
	}
	for _, secret := range []string{adminToken, readToken, "wrong-token-value"} {
		if strings.Contains(logs, secret) {
			t.Errorf("log contains a token:\n%s", logs)
		}
	}
}

func TestErrorShapeStable(t *testing.T) {
	e := newEnv(t)
	// Exact bytes of a documented error: clients parse this shape.
	w := e.do(req{method: "GET", path: "/v1/network/services/nope", token: readToken})
	want := `{"error":{"code":"not_found","message":"service \"nope\": not found"}}` + "\n"
	if w.Body.String() != want {
		t.Errorf("body = %q\nwant   %q", w.Body, want)
	}
	e.dp.applyErr = fmt.Errorf("apply: %w", &fluxvm.ValidationError{Field: "backends[1].port", Reason: "must not be 0", Kind: fluxvm.ErrInvalid})
	w = e.do(req{method: "POST", path: "/v1/network/services", token: adminToken, body: validService})
	want = `{"error":{"code":"invalid_request","message":"backends[1].port: must not be 0","field":"backends[1].port"}}` + "\n"
	if w.Body.String() != want {
		t.Errorf("body = %q\nwant   %q", w.Body, want)
	}
	w = e.do(req{method: "GET", path: "/v1/network/services"})
	want = `{"error":{"code":"unauthorized","message":"missing bearer token"}}` + "\n"
	if w.Body.String() != want {
		t.Errorf("body = %q\nwant   %q", w.Body, want)
	}
}

func TestCodeStatus(t *testing.T) {
	for code, status := range map[api.Code]int{
		api.CodeInvalidRequest: 400, api.CodeUnauthorized: 401, api.CodeForbidden: 403,
		api.CodeNotFound: 404, api.CodeMethodNotAllowed: 405, api.CodeConflict: 409,
		api.CodePayloadTooLarge: 413, api.CodeUnsupportedMediaType: 415, api.CodeUnsupported: 422,
		api.CodeLimitExceeded: 422, api.CodeMissingPrerequisite: 422, api.CodeInternal: 500, api.Code("made_up"): 500,
	} {
		if got := code.Status(); got != status {
			t.Errorf("%s.Status() = %d, want %d", code, got, status)
		}
	}
}
