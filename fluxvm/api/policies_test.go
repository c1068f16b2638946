package api_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/policy"
)

// validPolicy is a well-formed policy of service "web".
const validPolicy = `{
  "service": "web",
  "enabled": true,
  "default_action": "deny",
  "allow_identities": [1001, 1002],
  "deny_identities": [2001],
  "audit_only": false,
  "l7": null
}`

func TestPoliciesEmpty(t *testing.T) {
	e := newEnv(t)
	w := e.do(req{method: "GET", path: "/v1/network/services/policies", token: readToken})
	want := `{"ipcache_prefixes":0,"ipcache_revision":0,"policies":[],"counters":{"denied":0,"missing":0,"audited":0,"rechecked":0,"revoked":0,"l7_redirected":0,"l7_bypass":0}}` + "\n"
	if w.Code != 200 || w.Body.String() != want {
		t.Errorf("GET policies: %d %s\nwant %s", w.Code, w.Body, want)
	}
	checkCommonHeaders(t, w)
	wantError(t, e.do(req{method: "GET", path: "/v1/network/services/web/policy", token: readToken}), 404, api.CodeNotFound, "")
	wantError(t, e.do(req{method: "DELETE", path: "/v1/network/services/web/policy", token: adminToken}), 404, api.CodeNotFound, "")
}

func TestApplyPolicy(t *testing.T) {
	e := newEnv(t)
	e.mustApply("web")
	e.mustApply("api")
	e.dp.ipcache = fluxvm.IPCache{Entries: []fluxvm.IPCacheEntry{{Prefix: netip.MustParsePrefix("10.0.0.0/24"), Identity: 1001}}}
	e.dp.policyCounts = fluxvm.PolicyCounters{Denied: 7, Revoked: 1}

	st := decodeOK[fluxvm.PoliciesStatus](t, e.do(req{method: "POST", path: "/v1/network/services/policies", token: adminToken, body: validPolicy}), 200)
	if len(st.Policies) != 1 || st.IPCachePrefixes != 1 || st.Counters.Denied != 7 || st.Counters.Revoked != 1 {
		t.Fatalf("status %+v", st)
	}
	p := st.Policies[0]
	if p.Service != "web" || !p.Enabled || p.DefaultAction != fluxvm.PolicyDeny ||
		!reflect.DeepEqual(p.AllowIdentities, []fluxvm.Identity{1001, 1002}) || !reflect.DeepEqual(p.DenyIdentities, []fluxvm.Identity{2001}) ||
		!reflect.DeepEqual(p.Unresolved, []fluxvm.Identity{1002, 2001}) {
		t.Errorf("policy %+v", p)
	}
	if len(e.dp.policyApplies) != 1 || len(e.dp.policyApplies[0]) != 1 || e.dp.policyApplies[0][0].Service != "web" {
		t.Errorf("applies %+v", e.dp.policyApplies)
	}
	if e.dp.lastCtx == nil {
		t.Error("no context reached the dataplane")
	}

	// An array is one ApplyPolicies call.
	arr := `[ {"service":"api","default_action":"allow","deny_identities":[5]},
	          {"service":"web","default_action":"allow","audit_only":true,"deny_identities":[1001]} ]`
	st = decodeOK[fluxvm.PoliciesStatus](t, e.do(req{method: "POST", path: "/v1/network/services/policies", token: adminToken, body: "\n  " + arr}), 200)
	if len(st.Policies) != 2 || st.Policies[0].Service != "api" || st.Policies[1].Service != "web" || !st.Policies[1].AuditOnly {
		t.Errorf("status %+v", st)
	}
	if len(e.dp.policyApplies) != 2 || len(e.dp.policyApplies[1]) != 2 {
		t.Errorf("applies %+v", e.dp.policyApplies)
	}
	// Lists are [] in the answers, never null.
	if !strings.Contains(e.do(req{method: "GET", path: "/v1/network/services/api/policy", token: readToken}).Body.String(), `"allow_identities":[]`) {
		t.Error("null list in the answer")
	}

	got := decodeOK[fluxvm.PolicyStatus](t, e.do(req{method: "GET", path: "/v1/network/services/web/policy", token: readToken}), 200)
	if got.Service != "web" || !got.AuditOnly || !reflect.DeepEqual(got.Unresolved, []fluxvm.Identity{}) {
		t.Errorf("GET policy %+v", got)
	}
	list := decodeOK[fluxvm.PoliciesStatus](t, e.do(req{method: "GET", path: "/v1/network/services/policies", token: readToken}), 200)
	if len(list.Policies) != 2 {
		t.Errorf("GET policies %+v", list)
	}

	w := e.do(req{method: "DELETE", path: "/v1/network/services/web/policy", token: adminToken})
	if w.Code != http.StatusNoContent || w.Body.Len() != 0 || w.Header().Get("Content-Type") != "" {
		t.Fatalf("DELETE policy: %d %v %q", w.Code, w.Header(), w.Body)
	}
	if !reflect.DeepEqual(e.dp.policyDeletes, []string{"web"}) || len(e.dp.deleted) != 0 {
		t.Errorf("policy deletes %v, service deletes %v", e.dp.policyDeletes, e.dp.deleted)
	}
	wantError(t, e.do(req{method: "DELETE", path: "/v1/network/services/web/policy", token: adminToken}), 404, api.CodeNotFound, "")
	wantError(t, e.do(req{method: "GET", path: "/v1/network/services/web/policy", token: readToken}), 404, api.CodeNotFound, "")
	// The service stays.
	decodeOK[fluxvm.ServiceStatus](t, e.do(req{method: "GET", path: "/v1/network/services/web", token: readToken}), 200)
}

