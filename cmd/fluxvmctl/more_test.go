package main

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/flows/otlp"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
)

// sampleRound is a hard round that compacted the IPv4 conntrack map.
func sampleRound() fluxvm.PressureRound {
	return fluxvm.PressureRound{
		At: applied, Level: "hard", Over: []string{"fluxvm_fct4", "fluxvm_nat4"},
		After:    map[string]float64{"fluxvm_nat4": 40, "fluxvm_fct4": 79},
		GC:       &fluxvm.GCResult{Duration: 3 * time.Millisecond, Scanned: 1000, Expired: 10},
		Shed:     conntrack.ShedCounts{Closed: 5, HalfOpen: 6, IdleUDP: 7},
		Horizon:  fluxvm.Duration{Duration: 30 * time.Second},
		Duration: fluxvm.Duration{Duration: 250 * time.Millisecond},
		Compaction: &fluxvm.PressureCompaction{
			Maps: []bpf.FlowMapCompaction{{Map: "fluxvm_fct4", Entries: 950, Kept: 790, Dropped: 160,
				DroppedBy: map[string]int{"udp": 100, "established": 60}, CaughtUp: 4, MapID: 41, PreviousMapID: 17}},
			Links:    []string{"tcx_ns_in"},
			Duration: fluxvm.Duration{Duration: 200 * time.Millisecond},
		},
	}
}

func TestPressureTables(t *testing.T) {
	round := sampleRound()
	node := newFakeNode(t, map[string]answer{
		"GET /v1/network/services/status": ok(t, fluxvm.Status{Tier: "M", Pressure: &fluxvm.PressureStatus{
			SoftPercent: 80, HardPercent: 95, Level: "soft", InsertFailures: 2, Rounds: 1, LastRound: &round,
			GCInterval: fluxvm.Duration{Duration: 5 * time.Second},
			Maps: map[string]fluxvm.MapPressure{
				"fluxvm_fct4": {Entries: 55000, MaxEntries: 65536, Percent: 83.92}, "fluxvm_nat4": {Entries: 8192, MaxEntries: 65536, Percent: 12.5}}}}),
		"POST /v1/network/services/pressure/reconcile": ok(t, round),
	})
	roundRows := "" +
		"Level:           hard\n" +
		"Over:            fluxvm_fct4,fluxvm_nat4\n" +
		"Duration:        250ms\n" +
		"Horizon:         30s\n" +
		"GC:              1000 scanned, 10 expired, 0 drained, 0 backend gone, 0 orphans removed, 0 repaired (3ms)\n" +
		"Shed:            5 closed, 6 half-open, 7 idle UDP, 0 established\n" +
		"After:           fluxvm_fct4 79.0%, fluxvm_nat4 40.0%\n" +
		"Compaction:      1 maps rebuilt (200ms)\n" +
		"Links switched:  tcx_ns_in\n" +
		"\n" +
		"COMPACTED MAP  ENTRIES  KEPT  DROPPED  CAUGHT UP  MAP ID  PREVIOUS MAP ID  DROPPED BY\n" +
		"fluxvm_fct4    950      790   160      4          41      17               established=60,udp=100\n"
	tests := []struct {
		args         []string
		method, path string
		want         string
	}{
		{[]string{"pressure"}, "GET", "/v1/network/services/status", "" +
			"Level:            soft (soft 80%, hard 95%)\n" +
			"Insert failures:  2\n" +
			"Rounds:           1\n" +
			"GC interval:      5s\n" +
			"\n" +
			"MAP          ENTRIES  MAX    PERCENT\n" +
			"fluxvm_fct4  55000    65536  83.9%\n" +
			"fluxvm_nat4  8192     65536  12.5%\n" +
			"\n" +
			"Last round:      2026-11-30T12:00:00Z\n" + roundRows},
		{[]string{"pressure", "reconcile"}, "POST", "/v1/network/services/pressure/reconcile", "" +
			"At:              2026-11-30T12:00:00Z\n" + roundRows},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := ctl(nil, "", append([]string{"-addr", node.URL}, tt.args...)...)
			if r.code != 0 {
				t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
			}
			if got := node.last(t); got.method != tt.method || got.path != tt.path {
				t.Errorf("request %s %s, want %s %s", got.method, got.path, tt.method, tt.path)
			}
			golden(t, r.stdout, tt.want)
		})
	}

	// -o json: the pressure object of the status as the node sent it.
	r := ctl(nil, "", "-addr", node.URL, "-o", "json", "pressure")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "{\n  \"soft_percent\": 80,") || strings.Contains(r.stdout, `"tier"`) {
		t.Errorf("pressure -o json: exit %d, stdout %q", r.code, r.stdout)
	}
	none := newFakeNode(t, map[string]answer{"GET /v1/network/services/status": ok(t, fluxvm.Status{Tier: "S"})})
	if r := ctl(nil, "", "-addr", none.URL, "-o", "json", "pressure"); r.code != 0 || r.stdout != "null\n" {
		t.Errorf("pressure -o json without pressure: exit %d, stdout %q", r.code, r.stdout)
	}
	if r := ctl(nil, "", "-addr", none.URL, "pressure"); r.code != 0 || r.stdout != "the node reports no map pressure\n" {
		t.Errorf("pressure without pressure: exit %d, stdout %q", r.code, r.stdout)
	}
}

