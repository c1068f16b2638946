package api_test

import (
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// TestAdvertisements checks that the route sends the snapshot byte for
// byte as the file holds it (the contract's example document), to a read
// token, and never null lists.
func TestAdvertisements(t *testing.T) {
	const path = "/v1/network/services/advertisements"
	e := newEnv(t)

	// Nothing published: lists are [] and the document says generation 0.
	w := e.do(req{method: "GET", path: path, token: readToken})
	body := w.Body.String()
	if w.Code != 200 || !strings.Contains(body, `"entries": []`) || !strings.Contains(body, `"generation": 0`) {
		t.Errorf("empty snapshot: %d %s", w.Code, body)
	}
	checkCommonHeaders(t, w)

	golden, err := os.ReadFile("../../advert/testdata/snapshot.json")
	if err != nil {
		t.Fatal(err)
	}
	s, err := advert.Decode(golden)
	if err != nil {
		t.Fatal(err)
	}
	e.dp.adverts = s
	w = e.do(req{method: "GET", path: path, token: readToken})
	if w.Code != 200 {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	checkCommonHeaders(t, w)
	if w.Body.String() != string(golden) {
		t.Errorf("body differs from the file format:\n got %s\nwant %s", w.Body, golden)
	}
	got, err := advert.Decode(w.Body.Bytes())
	if err != nil {
		t.Fatalf("adapters cannot decode the response: %v", err)
	}
	if !reflect.DeepEqual(got, s) {
		t.Errorf("decoded %+v, want %+v", got, s)
	}

	wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: "{}"}), 405, api.CodeMethodNotAllowed, "")
	wantError(t, e.do(req{method: "GET", path: path}), 401, api.CodeUnauthorized, "")
	// The literal segment wins over {name}.
	e.mustApply("web")
	if w := e.do(req{method: "GET", path: path, token: readToken}); !strings.Contains(w.Body.String(), `"schema_version": 1`) {
		t.Errorf("/advertisements served %s", w.Body)
	}
}