func TestApplyPolicyErrors(t *testing.T) {
	for _, tc := range []struct {
		name        string
		body        string
		contentType string
		status      int
		code        api.Code
		field       string
	}{
		{name: "empty body", body: "", status: 400, code: api.CodeInvalidRequest, field: "*"},
		{name: "not JSON", body: "hello", status: 400, code: api.CodeInvalidRequest, field: "*"},
		{name: "null", body: "null", status: 400, code: api.CodeInvalidRequest, field: "*"},
		{name: "empty array", body: " [ ] ", status: 400, code: api.CodeInvalidRequest, field: ""},
		{name: "unknown field", body: `{"service":"web","default_action":"deny","colour":"red"}`, status: 400, code: api.CodeInvalidRequest, field: "colour"},
		{name: "repeated field", body: `{"service":"web","service":"web","default_action":"deny"}`, status: 400, code: api.CodeInvalidRequest, field: "service"},
		{name: "trailing data", body: validPolicy + " {}", status: 400, code: api.CodeInvalidRequest, field: "*"},
		{name: "no action", body: `{"service":"web"}`, status: 400, code: api.CodeInvalidRequest, field: "default_action"},
		{name: "bad action", body: `{"service":"web","default_action":"maybe"}`, status: 400, code: api.CodeInvalidRequest, field: "default_action"},
		{name: "identity 0", body: `{"service":"web","default_action":"deny","allow_identities":[0]}`, status: 400, code: api.CodeInvalidRequest, field: "allow_identities[0]"},
		{name: "identity out of range", body: `{"service":"web","default_action":"deny","deny_identities":[16777216]}`, status: 400, code: api.CodeInvalidRequest, field: "deny_identities[0]"},
		{name: "identity twice", body: `{"service":"web","default_action":"deny","deny_identities":[3,3]}`, status: 400, code: api.CodeInvalidRequest, field: "deny_identities[1]"},
		{name: "identity a string", body: `{"service":"web","default_action":"deny","deny_identities":["3"]}`, status: 400, code: api.CodeInvalidRequest, field: "deny_identities[0]"},
		{name: "too many identities", body: `{"service":"web","default_action":"deny","allow_identities":[` + idList(1025) + `]}`, status: 422, code: api.CodeLimitExceeded, field: "allow_identities"},
		{name: "reserved service", body: `{"service":"policies","default_action":"deny"}`, status: 400, code: api.CodeInvalidRequest, field: "service"},
		{name: "no such service", body: `{"service":"nope","default_action":"deny"}`, status: 422, code: api.CodeMissingPrerequisite, field: "service"},
		{name: "array: field of the element", body: `[` + validPolicy + `,{"service":"web2","default_action":"deny","deny_identities":[0]}]`, status: 400, code: api.CodeInvalidRequest, field: "[1].deny_identities[0]"},
		{name: "array: no such service", body: `[` + validPolicy + `,{"service":"nope","default_action":"deny"}]`, status: 422, code: api.CodeMissingPrerequisite, field: "[1].service"},
		{name: "array: service twice", body: `[` + validPolicy + `,` + validPolicy + `]`, status: 409, code: api.CodeConflict, field: "[1].service"},
		{name: "array: null element", body: `[null]`, status: 400, code: api.CodeInvalidRequest, field: "[0]"},
		{name: "bad l7 mode", body: `{"service":"web","default_action":"deny","l7":{"mode":"sometimes","protocol":"http"}}`, status: 400, code: api.CodeInvalidRequest, field: "l7.mode"},
		{name: "not JSON media type", body: validPolicy, contentType: "text/plain", status: 415, code: api.CodeUnsupportedMediaType, field: ""},
		{name: "too large", body: validPolicy + strings.Repeat(" ", 4096), status: 413, code: api.CodePayloadTooLarge, field: "*"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, func(o *api.Options) { o.MaxBodyBytes = 4096 })
			e.mustApply("web")
			e.mustApply("web2")
			r := req{method: "POST", path: "/v1/network/services/policies", token: adminToken, body: tc.body, contentType: tc.contentType}
			if tc.contentType == "" {
				r.header = http.Header{"Content-Type": {"application/json"}}
			}
			w := e.do(r)
			wantError(t, w, tc.status, tc.code, tc.field)
			if len(e.dp.policyApplies) != 0 {
				t.Errorf("a refused request reached the dataplane: %+v", e.dp.policyApplies)
			}
		})
	}
}