// TestMoreRequests checks what the commands of the other routes send
// (method, path, query, body, media type) and what they print of the
// SDK's types.
func TestMoreRequests(t *testing.T) {
	delta := ha.Delta{Service: "web", Journal: "j1", Epoch: 4, From: 5, To: 7, Batches: []ha.Batch{
		{Seq: 6, Epoch: 4, Ops: []ha.Op{{Kind: ha.OpDelete}, {Kind: ha.OpUpsert, Flow: &ha.Flow{}}}},
		{Seq: 7, Epoch: 4, Ops: []ha.Op{{Kind: ha.OpDelete}}},
	}}
	node := newFakeNode(t, map[string]answer{
		"POST /v1/network/services/policies":           ok(t, fluxvm.PoliciesStatus{Policies: []fluxvm.PolicyStatus{{Service: "web"}}}),
		"POST /v1/network/services/policies/reconcile": ok(t, fluxvm.PoliciesStatus{IPCachePrefixes: 3, IPCacheRevision: 9}),
		"DELETE /v1/network/services/web/policy":       {status: http.StatusNoContent},
		"GET /v1/network/services/delete/policy":       ok(t, fluxvm.PolicyStatus{Service: "delete"}),
		"GET /v1/network/services/web/l7/envoy":        ok(t, fluxvm.EnvoyDocument{Service: "web", Mode: fluxvm.L7Enforce}),
		"POST /v1/network/services/ha/lease":           ok(t, fluxvm.HAStatus{Enabled: true, Epoch: 5, SupersededBy: 6}),
		"POST /v1/network/services/ha/join":            ok(t, fluxvm.HAStatus{Enabled: true, Epoch: 5, Group: true, Node: "e1", Joined: true}),
		"POST /v1/network/services/snat/peers": ok(t, fluxvm.SNATStatus{Address4: netip.MustParseAddr("10.97.0.1"), PortMin: 61000, PortMax: 65535,
			Peers: []netip.Addr{netip.MustParseAddr("10.97.0.2"), netip.MustParseAddr("fd00:97::2")}, Announced: []netip.Addr{netip.MustParseAddr("fd00:97::2")}}),
		"POST /v1/network/services/web/conntrack/import": ok(t, ha.ImportResult{Header: ha.Header{Service: "web", Node: "edge-1", Epoch: 4, Journal: "j1", Seq: 17, Created: applied},
			Flows: 10, Written: 8, Fresher: 1, NoBackend: 1}),
		"POST /v1/network/services/moved/conntrack/import": ok(t, ha.ImportResult{Header: ha.Header{Service: "moved", Node: "edge-1", Created: applied},
			Flows: 4, Written: 4}),
		"GET /v1/network/services/web/conntrack/delta":         ok(t, delta),
		"POST /v1/network/services/web/conntrack/delta/import": ok(t, fluxvm.HADeltaResult{Cursor: ha.Cursor{Journal: "j1", Seq: 7, Epoch: 4}, Applied: ha.ImportResult{Flows: 3, Written: 3}}),
		"POST /v1/network/services/web/conntrack/delta/ack":    ok(t, ha.JournalStats{Journal: "j1", Epoch: 4, FirstSeq: 8, LastSeq: 9, Acked: 7, Batches: 2, Ops: 5}),
		"POST /v1/network/services/telemetry/export":           ok(t, api.ExportResponse{Read: 12, Sent: otlpReport()}),
	})
	dir := t.TempDir()
	policies := filepath.Join(dir, "policies.json")
	const policiesJSON = `[{"service":"web","default_action":"deny"}]`
	snap := filepath.Join(dir, "web.fxvmha")
	snapBytes := []byte("\x00\x01binary snapshot\xff")
	for f, b := range map[string][]byte{policies: []byte(policiesJSON), snap: snapBytes} {
		if err := os.WriteFile(f, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name                string
		args                []string
		stdin               string
		method, path, query string
		body, ctype         string
		wants               []string
	}{
		{"policies apply", []string{"policies", "apply", policies}, "", "POST", "/v1/network/services/policies", "", policiesJSON, "application/json",
			[]string{"applied; the node holds 1 policies\n"}},
		{"policies reconcile", []string{"policies", "reconcile"}, "", "POST", "/v1/network/services/policies/reconcile", "", "", "",
			[]string{"IPCache:   3 prefixes, revision 9\n"}},
		{"policy delete", []string{"policy", "delete", "web"}, "", "DELETE", "/v1/network/services/web/policy", "", "", "",
			[]string{"deleted the policy of service web\n"}},
		{"policy of a service named delete", []string{"policy", "--", "delete"}, "", "GET", "/v1/network/services/delete/policy", "", "", "",
			[]string{"Service:           delete\n"}},
		{"envoy", []string{"envoy", "web"}, "", "GET", "/v1/network/services/web/l7/envoy", "", "", "",
			[]string{"{\n  \"service\": \"web\",\n  \"mode\": \"enforce\","}},
		{"ha lease", []string{"ha", "lease", "-epoch", "5", "-superseded-by", "6"}, "", "POST", "/v1/network/services/ha/lease", "", `{"epoch":5,"superseded_by":6}`, "application/json",
			[]string{"Replication:  on, epoch 5, FENCED (superseded by epoch 6)\n"}},
		{"ha join", []string{"ha", "join"}, "", "POST", "/v1/network/services/ha/join", "", "", "",
			[]string{"Group:        e1, joined\n"}},
		{"snat peers", []string{"snat", "peers", "10.97.0.2", "fd00:97::2", "-announce", "fd00:97::2"}, "", "POST", "/v1/network/services/snat/peers", "", `{"addresses":["10.97.0.2","fd00:97::2"],"announce":["fd00:97::2"]}`, "application/json",
			[]string{"Address v4:  10.97.0.1\n", "Address v6:  -\n", "Peers:       10.97.0.2, fd00:97::2\n", "Taken over:  fd00:97::2\n"}},
		{"snat peers none", []string{"snat", "peers", "-none"}, "", "POST", "/v1/network/services/snat/peers", "", `{"addresses":[]}`, "application/json",
			[]string{"Ports:       61000-65535\n"}},
		{"conntrack import", []string{"conntrack", "import", "web", snap, "-prune"}, "", "POST", "/v1/network/services/web/conntrack/import", "prune=true", string(snapBytes), "application/octet-stream",
			[]string{"Service:         web\n", "Journal cursor:  j1 at seq 17\n", "Created:         2026-11-30T12:00:00Z\n", "Written:         8\n", "Fresher here:    1\n"}},
		{"conntrack import of no lease", []string{"conntrack", "import", "moved", snap, "-prune"}, "", "POST", "/v1/network/services/moved/conntrack/import", "prune=true", string(snapBytes), "application/octet-stream",
			[]string{"Epoch:           0 (no lease: the source runs without ha_epoch)\n", "Journal cursor:  none (no journal: deltas need ha_epoch on both nodes)\n", "Written:         4\n"}},
		{"conntrack import stdin", []string{"conntrack", "import", "web", "-"}, "from stdin", "POST", "/v1/network/services/web/conntrack/import", "", "from stdin", "application/octet-stream",
			[]string{"Flows read:      10\n"}},
		{"delta", []string{"delta", "web", "-journal", "j1", "-seq", "5", "-max-ops", "100"}, "", "GET", "/v1/network/services/web/conntrack/delta", "journal=j1&max_ops=100&seq=5", "", "", []string{
			"Journal:         j1\n", "From:            5\n", "To:              7\n", "Reset required:  no\n",
			"SEQ  EPOCH  OPS  UPSERTS  DELETES\n6    4      2    1        1\n7    4      1    0        1\n"}},
		{"delta import", []string{"delta", "import", "web", "-"}, `{"service":"web"}`, "POST", "/v1/network/services/web/conntrack/delta/import", "", `{"service":"web"}`, "application/json",
			[]string{"Cursor:          journal j1, seq 7, epoch 4\n", "Written:         3\n"}},
		{"delta ack", []string{"delta", "ack", "web", "7"}, "", "POST", "/v1/network/services/web/conntrack/delta/ack", "", `{"seq":7}`, "application/json", []string{
			"SERVICE  JOURNAL  EPOCH  FENCED  FIRST  LAST  ACKED  BATCHES  OPS  OPEN OPS  DROPPED BATCHES  DROPPED OPS\n" +
				"web      j1       4      no      8      9     7      2        5    0         0                0\n"}},
		{"telemetry export", []string{"telemetry", "export", "-limit", "50"}, "", "POST", "/v1/network/services/telemetry/export", "limit=50", "", "", []string{
			"Read:      12\n", "Sent:      12 records in 2 requests\n", "Rejected:  1\n", "Encoding:  proto\n"}},
		{"telemetry export default", []string{"telemetry", "export"}, "", "POST", "/v1/network/services/telemetry/export", "", "", "", []string{"Read:      12\n"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := ctl(nil, tt.stdin, append([]string{"-addr", node.URL}, tt.args...)...)
			if r.code != 0 {
				t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
			}
			got := node.last(t)
			if got.method != tt.method || got.path != tt.path || got.query != tt.query || got.body != tt.body || got.ctype != tt.ctype || got.auth != "Bearer "+testToken {
				t.Errorf("request %+v, want %s %s?%s body %q (%s)", got, tt.method, tt.path, tt.query, tt.body, tt.ctype)
			}
			for _, w := range tt.wants {
				if !strings.Contains(r.stdout, w) {
					t.Errorf("output lacks %q:\n%s", w, r.stdout)
				}
			}
		})
	}

	// -o json prints the answer as is: a delta to feed to delta import.
	r := ctl(nil, "", "-addr", node.URL, "-o", "json", "delta", "web", "-journal", "j1")
	var back ha.Delta
	if r.code != 0 || decode([]byte(r.stdout), &back, "delta") != nil || back.To != 7 || len(back.Batches) != 2 {
		t.Errorf("delta -o json: exit %d, %q", r.code, r.stdout)
	}
}

// TestMoreUsageErrors: the arguments are checked before any request.
func TestMoreUsageErrors(t *testing.T) {
	node := newFakeNode(t, nil)
	tests := []struct {
		name   string
		args   []string
		stderr string
	}{
		{"lease without flags", []string{"ha", "lease"}, "ha lease: give -epoch, -superseded-by or both"},
		{"snat peers nothing", []string{"snat", "peers"}, "usage: fluxvmctl snat peers ADDR... [-announce ADDR,...] | -none"},
		{"snat peers both", []string{"snat", "peers", "-none", "10.97.0.2"}, "usage: fluxvmctl snat peers ADDR... [-announce ADDR,...] | -none"},
		{"snat peers bad", []string{"snat", "peers", "10.97.0"}, `snat peers: "10.97.0" is not an IP address`},
		{"snat peers bad announce", []string{"snat", "peers", "10.97.0.2", "-announce", "10.97.0.2,x"}, `snat peers: "x" is not an IP address`},
		{"snat peers none with announce", []string{"snat", "peers", "-none", "-announce", "10.97.0.2"}, "usage: fluxvmctl snat peers ADDR..."},
		{"snat alone", []string{"snat"}, "usage: fluxvmctl snat peers ADDR... [-announce ADDR,...] | -none"},
		{"lease epoch 0", []string{"ha", "lease", "-epoch", "0"}, "-epoch must be positive"},
		{"lease bad epoch", []string{"ha", "lease", "-epoch", "-3"}, `invalid value "-3" for flag -epoch`},
		{"ack bad seq", []string{"delta", "ack", "web", "x"}, `SEQ "x": want an unsigned integer`},
		{"ack no seq", []string{"delta", "ack", "web"}, "usage: fluxvmctl delta ack NAME SEQ"},
		{"delta max-ops", []string{"delta", "web", "-max-ops", "0"}, "-max-ops 0: want 1..65536"},
		{"delta no name", []string{"delta"}, "usage: fluxvmctl delta NAME"},
		{"telemetry limit", []string{"telemetry", "export", "-limit", "5000"}, "-limit 5000: want 1..4096"},
		{"telemetry alone", []string{"telemetry"}, "usage: fluxvmctl telemetry export [-limit N]"},
		{"conntrack alone", []string{"conntrack"}, "usage: fluxvmctl conntrack export NAME [-out FILE] | fluxvmctl conntrack import NAME FILE|- [-prune]"},
		{"conntrack unknown", []string{"conntrack", "gc"}, "usage: fluxvmctl conntrack export"},
		{"import no file", []string{"conntrack", "import", "web"}, "usage: fluxvmctl conntrack import NAME FILE|-"},
		{"export reserved", []string{"conntrack", "export", "status"}, `"status" is reserved for a route`},
		{"export empty out", []string{"conntrack", "export", "web", "-out", ""}, "-out is empty"},
		{"envoy reserved", []string{"envoy", "ha"}, `"ha" is reserved for a route`},
		{"policy delete no name", []string{"policy", "delete"}, "usage: fluxvmctl policy delete NAME"},
		{"policies apply extra", []string{"policies", "apply", "a", "b"}, "usage: fluxvmctl policies apply FILE|-"},
		{"reconcile argument", []string{"pressure", "reconcile", "now"}, "pressure reconcile takes no argument"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := ctl(nil, "", append([]string{"-addr", node.URL}, tt.args...)...)
			if r.code != exitUsage || !strings.Contains(r.stderr, tt.stderr) || r.stdout != "" {
				t.Errorf("exit %d, stdout %q, stderr %q; want exit 2 and %q", r.code, r.stdout, r.stderr, tt.stderr)
			}
		})
	}
	node.mu.Lock()
	defer node.mu.Unlock()
	if len(node.requests) != 0 {
		t.Errorf("usage errors sent %d requests", len(node.requests))
	}
	if r := ctl(nil, "", "-addr", node.URL, "conntrack", "import", "web", "/nonexistent/snap"); r.code != 1 || !strings.Contains(r.stderr, "read the snapshot") {
		t.Errorf("import of a missing file: exit %d, stderr %q", r.code, r.stderr)
	}
}

