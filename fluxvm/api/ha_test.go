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
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
)

// snapshot returns a complete snapshot stream of n fake flows of service.
func snapshot(t testing.TB, service string, n int) []byte {
	t.Helper()
	var buf bytes.Buffer
	sw, err := ha.NewWriter(&buf, ha.Header{Node: "node-b", Service: service, Epoch: 3, Journal: "jb", Seq: 7, Seeds: &ha.Seeds{}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		fl := fakeFlow(i)
		if err := sw.Write(&fl); err != nil {
			t.Fatal(err)
		}
	}
	if err := sw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// readSnapshot reads a whole stream and returns its header and flow count.
func readSnapshot(r io.Reader) (ha.Header, int, error) {
	sr, err := ha.NewReader(r)
	if err != nil {
		return ha.Header{}, 0, err
	}
	n := 0
	for {
		fl, err := sr.Next()
		if errors.Is(err, io.EOF) {
			return sr.Header(), n, nil
		}
		if err != nil {
			return sr.Header(), n, err
		}
		n += len(fl)
	}
}

const octet = "application/octet-stream"

func TestHAStatusAndLease(t *testing.T) {
	e := newEnv(t)
	st := decodeOK[fluxvm.HAStatus](t, e.do(req{method: "GET", path: "/v1/network/services/ha", token: readToken}), 200)
	if !st.Enabled || st.Epoch != 3 || st.Interval.Duration != time.Second {
		t.Errorf("status %+v", st)
	}
	lease := func(body string) *httptest.ResponseRecorder {
		return e.do(req{method: "POST", path: "/v1/network/services/ha/lease", token: adminToken, body: body})
	}
	st = decodeOK[fluxvm.HAStatus](t, lease(`{"epoch":4}`), 200)
	if st.Epoch != 4 || st.SupersededBy != 0 {
		t.Errorf("after renew: %+v", st)
	}
	st = decodeOK[fluxvm.HAStatus](t, lease(`{"superseded_by":9}`), 200)
	if st.Epoch != 4 || st.SupersededBy != 9 {
		t.Errorf("after fence: %+v", st)
	}
	if got := decodeOK[fluxvm.HAStatus](t, e.do(req{method: "GET", path: "/v1/network/services/ha", token: readToken}), 200); !reflect.DeepEqual(got, st) {
		t.Errorf("GET after the lease %+v, POST answered %+v", got, st)
	}
	for _, tc := range []struct {
		name, body, contentType string
		status                  int
		code                    api.Code
		field                   string
		reaches                 bool // the dataplane is called
	}{
		{"stale epoch", `{"epoch":2}`, "", 409, api.CodeStaleEpoch, "", true},
		{"empty lease", `{}`, "", 400, api.CodeInvalidRequest, "lease", true},
		{"unknown field", `{"epoch":5,"term":1}`, "", 400, api.CodeInvalidRequest, "term", false},
		{"repeated field", `{"epoch":5,"epoch":6}`, "", 400, api.CodeInvalidRequest, "epoch", false},
		{"negative", `{"epoch":-1}`, "", 400, api.CodeInvalidRequest, "*", false},
		{"trailing data", `{"epoch":5} {}`, "", 400, api.CodeInvalidRequest, "*", false},
		{"text/plain", `{"epoch":5}`, "text/plain", 415, api.CodeUnsupportedMediaType, "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := len(e.dp.ha.leases)
			wantError(t, e.do(req{method: "POST", path: "/v1/network/services/ha/lease", token: adminToken, body: tc.body, contentType: tc.contentType}),
				tc.status, tc.code, tc.field)
			if called := len(e.dp.ha.leases) > before; called != tc.reaches {
				t.Errorf("dataplane called: %v, want %v", called, tc.reaches)
			}
		})
	}
	if st := (fakeReplication{e.dp}).Status(); st.Epoch != 4 || st.SupersededBy != 9 {
		t.Errorf("a refused lease changed the state: %+v", st)
	}

	// Replication off.
	e.dp.ha.off = true
	st = decodeOK[fluxvm.HAStatus](t, e.do(req{method: "GET", path: "/v1/network/services/ha", token: readToken}), 200)
	if st.Enabled {
		t.Errorf("off: %+v", st)
	}
	if d := wantError(t, lease(`{"epoch":7}`), 422, api.CodeMissingPrerequisite, "ha_epoch"); !strings.Contains(d.Message, "set ha_epoch") {
		t.Errorf("lease with replication off: %q does not say to set ha_epoch", d.Message)
	}
}

func TestExportConntrack(t *testing.T) {
	e := newEnv(t)
	e.mustApply("web")
	w := e.do(req{method: "GET", path: "/v1/network/services/web/conntrack/export", token: readToken})
	if w.Code != 200 {
		t.Fatalf("export: %d %s", w.Code, w.Body)
	}
	if ct := w.Header().Get("Content-Type"); ct != octet {
		t.Errorf("Content-Type %q", ct)
	}
	if cc := w.Header().Get("Cache-Control"); cc != "no-store" {
		t.Errorf("Cache-Control %q", cc)
	}
	hdr, n, err := readSnapshot(bytes.NewReader(w.Body.Bytes()))
	if err != nil || n != 3 || hdr.Service != "web" || hdr.Journal != "j1" || hdr.Seq != 5 {
		t.Fatalf("stream: %+v, %d flows, %v", hdr, n, err)
	}
	tr := w.Result().Trailer
	for k, want := range map[string]string{api.TrailerExportFlows: "3", api.TrailerExportExpired: "2",
		api.TrailerExportNoBackend: "1", api.TrailerExportNotCarried: "0"} {
		if got := tr.Get(k); got != want {
			t.Errorf("trailer %s = %q, want %q (trailers %v)", k, got, want, tr)
		}
	}

	// Errors before the first byte are JSON errors.
	for _, tc := range []struct {
		name    string
		path    string
		setup   func(f *fakeDataplane)
		status  int
		code    api.Code
		message string
	}{
		{"unknown service", "/v1/network/services/nope/conntrack/export", nil, 404, api.CodeNotFound, "nope"},
		{"reserved word", "/v1/network/services/ha/conntrack/export", nil, 404, api.CodeNotFound, "no such route"},
		{"no north-south edge", "/v1/network/services/web/conntrack/export", func(f *fakeDataplane) { f.ha.noNS = true }, 422, api.CodeMissingPrerequisite, "north_south_interfaces"},
		{"fenced", "/v1/network/services/web/conntrack/export", func(f *fakeDataplane) {
			f.ha.err = fmt.Errorf("fluxvm: export flows of web: ha: journal web/j1: checkpoint: epoch 3, fenced by 4: %w", ha.ErrFenced)
		}, 409, api.CodeFenced, "fenced by 4"},
		{"closed", "/v1/network/services/web/conntrack/export", func(f *fakeDataplane) { f.ha.err = fmt.Errorf("export: %w", fluxvm.ErrClosed) }, 503, api.CodeUnavailable, ""},
		{"failure inside the first buffer", "/v1/network/services/web/conntrack/export", func(f *fakeDataplane) {
			f.ha.exportFlows, f.ha.exportErrAfter = 10, errors.New("scan fct4: EIO")
		}, 500, api.CodeInternal, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.mustApply("web")
			if tc.setup != nil {
				tc.setup(e.dp)
			}
			d := wantError(t, e.do(req{method: "GET", path: tc.path, token: readToken}), tc.status, tc.code, "*")
			if !strings.Contains(d.Message, tc.message) {
				t.Errorf("message %q does not contain %q", d.Message, tc.message)
			}
		})
	}

	// Replication off: the snapshot streams all the same, under no lease
	// and with no journal cursor.
	e = newEnv(t)
	e.mustApply("web")
	e.dp.ha.off = true
	w = e.do(req{method: "GET", path: "/v1/network/services/web/conntrack/export", token: readToken})
	if w.Code != 200 {
		t.Fatalf("export with replication off: %d %s", w.Code, w.Body)
	}
	if hdr, n, err := readSnapshot(bytes.NewReader(w.Body.Bytes())); err != nil || n != 3 || hdr.Epoch != 0 || hdr.Journal != "" || hdr.Seq != 0 {
		t.Errorf("stream with replication off: %+v, %d flows, %v; want epoch 0, no cursor", hdr, n, err)
	}
}