func idList(n int) string {
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, i+1)
	}
	return b.String()
}

// TestApplyPolicyDataplaneErrors: what ApplyPolicies returns is mapped
// like the errors of a service apply; a service deleted between the
// handler's check and the compile (policy.ErrNoService) is 422
// missing_prerequisite.
func TestApplyPolicyDataplaneErrors(t *testing.T) {
	for _, tc := range []struct {
		err    error
		status int
		code   api.Code
	}{
		{fmt.Errorf("x: %w", &fluxvm.ValidationError{Field: "policies", Reason: "at most 64 services may have a policy", Kind: fluxvm.ErrLimit}), 422, api.CodeLimitExceeded},
		{fmt.Errorf("x: %w", &fluxvm.ValidationError{Field: "l7.mode", Reason: "enforce needs a service in mode nat", Kind: fluxvm.ErrUnsupported}), 422, api.CodeUnsupported},
		{fmt.Errorf("x: %w", fluxvm.ErrConflict), 409, api.CodeConflict},
		{fmt.Errorf("x: %w", fluxvm.ErrClosed), 503, api.CodeUnavailable},
		{context.Canceled, 503, api.CodeUnavailable},
		{errors.New("map update failed: EPERM"), 500, api.CodeInternal},
	} {
		e := newEnv(t)
		e.mustApply("web")
		e.dp.policyErr = tc.err
		w := e.do(req{method: "POST", path: "/v1/network/services/policies", token: adminToken, body: validPolicy})
		d := wantError(t, w, tc.status, tc.code, "*")
		if tc.code == api.CodeInternal && strings.Contains(d.Message, "EPERM") {
			t.Errorf("internal detail sent: %q", d.Message)
		}
	}
	// A service deleted between the handler's check and the compile.
	e := newEnv(t)
	e.mustApply("web")
	e.dp.policyErr = fmt.Errorf("fluxvm: apply identity policies: policy: compile: policies[0]: service %q: %w", "web", policy.ErrNoService)
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/policies", token: adminToken, body: validPolicy}), 422, api.CodeMissingPrerequisite, "")
}