// firstBytes is the stdout of a streaming test: the first bytes written
// to it close seen.
type firstBytes struct {
	w    io.Writer
	seen chan struct{}
	done bool
}

func (f *firstBytes) Write(p []byte) (int, error) {
	if !f.done && len(p) > 0 {
		f.done = true
		close(f.seen)
	}
	return f.w.Write(p)
}

// TestConntrackStreams: an export reaches its destination while the node
// is still sending, an import reaches the node while the CLI is still
// reading its input (neither is held whole), and a stream that breaks off
// fails without leaving a file.
func TestConntrackStreams(t *testing.T) {
	chunk := bytes.Repeat([]byte{0xab}, 64<<10)
	exported, imported := make(chan struct{}), make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/network/services/web/conntrack/export":
			w.Header().Set("Content-Type", "application/octet-stream")
			w.Header().Set("Trailer", api.TrailerExportFlows)
			_, _ = w.Write(chunk)
			w.(http.Flusher).Flush()
			select { // the rest only once the CLI wrote the first chunk out
			case <-exported:
			case <-time.After(10 * time.Second):
				return
			}
			_, _ = w.Write(chunk)
			w.Header().Set(api.TrailerExportFlows, "2")
		case "/v1/network/services/broken/conntrack/export":
			_, _ = w.Write(chunk)
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler) // as the api does after a failure mid-stream
		case "/v1/network/services/web/conntrack/import":
			n, _ := io.ReadFull(r.Body, make([]byte, len(chunk)))
			if n == len(chunk) {
				close(imported) // the CLI may read the rest of its input now
			}
			rest, _ := io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(ok(t, ha.ImportResult{Flows: uint64(int64(n) + rest)}).body)
		}
	}))
	defer srv.Close()

	// Export to stdout: the counts go to stderr.
	var out bytes.Buffer
	fb := &firstBytes{w: &out, seen: exported}
	var errb bytes.Buffer
	code := run([]string{"-addr", srv.URL, "conntrack", "export", "web"}, fb, &errb, func(k string) string { return map[string]string{envToken: testToken}[k] })
	if code != 0 || out.Len() != 2*len(chunk) || !strings.Contains(errb.String(), "exported 2 flows of web (131072 bytes) to stdout") {
		t.Fatalf("export: exit %d, %d bytes, stderr %q", code, out.Len(), errb.String())
	}

	// A stream that breaks off: an error, and no file.
	dir := t.TempDir()
	file := filepath.Join(dir, "broken.fxvmha")
	r := ctl(nil, "", "-addr", srv.URL, "conntrack", "export", "broken", "-out", file)
	if r.code != 1 || !strings.Contains(r.stderr, "the stream broke off after") {
		t.Errorf("broken export: exit %d, stderr %q", r.code, r.stderr)
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("a broken export left %v", left)
	}

	// Import from stdin: the node reads the first chunk before the CLI has
	// the rest of its input.
	pr, pw := io.Pipe()
	go func() {
		_, _ = pw.Write(chunk)
		select {
		case <-imported:
			_, _ = pw.Write(chunk)
			_ = pw.Close()
		case <-time.After(10 * time.Second):
			_ = pw.CloseWithError(io.ErrUnexpectedEOF)
		}
	}()
	out.Reset()
	errb.Reset()
	code = runWithStdin([]string{"-addr", srv.URL, "conntrack", "import", "web", "-"}, pr, &out, &errb, func(k string) string { return map[string]string{envToken: testToken}[k] })
	if code != 0 || !strings.Contains(out.String(), "Flows read:      131072\n") {
		t.Errorf("streamed import: exit %d, stdout %q, stderr %q", code, out.String(), errb.String())
	}
}

func otlpReport() otlp.Report {
	return otlp.Report{Records: 12, Batches: 2, Rejected: 1, Encoding: "proto"}
}