// TestExportStreams checks that the snapshot reaches the client while the
// export is still running: the fake stops after 8 MiB until the client
// has read 1 MiB, which a handler holding the snapshot would never let
// happen.
func TestExportStreams(t *testing.T) {
	e := newEnv(t, func(o *api.Options) { o.Logger = slog.New(slog.NewTextHandler(&syncBuffer{}, nil)) })
	e.mustApply("web")
	const flows = 200_000 // 25.6 MB
	gate := make(chan struct{})
	e.dp.ha.exportFlows, e.dp.ha.exportGate, e.dp.ha.exportGateAt = flows, gate, 8<<20
	srv := httptest.NewServer(e.h)
	defer srv.Close()
	// On failure: the client goes away and the fake goes on, so that the
	// server can close.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opened := false
	defer func() {
		if !opened {
			close(gate)
		}
	}()

	hr, _ := http.NewRequestWithContext(ctx, "GET", srv.URL+"/v1/network/services/web/conntrack/export", nil)
	hr.Header.Set("Authorization", "Bearer "+readToken)
	type result struct {
		resp *http.Response
		head []byte
		err  error
	}
	ch := make(chan result, 1)
	go func() {
		resp, err := srv.Client().Do(hr)
		if err != nil {
			ch <- result{err: err}
			return
		}
		head := make([]byte, 1<<20)
		_, err = io.ReadFull(resp.Body, head)
		ch <- result{resp, head, err}
	}()
	var res result
	select {
	case res = <-ch:
	case <-time.After(20 * time.Second):
		t.Fatal("the first MiB did not arrive while the export runs: the handler buffers the snapshot")
	}
	if res.err != nil {
		t.Fatal(res.err)
	}
	defer res.resp.Body.Close()
	e.dp.mu.Lock()
	done := e.dp.ha.exported != 0
	e.dp.mu.Unlock()
	if done {
		t.Fatal("the export had finished before the client read the first MiB")
	}
	if res.resp.StatusCode != 200 || res.resp.Header.Get("Content-Type") != octet || res.resp.ContentLength != -1 {
		t.Errorf("answer %d %q length %d", res.resp.StatusCode, res.resp.Header.Get("Content-Type"), res.resp.ContentLength)
	}
	close(gate)
	opened = true
	hdr, n, err := readSnapshot(io.MultiReader(bytes.NewReader(res.head), res.resp.Body))
	if err != nil || n != flows || hdr.Service != "web" {
		t.Fatalf("stream: %+v, %d flows, %v", hdr, n, err)
	}
	// Trailers arrive after the body's end.
	if rest, err := io.ReadAll(res.resp.Body); err != nil || len(rest) != 0 {
		t.Errorf("after the end record: %d bytes, %v", len(rest), err)
	}
	if got := res.resp.Trailer.Get(api.TrailerExportFlows); got != fmt.Sprint(flows) {
		t.Errorf("trailer %s = %q (trailers %v)", api.TrailerExportFlows, got, res.resp.Trailer)
	}
}

