package api_test

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// TestSetSNATPeers: POST …/snat/peers takes the whole set (admin only),
// answers with the SNAT status, and maps the dataplane's refusals.
func TestSetSNATPeers(t *testing.T) {
	e := newEnv(t)
	const path = "/v1/network/services/snat/peers"
	want := []netip.Addr{netip.MustParseAddr("10.97.0.2"), netip.MustParseAddr("fd00:97::2")}
	got := decodeOK[fluxvm.SNATStatus](t, e.do(req{method: "POST", path: path, token: adminToken,
		body: `{"addresses":["10.97.0.2","fd00:97::2"],"announce":["fd00:97::2"]}`}), 200)
	if !slices.Equal(got.Peers, want) || !slices.Equal(e.dp.status.SNAT.Peers, want) || !slices.Equal(got.Announced, want[1:]) {
		t.Errorf("answer %+v, dataplane %v; want peers %v, %v announced", got, e.dp.status.SNAT.Peers, want, want[1])
	}
	if got := decodeOK[fluxvm.SNATStatus](t, e.do(req{method: "POST", path: path, token: adminToken, body: `{"addresses":[]}`}), 200); len(got.Peers) != 0 {
		t.Errorf("clearing: %+v", got)
	}
	for _, tc := range []struct{ body, field string }{
		{`{}`, "addresses"},
		{`{"addresses":null}`, "addresses"},
		{`{"addresses":["10.97.0.2"],"addresses":[]}`, "addresses"},
		{`{"addresses":["10.97.0"]}`, ""},
		{`{"addresses":["10.97.0.2"],"extra":1}`, "extra"},
		{`{"announce":["10.97.0.2"]}`, "addresses"},
	} {
		wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: tc.body}), 400, api.CodeInvalidRequest, tc.field)
	}
	wantError(t, e.do(req{method: "POST", path: path, token: readToken, body: `{"addresses":[]}`}), 403, api.CodeForbidden, "")
	wantError(t, e.do(req{method: "GET", path: path, token: adminToken}), 405, api.CodeMethodNotAllowed, "")
	e.dp.snatPeersErr = fmt.Errorf("fluxvm: set SNAT peers: %w", &fluxvm.ValidationError{Field: "addresses[0]", Reason: "own", Kind: fluxvm.ErrInvalid})
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: `{"addresses":["10.97.0.1"]}`}), 400, api.CodeInvalidRequest, "addresses[0]")
	e.dp.snatPeersErr = fmt.Errorf("fluxvm: set SNAT peers: %w", &fluxvm.ValidationError{Field: "north_south_interfaces", Reason: "none", Kind: fluxvm.ErrPrerequisite})
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: `{"addresses":[]}`}), 422, api.CodeMissingPrerequisite, "north_south_interfaces")
}