func TestReconcilePolicies(t *testing.T) {
	// Without a source: the current state is recompiled (ApplyPolicies
	// with no policy).
	e := newEnv(t)
	e.mustApply("web")
	e.do(req{method: "POST", path: "/v1/network/services/policies", token: adminToken, body: validPolicy})
	for _, body := range []string{"", "{}", " { } "} {
		st := decodeOK[fluxvm.PoliciesStatus](t, e.do(req{method: "POST", path: "/v1/network/services/policies/reconcile", token: adminToken, body: body}), 200)
		if len(st.Policies) != 1 {
			t.Errorf("status %+v", st)
		}
	}
	if n := len(e.dp.policyApplies); n != 4 || len(e.dp.policyApplies[3]) != 0 || len(e.dp.ipcacheSets) != 0 {
		t.Errorf("applies %+v, ipcache sets %d", e.dp.policyApplies, len(e.dp.ipcacheSets))
	}
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/policies/reconcile", token: adminToken, body: `{"force":true}`}), 400, api.CodeInvalidRequest, "force")
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/policies/reconcile", token: adminToken, body: `[]`}), 400, api.CodeInvalidRequest, "")

	// With a source: it is read on every reconcile and applied.
	ipc := fluxvm.IPCache{Entries: []fluxvm.IPCacheEntry{{Prefix: netip.MustParsePrefix("10.0.0.0/24"), Identity: 1001}}}
	var srcErr error
	reads := 0
	e = newEnv(t, func(o *api.Options) {
		o.IPCacheSource = func(ctx context.Context) (fluxvm.IPCache, error) {
			reads++
			if ctx == nil {
				t.Error("nil context")
			}
			return ipc, srcErr
		}
	})
	e.mustApply("web")
	e.do(req{method: "POST", path: "/v1/network/services/policies", token: adminToken, body: validPolicy})
	st := decodeOK[fluxvm.PoliciesStatus](t, e.do(req{method: "POST", path: "/v1/network/services/policies/reconcile", token: adminToken}), 200)
	if reads != 1 || len(e.dp.ipcacheSets) != 1 || st.IPCachePrefixes != 1 || !reflect.DeepEqual(st.Policies[0].Unresolved, []fluxvm.Identity{1002, 2001}) {
		t.Errorf("reads %d, sets %d, status %+v", reads, len(e.dp.ipcacheSets), st)
	}
	// A failing source changes nothing: 422 with its message.
	srcErr = errors.New("ipcache_file /etc/fluxvm/ipcache.json: no such file or directory")
	d := wantError(t, e.do(req{method: "POST", path: "/v1/network/services/policies/reconcile", token: adminToken}), 422, api.CodeMissingPrerequisite, "")
	if !strings.Contains(d.Message, "/etc/fluxvm/ipcache.json") {
		t.Errorf("message %q", d.Message)
	}
	// An ipcache the source returns that does not validate: 422, the
	// field named.
	srcErr = nil
	ipc.Entries = append(ipc.Entries, fluxvm.IPCacheEntry{Prefix: netip.MustParsePrefix("10.0.1.1/24"), Identity: 5})
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/policies/reconcile", token: adminToken}), 422, api.CodeMissingPrerequisite, "ipcache.entries[1].prefix")
	if len(e.dp.ipcacheSets) != 1 {
		t.Errorf("a failed source reached the dataplane: %d sets", len(e.dp.ipcacheSets))
	}
	srcErr = context.DeadlineExceeded
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/policies/reconcile", token: adminToken}), 503, api.CodeUnavailable, "")
}

// TestPolicyRoutesReservedNames: the {name}/policy routes never treat a
// reserved word as a service.
func TestPolicyRoutesReservedNames(t *testing.T) {
	e := newEnv(t)
	for _, w := range fluxvm.ReservedNames() {
		for _, m := range []string{"GET", "DELETE"} {
			d := wantError(t, e.do(req{method: m, path: "/v1/network/services/" + w + "/policy", token: adminToken}), 404, api.CodeNotFound, "")
			if !strings.Contains(d.Message, "no such route") {
				t.Errorf("%s %s/policy: %q", m, w, d.Message)
			}
		}
	}
	if len(e.dp.policyDeletes) != 0 {
		t.Error("reached the dataplane")
	}
	// Other methods of the literal routes.
	w := e.do(req{method: "PUT", path: "/v1/network/services/policies", token: adminToken, body: "{}"})
	wantError(t, w, 405, api.CodeMethodNotAllowed, "")
	w = e.do(req{method: "GET", path: "/v1/network/services/policies/reconcile", token: adminToken})
	wantError(t, w, 405, api.CodeMethodNotAllowed, "")
	if allow := w.Header().Get("Allow"); allow != "POST" {
		t.Errorf("Allow = %q", allow)
	}
}

// TestEnvoyRoute: GET …/{name}/l7/envoy answers the document of a service
// whose policy has an l7 part (read token), 404 otherwise.
func TestEnvoyRoute(t *testing.T) {
	e := newEnv(t)
	e.mustApply("web")
	e.mustApply("api")
	body := `[{"service":"web","default_action":"allow","l7":{"mode":"observe","protocol":"http"}},
	          {"service":"api","default_action":"allow"}]`
	decodeOK[fluxvm.PoliciesStatus](t, e.do(req{method: "POST", path: "/v1/network/services/policies", token: adminToken, body: body}), 200)
	doc := decodeOK[fluxvm.EnvoyDocument](t, e.do(req{method: "GET", path: "/v1/network/services/web/l7/envoy", token: readToken}), 200)
	if doc.Service != "web" || doc.Mode != fluxvm.L7Observe || doc.Protocol != fluxvm.L7HTTP {
		t.Errorf("document %+v", doc)
	}
	for _, name := range []string{"api", "nosuch"} {
		if rec := e.do(req{method: "GET", path: "/v1/network/services/" + name + "/l7/envoy", token: readToken}); rec.Code != 404 {
			t.Errorf("%s: %d %s, want 404", name, rec.Code, rec.Body)
		}
	}
}