// TestExportAbortsAfterFirstByte checks that an export failing after the
// stream started ends the answer as a broken transfer: the client sees a
// read error, the bytes it got are refused as truncated, and the node
// logs the cause.
func TestExportAbortsAfterFirstByte(t *testing.T) {
	logs := &syncBuffer{}
	e := newEnv(t, func(o *api.Options) { o.Logger = slog.New(slog.NewTextHandler(logs, nil)) })
	e.mustApply("web")
	e.dp.ha.exportFlows, e.dp.ha.exportErrAfter = 5000, errors.New("scan fct4: EIO")
	srv := httptest.NewServer(e.h)
	defer srv.Close()
	hr, _ := http.NewRequest("GET", srv.URL+"/v1/network/services/web/conntrack/export", nil)
	hr.Header.Set("Authorization", "Bearer "+readToken)
	resp, err := srv.Client().Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	got, err := io.ReadAll(resp.Body)
	if err == nil {
		t.Fatalf("the aborted answer read as complete (%d bytes)", len(got))
	}
	if len(got) == 0 {
		t.Fatal("no byte arrived before the abort")
	}
	if _, _, err := readSnapshot(bytes.NewReader(got)); !errors.Is(err, ha.ErrTruncated) {
		t.Errorf("the partial stream reads with %v, want ha.ErrTruncated", err)
	}
	if resp.Trailer.Get(api.TrailerExportFlows) != "" {
		t.Errorf("trailers on an aborted answer: %v", resp.Trailer)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(logs.String(), "scan fct4: EIO") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if !strings.Contains(logs.String(), "scan fct4: EIO") {
		t.Errorf("cause not logged:\n%s", logs.String())
	}
}

// syncBuffer is a log sink the server's goroutines and the test share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func TestImportConntrack(t *testing.T) {
	snap := snapshot(t, "web", 1500)
	corrupt := bytes.Clone(snap)
	corrupt[len(corrupt)/2] ^= 0xff
	for _, tc := range []struct {
		name        string
		query       string
		body        []byte
		contentType string
		setup       func(f *fakeDataplane)
		path        string
		status      int
		code        api.Code
		field       string
		reaches     bool
		prune       bool
	}{
		{name: "ok", body: snap, status: 200, reaches: true},
		{name: "prune", query: "?prune=true", body: snap, status: 200, reaches: true, prune: true},
		{name: "prune false", query: "?prune=false", body: snap, status: 200, reaches: true},
		{name: "prune garbage", query: "?prune=yes", body: snap, status: 400, code: api.CodeInvalidRequest, field: "prune"},
		{name: "prune empty", query: "?prune=", body: snap, status: 400, code: api.CodeInvalidRequest, field: "prune"},
		{name: "json body", body: snap, contentType: "application/json", status: 415, code: api.CodeUnsupportedMediaType},
		{name: "other service", body: snapshot(t, "api", 3), status: 400, code: api.CodeServiceMismatch, reaches: true},
		{name: "truncated", body: snap[:len(snap)-10], status: 400, code: api.CodeSnapshotCorrupt, reaches: true},
		{name: "corrupt", body: corrupt, status: 400, code: api.CodeSnapshotCorrupt, reaches: true},
		{name: "not a snapshot", body: []byte("hello, this is not a snapshot"), status: 422, code: api.CodeSnapshotUnreadable, reaches: true},
		{name: "empty body", body: nil, status: 422, code: api.CodeSnapshotUnreadable, reaches: true},
		{name: "unknown service", path: "/v1/network/services/nope/conntrack/import", body: snap, status: 404, code: api.CodeNotFound},
		{name: "reserved word", path: "/v1/network/services/status/conntrack/import", body: snap, status: 404, code: api.CodeNotFound},
		{name: "replication off", body: snap, setup: func(f *fakeDataplane) { f.ha.off = true }, status: 200, reaches: true},
		{name: "no north-south edge", body: snap, setup: func(f *fakeDataplane) { f.ha.noNS = true }, status: 422, code: api.CodeMissingPrerequisite, field: "north_south_interfaces"},
		{name: "stale epoch", body: snap, setup: func(f *fakeDataplane) {
			f.ha.err = fmt.Errorf("fluxvm: ha: import into web: snapshot of epoch 3, this edge accepted 5: %w", ha.ErrStaleEpoch)
		}, status: 409, code: api.CodeStaleEpoch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.mustApply("web")
			if tc.setup != nil {
				tc.setup(e.dp)
			}
			path := tc.path
			if path == "" {
				path = "/v1/network/services/web/conntrack/import"
			}
			ct := tc.contentType
			if ct == "" {
				ct = octet
			}
			hr := httptest.NewRequest("POST", path+tc.query, bytes.NewReader(tc.body))
			hr.Header.Set("Authorization", "Bearer "+adminToken)
			hr.Header.Set("Content-Type", ct)
			w := httptest.NewRecorder()
			e.h.ServeHTTP(w, hr)
			imports := e.dp.ha.imports
			if tc.status == 200 {
				res := decodeOK[ha.ImportResult](t, w, 200)
				if res.Flows != 1500 || res.Written != 1500 || res.Header.Service != "web" || res.Header.Journal != "jb" {
					t.Errorf("result %+v", res)
				}
				if (res.Pruned != 0) != tc.prune {
					t.Errorf("pruned %d, prune %v", res.Pruned, tc.prune)
				}
				if len(imports) != 1 || imports[0].prune != tc.prune || imports[0].read != int64(len(snap)) {
					t.Errorf("imports %+v (snapshot of %d bytes)", imports, len(snap))
				}
			} else {
				wantError(t, w, tc.status, tc.code, tc.field)
			}
			if read := len(imports) > 0; read != tc.reaches {
				t.Errorf("the dataplane read the body: %v, want %v (%+v)", read, tc.reaches, imports)
			}
		})
	}
}

