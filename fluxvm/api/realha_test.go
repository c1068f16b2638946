//go:build linux

package api_test

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestSnapshotRoutesWithoutHA runs the HA routes of the real handler
// over real dataplanes without replication (no ha_epoch), requests
// served in memory: with no north-south edge the snapshot routes answer
// 422 naming north_south_interfaces and read nothing; with one they
// answer 200 (a snapshot under no lease, with no journal cursor, carrying
// a live north-south flow; its import), while delta, delta import, ack
// and lease answer 422 saying that the journal needs ha_epoch.
func TestSnapshotRoutesWithoutHA(t *testing.T) {
	testenv.RequirePrivileged(t)
	l := lab.NewForTest(t)
	cli := l.AddVMForTest(t, 1)
	be := l.AddVMForTest(t, 2)
	srv, err := be.Serve(8080)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	ext, err := l.AddExternal()
	if err != nil {
		t.Fatal(err)
	}
	vip := netip.MustParseAddr("10.96.0.10")
	open := func(northSouth bool) (*fluxvm.Dataplane, http.Handler) {
		t.Helper()
		o := fluxvm.Options{
			Loader:              bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierS},
			CatalogPath:         filepath.Join(t.TempDir(), "catalog.json"),
			ConntrackGCInterval: -1,
			Interfaces:          []fluxvm.VMEdgeInterface{{Name: cli.NodeIf, VMID: cli.Name}, {Name: be.NodeIf, VMID: be.Name}},
			InNamespace:         l.Node.Do,
		}
		svc := fluxvm.Service{Name: "web", VIPs: []netip.Addr{vip}, Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
			Backends: []fluxvm.Backend{{Address: be.Addr4, Port: 8080}}}
		if northSouth {
			o.NorthSouth = fluxvm.NorthSouth{Interfaces: []string{"uplink"}, SNATAddress: netip.MustParseAddr("10.250.0.100"), SNATPortMin: 62000, SNATPortMax: 62999}
			svc.Exposure = fluxvm.ExposureBoth
		}
		d, err := fluxvm.Open(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		if _, err := d.ApplyService(context.Background(), svc); err != nil {
			t.Fatal(err)
		}
		h, err := api.New(api.RolesOf(d), api.Options{AdminTokens: []string{adminToken}, ReadTokens: []string{readToken}})
		if err != nil {
			t.Fatal(err)
		}
		return d, h
	}
	importReq := func(body []byte) *http.Request {
		hr := httptest.NewRequest("POST", "/v1/network/services/web/conntrack/import?prune=true", bytes.NewReader(body))
		hr.Header.Set("Authorization", "Bearer "+adminToken)
		hr.Header.Set("Content-Type", octet)
		return hr
	}

	// No north-south edge: the snapshots name it; nothing is read.
	d, h := open(false)
	w := serve(h, req{method: "GET", path: "/v1/network/services/web/conntrack/export", token: readToken})
	if e := wantError(t, w, 422, api.CodeMissingPrerequisite, "north_south_interfaces"); !strings.Contains(e.Message, "north-south edge") {
		t.Errorf("export without the north-south edge: %q", e.Message)
	}
	body := &countReader{r: strings.NewReader("FXVMHA\r\n never read")}
	rec := httptest.NewRecorder()
	hr := importReq(nil)
	hr.Body = body
	h.ServeHTTP(rec, hr)
	wantError(t, rec, 422, api.CodeMissingPrerequisite, "north_south_interfaces")
	if body.n != 0 {
		t.Errorf("an import refused for its prerequisite read %d bytes", body.n)
	}
	if err := d.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}

	// A north-south edge, no replication: a live flow through the uplink.
	_, h = open(true)
	c, err := ext.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.Echo([]byte("hello"), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	w = serve(h, req{method: "GET", path: "/v1/network/services/web/conntrack/export", token: readToken})
	if w.Code != 200 {
		t.Fatalf("export without HA: %d %s", w.Code, w.Body)
	}
	snap := w.Body.Bytes()
	hdr, n, err := readSnapshot(bytes.NewReader(snap))
	if err != nil || n < 1 || hdr.Epoch != 0 || hdr.Journal != "" || hdr.Seq != 0 || hdr.Service != "web" {
		t.Fatalf("snapshot without HA: %+v, %d flows, %v; want the flow, epoch 0, no cursor", hdr, n, err)
	}
	if got := w.Result().Trailer.Get(api.TrailerExportFlows); got != "1" {
		t.Errorf("trailer %s = %q, want 1", api.TrailerExportFlows, got)
	}
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, importReq(snap))
	res := decodeOK[ha.ImportResult](t, rec, 200)
	if res.Flows != 1 || res.Fresher != 1 || res.Pruned != 0 || res.Header.Epoch != 0 {
		t.Errorf("import of the node's own snapshot: %+v; want the flow read, kept as fresher, nothing pruned", res)
	}
	if err := c.Echo([]byte("still"), 3*time.Second); err != nil {
		t.Errorf("the flow after the import: %v", err)
	}

	// What needs the journal (or a lease) says so.
	for _, r := range []req{
		{method: "GET", path: "/v1/network/services/web/conntrack/delta?journal=j1&seq=0", token: readToken},
		{method: "POST", path: "/v1/network/services/web/conntrack/delta/import", token: adminToken, body: `{"service":"web","journal":"j1","epoch":1,"from":0,"to":0}`},
		{method: "POST", path: "/v1/network/services/web/conntrack/delta/ack", token: adminToken, body: `{"seq":1}`},
		{method: "POST", path: "/v1/network/services/ha/lease", token: adminToken, body: `{"epoch":1}`},
	} {
		e := wantError(t, serve(h, r), 422, api.CodeMissingPrerequisite, "ha_epoch")
		if !strings.Contains(e.Message, "set ha_epoch") || !strings.Contains(e.Message, "journal") {
			t.Errorf("%s %s: %q does not say that the journal needs ha_epoch", r.method, r.path, e.Message)
		}
	}
	if st := decodeOK[fluxvm.HAStatus](t, serve(h, req{method: "GET", path: "/v1/network/services/ha", token: readToken}), 200); st.Enabled {
		t.Errorf("HA status: %+v, want off", st)
	}
}

// countReader counts the bytes read through it.
type countReader struct {
	r interface{ Read([]byte) (int, error) }
	n int
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

func (c *countReader) Close() error { return nil }