// TestImportConntrackLimit checks the bound of the snapshot body: by
// Content-Length before anything is read, and while reading a body
// without one.
func TestImportConntrackLimit(t *testing.T) {
	snap := snapshot(t, "web", 100) // 12.8 kB
	e := newEnv(t, func(o *api.Options) { o.MaxSnapshotBytes = 4096 })
	e.mustApply("web")
	w := e.do(req{method: "POST", path: "/v1/network/services/web/conntrack/import", token: adminToken, body: string(snap), contentType: octet})
	wantError(t, w, 413, api.CodePayloadTooLarge, "")
	if len(e.dp.ha.imports) != 0 {
		t.Errorf("a body over the limit by its Content-Length was read: %+v", e.dp.ha.imports)
	}

	hr := httptest.NewRequest("POST", "/v1/network/services/web/conntrack/import", io.MultiReader(bytes.NewReader(snap)))
	hr.ContentLength = -1
	hr.Header.Set("Authorization", "Bearer "+adminToken)
	hr.Header.Set("Content-Type", octet)
	rec := httptest.NewRecorder()
	e.h.ServeHTTP(rec, hr)
	d := wantError(t, rec, 413, api.CodePayloadTooLarge, "")
	if !strings.Contains(d.Message, "4096") {
		t.Errorf("message %q", d.Message)
	}
	if len(e.dp.ha.imports) != 1 || e.dp.ha.imports[0].read > 4096 {
		t.Errorf("imports %+v: want one that read at most the limit", e.dp.ha.imports)
	}

	// The same body under the limit is taken; the JSON routes keep theirs.
	e = newEnv(t, func(o *api.Options) { o.MaxSnapshotBytes = int64(len(snap)); o.MaxBodyBytes = 1024 })
	e.mustApply("web")
	if w := e.do(req{method: "POST", path: "/v1/network/services/web/conntrack/import", token: adminToken, body: string(snap), contentType: octet}); w.Code != 200 {
		t.Errorf("at the limit: %d %s", w.Code, w.Body)
	}
}

// TestImportConntrackStreams checks that the import reads the body as it
// arrives: the fake has read most of the first half while the client
// still holds the second.
func TestImportConntrackStreams(t *testing.T) {
	snap := snapshot(t, "web", 40_000) // 5.1 MB
	e := newEnv(t)
	e.mustApply("web")
	pr, pw := io.Pipe()
	hr := httptest.NewRequest("POST", "/v1/network/services/web/conntrack/import", pr)
	hr.ContentLength = -1
	hr.Header.Set("Authorization", "Bearer "+adminToken)
	hr.Header.Set("Content-Type", octet)
	rec := httptest.NewRecorder()
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.h.ServeHTTP(rec, hr)
	}()
	half := len(snap) / 2
	if _, err := pw.Write(snap[:half]); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for e.dp.ha.importRead.Load() < int64(half)-(128<<10) {
		if time.Now().After(deadline) {
			read := e.dp.ha.importRead.Load()
			pw.CloseWithError(errors.New("test gave up"))
			<-done
			t.Fatalf("the import read %d of the first %d bytes while the rest was held: the body is not streamed", read, half)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if _, err := pw.Write(snap[half:]); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	<-done
	res := decodeOK[ha.ImportResult](t, rec, 200)
	if res.Flows != 40_000 {
		t.Errorf("result %+v", res)
	}
}

func TestGetDelta(t *testing.T) {
	base := "/v1/network/services/web/conntrack/delta"
	for _, tc := range []struct {
		name     string
		path     string
		query    string
		setup    func(f *fakeDataplane)
		status   int
		code     api.Code
		field    string
		read     *deltaRead // what the dataplane was asked
		from, to uint64
		batches  int
		reset    bool
	}{
		{name: "page", query: "?journal=j1&seq=2&max_ops=2", status: 200, read: &deltaRead{"j1", 2, 2}, from: 2, to: 4, batches: 2},
		{name: "defaults", query: "?journal=j1", status: 200, read: &deltaRead{"j1", 0, api.DefaultDeltaOps}, from: 0, to: 5, batches: 5},
		{name: "no journal", status: 200, read: &deltaRead{"", 0, api.DefaultDeltaOps}, reset: true},
		{name: "empty journal", query: "?journal=&seq=3", status: 200, read: &deltaRead{"", 3, api.DefaultDeltaOps}, from: 3, to: 3, reset: true},
		{name: "other journal", query: "?journal=j0&seq=3", status: 200, read: &deltaRead{"j0", 3, api.DefaultDeltaOps}, from: 3, to: 3, reset: true},
		{name: "up to date", query: "?journal=j1&seq=5", status: 200, read: &deltaRead{"j1", 5, api.DefaultDeltaOps}, from: 5, to: 5},
		{name: "max ops bound", query: "?journal=j1&max_ops=65536", status: 200, read: &deltaRead{"j1", 0, 65536}, to: 5, batches: 5},
		{name: "max ops 1", query: "?journal=j1&max_ops=1", status: 200, read: &deltaRead{"j1", 0, 1}, to: 1, batches: 1},
		{name: "max ops 0", query: "?journal=j1&max_ops=0", status: 400, code: api.CodeInvalidRequest, field: "max_ops"},
		{name: "max ops over", query: "?journal=j1&max_ops=65537", status: 400, code: api.CodeInvalidRequest, field: "max_ops"},
		{name: "max ops text", query: "?journal=j1&max_ops=many", status: 400, code: api.CodeInvalidRequest, field: "max_ops"},
		{name: "max ops empty", query: "?journal=j1&max_ops=", status: 400, code: api.CodeInvalidRequest, field: "max_ops"},
		{name: "seq negative", query: "?journal=j1&seq=-1", status: 400, code: api.CodeInvalidRequest, field: "seq"},
		{name: "seq text", query: "?journal=j1&seq=x", status: 400, code: api.CodeInvalidRequest, field: "seq"},
		{name: "seq overflow", query: "?journal=j1&seq=18446744073709551616", status: 400, code: api.CodeInvalidRequest, field: "seq"},
		{name: "cursor ahead", query: "?journal=j1&seq=9", status: 409, code: api.CodeCursorAhead, read: &deltaRead{"j1", 9, api.DefaultDeltaOps}},
		{name: "fenced", query: "?journal=j1", setup: func(f *fakeDataplane) {
			f.ha.err = fmt.Errorf("fluxvm: flow delta of web: ha: journal web/j1: since 0: epoch 3, fenced by 4: %w", ha.ErrFenced)
		}, status: 409, code: api.CodeFenced, read: &deltaRead{"j1", 0, api.DefaultDeltaOps}},
		{name: "replication off", setup: func(f *fakeDataplane) { f.ha.off = true }, status: 422, code: api.CodeMissingPrerequisite, field: "ha_epoch", read: &deltaRead{"", 0, api.DefaultDeltaOps}},
		{name: "unknown service", path: "/v1/network/services/nope/conntrack/delta", status: 404, code: api.CodeNotFound, read: &deltaRead{"", 0, api.DefaultDeltaOps}},
		{name: "reserved word", path: "/v1/network/services/flows/conntrack/delta", status: 404, code: api.CodeNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.mustApply("web")
			if tc.setup != nil {
				tc.setup(e.dp)
			}
			path := tc.path
			if path == "" {
				path = base
			}
			w := e.do(req{method: "GET", path: path + tc.query, token: readToken})
			if tc.status == 200 {
				d := decodeOK[ha.Delta](t, w, 200)
				if d.Service != "web" || d.Journal != "j1" || d.From != tc.from || d.To != tc.to || len(d.Batches) != tc.batches || d.ResetRequired != tc.reset {
					t.Errorf("delta %+v", d)
				}
			} else {
				wantError(t, w, tc.status, tc.code, tc.field)
			}
			reads := e.dp.ha.deltaReads
			switch {
			case tc.read == nil && len(reads) != 0:
				t.Errorf("a refused query reached the dataplane: %+v", reads)
			case tc.read != nil && (len(reads) != 1 || reads[0] != *tc.read):
				t.Errorf("reads %+v, want %+v", reads, *tc.read)
			}
		})
	}
}

// deltaBody is a delta of the fake's journal j1 after seq 0, as JSON,
// changed by edit.
func deltaBody(t *testing.T, edit func(d *ha.Delta)) string {
	t.Helper()
	f := newFake()
	f.services["web"] = fluxvm.ServiceStatus{}
	d, err := fakeReplication{f}.FlowDelta(context.Background(), "web", fluxvm.FlowDeltaRequest{Journal: "j1", MaxOps: 3})
	if err != nil {
		t.Fatal(err)
	}
	if edit != nil {
		edit(&d)
	}
	b, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestImportDelta(t *testing.T) {
	path := "/v1/network/services/web/conntrack/delta/import"
	e := newEnv(t)
	e.mustApply("web")
	body := deltaBody(t, nil)
	res := decodeOK[fluxvm.HADeltaResult](t, e.do(req{method: "POST", path: path, token: adminToken, body: body}), 200)
	if res.Cursor != (ha.Cursor{Journal: "j1", Seq: 3, Epoch: 3}) || res.Applied.Flows != 3 {
		t.Errorf("result %+v", res)
	}
	if got := e.dp.ha.deltaImports; len(got) != 1 || len(got[0].Batches) != 3 || got[0].Batches[2].Ops[0].Flow.Client != fakeFlow(3).Client {
		t.Errorf("the dataplane got %+v", got)
	}
	// The same delta again no longer continues the cursor.
	d := wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: body}), 409, api.CodeSequenceGap, "")
	if !strings.Contains(d.Message, "j1/3") {
		t.Errorf("message %q does not name the cursor", d.Message)
	}

	for _, tc := range []struct {
		name        string
		body        string
		contentType string
		setup       func(f *fakeDataplane)
		status      int
		code        api.Code
		field       string
		reaches     bool
	}{
		{name: "reset required", body: deltaBody(t, func(d *ha.Delta) { d.ResetRequired, d.Batches, d.To = true, nil, 0 }), status: 409, code: api.CodeResetRequired, reaches: true},
		{name: "other journal", body: deltaBody(t, func(d *ha.Delta) { d.Journal = "j9" }), setup: func(f *fakeDataplane) { f.ha.cursor = ha.Cursor{Journal: "j1", Epoch: 3} },
			status: 409, code: api.CodeResetRequired, reaches: true},
		{name: "gap", body: deltaBody(t, func(d *ha.Delta) { d.Batches = d.Batches[1:] }), status: 409, code: api.CodeSequenceGap, reaches: true},
		{name: "stale epoch", body: deltaBody(t, nil), setup: func(f *fakeDataplane) { f.ha.cursor = ha.Cursor{Epoch: 7} }, status: 409, code: api.CodeStaleEpoch, reaches: true},
		{name: "no epoch", body: deltaBody(t, func(d *ha.Delta) { d.Epoch = 0 }), status: 400, code: api.CodeInvalidRequest, reaches: true},
		{name: "invalid op", body: deltaBody(t, func(d *ha.Delta) { d.Batches[0].Ops[0].Kind = 7 }), status: 400, code: api.CodeInvalidRequest, reaches: true},
		{name: "upsert without flow", body: deltaBody(t, func(d *ha.Delta) { d.Batches[0].Ops[0].Flow = nil }), status: 400, code: api.CodeInvalidRequest, reaches: true},
		{name: "other service", body: deltaBody(t, func(d *ha.Delta) { d.Service = "api" }), status: 400, code: api.CodeServiceMismatch, field: "service"},
		{name: "no service", body: `{"journal":"j1","epoch":3,"from":0,"to":0}`, status: 400, code: api.CodeServiceMismatch, field: "service"},
		{name: "unknown field", body: `{"service":"web","journal":"j1","epoch":3,"from":0,"to":0,"extra":1}`, status: 400, code: api.CodeInvalidRequest, field: "extra"},
		{name: "unknown nested field", body: `{"service":"web","journal":"j1","epoch":3,"from":0,"to":1,"batches":[{"seq":1,"epoch":3,"ops":[],"size":1}]}`,
			status: 400, code: api.CodeInvalidRequest, field: "size"},
		{name: "repeated field", body: `{"service":"web","journal":"j1","epoch":3,"epoch":4,"from":0,"to":0}`, status: 400, code: api.CodeInvalidRequest, field: "epoch"},
		{name: "repeated nested field", body: `{"service":"web","journal":"j1","epoch":3,"from":0,"to":1,"batches":[{"seq":1,"epoch":3,"ops":[],"seq":1}]}`,
			status: 400, code: api.CodeInvalidRequest, field: "batches[0].seq"},
		{name: "bad address", body: strings.Replace(deltaBody(t, nil), `"10.96.0.10:80"`, `"10.96.0.300:80"`, 1), status: 400, code: api.CodeInvalidRequest, field: "*"},
		{name: "trailing data", body: body + `{}`, status: 400, code: api.CodeInvalidRequest, field: "*"},
		{name: "syntax", body: `{"service":`, status: 400, code: api.CodeInvalidRequest, field: "*"},
		{name: "text/plain", body: body, contentType: "text/plain", status: 415, code: api.CodeUnsupportedMediaType},
		{name: "replication off", body: body, setup: func(f *fakeDataplane) { f.ha.off = true }, status: 422, code: api.CodeMissingPrerequisite, field: "ha_epoch", reaches: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.mustApply("web")
			if tc.setup != nil {
				tc.setup(e.dp)
			}
			before := e.dp.ha.cursor
			wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: tc.body, contentType: tc.contentType}), tc.status, tc.code, tc.field)
			if reached := len(e.dp.ha.deltaImports) > 0; reached != tc.reaches {
				t.Errorf("dataplane reached: %v, want %v", reached, tc.reaches)
			}
			if e.dp.ha.cursor != before {
				t.Errorf("a refused delta moved the cursor: %+v", e.dp.ha.cursor)
			}
		})
	}

	// Unknown service, reserved word, and the body bound.
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/nope/conntrack/delta/import", token: adminToken, body: strings.Replace(body, `"web"`, `"nope"`, 1)}),
		404, api.CodeNotFound, "")
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/ha/conntrack/delta/import", token: adminToken, body: body}), 404, api.CodeNotFound, "")
	small := newEnv(t, func(o *api.Options) { o.MaxDeltaBytes = 256; o.MaxBodyBytes = 1 << 20 })
	small.mustApply("web")
	wantError(t, small.do(req{method: "POST", path: path, token: adminToken, body: body}), 413, api.CodePayloadTooLarge, "")
	// The delta bound is its own: above MaxBodyBytes is fine.
	big := newEnv(t, func(o *api.Options) { o.MaxBodyBytes = 512 })
	big.mustApply("web")
	if len(body) <= 512 {
		t.Fatalf("test delta of %d bytes is not over the body bound", len(body))
	}
	decodeOK[fluxvm.HADeltaResult](t, big.do(req{method: "POST", path: path, token: adminToken, body: body}), 200)
}

func TestAckDelta(t *testing.T) {
	path := "/v1/network/services/web/conntrack/delta/ack"
	e := newEnv(t)
	e.mustApply("web")
	st := decodeOK[ha.JournalStats](t, e.do(req{method: "POST", path: path, token: adminToken, body: `{"seq":3}`}), 200)
	if st.Acked != 3 || st.LastSeq != 5 || st.Journal != "j1" || st.FirstSeq != 4 {
		t.Errorf("stats %+v", st)
	}
	// Going back is a no-op.
	if st := decodeOK[ha.JournalStats](t, e.do(req{method: "POST", path: path, token: adminToken, body: `{"seq":1}`}), 200); st.Acked != 3 {
		t.Errorf("after an older ack: %+v", st)
	}
	if !reflect.DeepEqual(e.dp.ha.acks, []uint64{3, 1}) {
		t.Errorf("acks %v", e.dp.ha.acks)
	}
	for _, tc := range []struct {
		name, path, body string
		setup            func(f *fakeDataplane)
		status           int
		code             api.Code
		field            string
	}{
		{name: "cursor ahead", body: `{"seq":9}`, status: 409, code: api.CodeCursorAhead},
		{name: "no seq", body: `{}`, status: 400, code: api.CodeInvalidRequest, field: "seq"},
		{name: "null seq", body: `{"seq":null}`, status: 400, code: api.CodeInvalidRequest, field: "seq"},
		{name: "empty body", body: ``, status: 400, code: api.CodeInvalidRequest, field: "*"},
		{name: "negative", body: `{"seq":-1}`, status: 400, code: api.CodeInvalidRequest, field: "seq"},
		{name: "string", body: `{"seq":"3"}`, status: 400, code: api.CodeInvalidRequest, field: "seq"},
		{name: "repeated", body: `{"seq":1,"seq":2}`, status: 400, code: api.CodeInvalidRequest, field: "seq"},
		{name: "unknown field", body: `{"seq":1,"journal":"j1"}`, status: 400, code: api.CodeInvalidRequest, field: "journal"},
		{name: "unknown service", path: "/v1/network/services/nope/conntrack/delta/ack", body: `{"seq":1}`, status: 404, code: api.CodeNotFound},
		{name: "replication off", body: `{"seq":1}`, setup: func(f *fakeDataplane) { f.ha.off = true }, status: 422, code: api.CodeMissingPrerequisite, field: "ha_epoch"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.mustApply("web")
			if tc.setup != nil {
				tc.setup(e.dp)
			}
			p := tc.path
			if p == "" {
				p = path
			}
			r := req{method: "POST", path: p, token: adminToken, body: tc.body}
			if tc.body == "" {
				r.header = http.Header{"Content-Type": {"application/json"}}
			}
			d := wantError(t, e.do(r), tc.status, tc.code, tc.field)
			if tc.field == "seq" && tc.code == api.CodeInvalidRequest && !strings.Contains(d.Message, "seq") {
				t.Errorf("message %q", d.Message)
			}
			if len(e.dp.ha.acks) != 0 {
				t.Errorf("refused ack trimmed: %v", e.dp.ha.acks)
			}
		})
	}
}

// TestHARoundTrip moves a snapshot and a delta from one node's handler to
// another's, as a control plane does: export, import, pull, apply, ack.
func TestHARoundTrip(t *testing.T) {
	src, dst := newEnv(t), newEnv(t)
	src.mustApply("web")
	dst.mustApply("web")
	src.dp.ha.exportFlows = 2500
	exp := src.do(req{method: "GET", path: "/v1/network/services/web/conntrack/export", token: readToken})
	if exp.Code != 200 {
		t.Fatalf("export %d %s", exp.Code, exp.Body)
	}
	imp := dst.do(req{method: "POST", path: "/v1/network/services/web/conntrack/import?prune=true", token: adminToken,
		body: exp.Body.String(), contentType: octet})
	res := decodeOK[ha.ImportResult](t, imp, 200)
	if res.Flows != 2500 || res.Header.Journal != "j1" || res.Header.Seq != 5 {
		t.Fatalf("import %+v", res)
	}
	// Continue from the checkpoint (the fake target starts its cursor
	// there, as ImportFlows does).
	dst.dp.ha.cursor = ha.Cursor{Journal: res.Header.Journal, Seq: 2, Epoch: res.Header.Epoch}
	pull := src.do(req{method: "GET", path: "/v1/network/services/web/conntrack/delta?journal=j1&seq=2", token: readToken})
	if pull.Code != 200 {
		t.Fatalf("delta %d %s", pull.Code, pull.Body)
	}
	ap := decodeOK[fluxvm.HADeltaResult](t, dst.do(req{method: "POST", path: "/v1/network/services/web/conntrack/delta/import", token: adminToken, body: pull.Body.String()}), 200)
	if ap.Cursor.Seq != 5 || ap.Applied.Flows != 3 {
		t.Fatalf("apply %+v", ap)
	}
	ack := decodeOK[ha.JournalStats](t, src.do(req{method: "POST", path: "/v1/network/services/web/conntrack/delta/ack", token: adminToken,
		body: fmt.Sprintf(`{"seq":%d}`, ap.Cursor.Seq)}), 200)
	if ack.Acked != 5 {
		t.Errorf("ack %+v", ack)
	}
}

// TestExportCancelled checks that a client gone before the first byte
// ends the export with the request's context.
func TestExportCancelled(t *testing.T) {
	e := newEnv(t)
	e.mustApply("web")
	e.dp.ha.exportFlows = 10
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	hr := httptest.NewRequest("GET", "/v1/network/services/web/conntrack/export", nil).WithContext(ctx)
	hr.Header.Set("Authorization", "Bearer "+readToken)
	w := httptest.NewRecorder()
	e.h.ServeHTTP(w, hr)
	wantError(t, w, 503, api.CodeUnavailable, "")
}

// TestHAJoin: POST …/ha/join (admin; empty body or {}) answers the status,
// joined; the dataplane's refusals map to 422 naming their field.
func TestHAJoin(t *testing.T) {
	e := newEnv(t)
	const path = "/v1/network/services/ha/join"
	for _, body := range []string{"", "{}"} {
		if st := decodeOK[fluxvm.HAStatus](t, e.do(req{method: "POST", path: path, token: adminToken, body: body}), 200); !st.Joined {
			t.Errorf("join (body %q): %+v, want joined", body, st)
		}
	}
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken, body: `{"now":true}`}), 400, api.CodeInvalidRequest, "now")
	wantError(t, e.do(req{method: "POST", path: path, token: readToken}), 403, api.CodeForbidden, "")
	wantError(t, e.do(req{method: "GET", path: path, token: adminToken}), 405, api.CodeMethodNotAllowed, "")
	if e.dp.ha.joins != 2 {
		t.Errorf("%d joins reached the dataplane, want 2", e.dp.ha.joins)
	}
	e.dp.ha.joinErr = &fluxvm.ValidationError{Field: "ha_group", Reason: "not one of a group", Kind: fluxvm.ErrPrerequisite}
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken}), 422, api.CodeMissingPrerequisite, "ha_group")
	e.dp.ha.joinErr, e.dp.ha.off = nil, true
	wantError(t, e.do(req{method: "POST", path: path, token: adminToken}), 422, api.CodeMissingPrerequisite, "ha_epoch")
}
