package api_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

var flowT0 = time.Date(2026, 5, 6, 7, 8, 9, 0, time.UTC)

// someFlows are three records, newest first: web forwarded to .21, web
// forwarded to .22, and db dropped (no_backend).
func someFlows() []flows.Record {
	rec := func(seq uint64, svc string, v flows.Verdict, backend string, at time.Time) flows.Record {
		r := flows.Record{
			Seq: seq, Service: svc, ServiceID: 1, Protocol: "tcp", Verdict: v, Hook: "from_vm", Interface: "tap1",
			Client: netip.MustParseAddrPort("10.0.0.5:41000"), VIP: netip.MustParseAddrPort("10.96.0.10:80"),
			FirstSeen: at, LastSeen: at, Forward: flows.Counts{Packets: 3, Bytes: 180},
		}
		if backend != "" {
			r.Backend = netip.MustParseAddrPort(backend)
			r.Reply = flows.Counts{Packets: 2, Bytes: 120}
		} else {
			r.Reason, r.Drops, r.Forward = "no_backend", 1, flows.Counts{}
		}
		return r
	}
	return []flows.Record{
		rec(3, "web", flows.Forwarded, "10.40.1.21:8080", flowT0.Add(2*time.Minute)),
		rec(2, "web", flows.Forwarded, "10.40.1.22:8080", flowT0.Add(time.Minute)),
		rec(1, "db", flows.Dropped, "", flowT0),
	}
}

// TestFlowsRoute: GET /v1/network/services/flows passes limit (default
// 256) and the filters to the dataplane, returns its records, newest
// first, as JSON, and a read token may call it.
func TestFlowsRoute(t *testing.T) {
	e := newEnv(t)
	e.dp.flows = someFlows()
	for _, c := range []struct {
		query  string
		limit  int
		filter flows.Filter
		seqs   []uint64
	}{
		{"", api.DefaultFlowsLimit, flows.Filter{}, []uint64{3, 2, 1}},
		{"?limit=2", 2, flows.Filter{}, []uint64{3, 2}},
		{"?limit=4096&service=web", 4096, flows.Filter{Service: "web"}, []uint64{3, 2}},
		{"?backend=10.40.1.22", 256, flows.Filter{Backend: netip.MustParseAddr("10.40.1.22")}, []uint64{2}},
		{"?verdict=dropped", 256, flows.Filter{Verdict: flows.Dropped}, []uint64{1}},
		{"?since=" + url.QueryEscape(flowT0.Add(time.Minute).Format(time.RFC3339)), 256, flows.Filter{Since: flowT0.Add(time.Minute)}, []uint64{3, 2}},
		{"?service=nope", 256, flows.Filter{Service: "nope"}, []uint64{}},
	} {
		w := e.do(req{method: "GET", path: "/v1/network/services/flows" + c.query, token: readToken})
		if w.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", c.query, w.Code, w.Body)
		}
		checkCommonHeaders(t, w)
		var resp api.FlowsResponse
		dec := json.NewDecoder(w.Body)
		dec.DisallowUnknownFields()
		if err := dec.Decode(&resp); err != nil {
			t.Fatalf("%s: %v", c.query, err)
		}
		got := []uint64{}
		for _, r := range resp.Records {
			got = append(got, r.Seq)
		}
		if resp.Limit != c.limit || !equalSeqs(got, c.seqs) {
			t.Errorf("%s: limit %d, records %v; want %d, %v", c.query, resp.Limit, got, c.limit, c.seqs)
		}
		last := e.dp.flowReads[len(e.dp.flowReads)-1]
		if last.limit != c.limit || last.filter != c.filter {
			t.Errorf("%s: dataplane read with %d %+v, want %d %+v", c.query, last.limit, last.filter, c.limit, c.filter)
		}
	}
	// A record as JSON: the fields operators read.
	w := e.do(req{method: "GET", path: "/v1/network/services/flows?verdict=dropped", token: readToken})
	var raw struct {
		Records []map[string]any `json:"records"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &raw); err != nil || len(raw.Records) != 1 {
		t.Fatalf("%s: %v", w.Body, err)
	}
	r := raw.Records[0]
	if r["service"] != "db" || r["verdict"] != "dropped" || r["reason"] != "no_backend" || r["client"] != "10.0.0.5:41000" ||
		r["vip"] != "10.96.0.10:80" || r["backend"] != nil || r["last_seen"] != flowT0.Format(time.RFC3339) {
		t.Errorf("record JSON %v", r)
	}
}

func equalSeqs(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestFlowsRouteRejects: a bad limit (not a number, 0, above
// flows.MaxLimit), backend, verdict or since is 400 invalid_request naming
// the parameter, before the dataplane is asked; a dataplane error is
// classified as usual.
func TestFlowsRouteRejects(t *testing.T) {
	e := newEnv(t)
	for q, field := range map[string]string{
		"limit=abc":                   "limit",
		"limit=0":                     "limit",
		"limit=-1":                    "limit",
		"limit=4097":                  "limit",
		"backend=10.40.1":             "backend",
		"backend=fe80::1%25eth0":      "backend",
		"verdict=allowed":             "verdict",
		"since=yesterday":             "since",
		"since=2026-05-06%2007:08:09": "since",
	} {
		w := e.do(req{method: "GET", path: "/v1/network/services/flows?" + q, token: readToken})
		d := wantError(t, w, http.StatusBadRequest, api.CodeInvalidRequest, field)
		t.Logf("%s: %s", q, d.Message)
	}
	if len(e.dp.flowReads) != 0 {
		t.Errorf("the dataplane was asked %d times for bad requests", len(e.dp.flowReads))
	}
	e.dp.flowsErr = fmt.Errorf("fluxvm: flows: %w", fluxvm.ErrClosed)
	wantError(t, e.do(req{method: "GET", path: "/v1/network/services/flows", token: readToken}), http.StatusServiceUnavailable, api.CodeUnavailable, "")
	w := e.do(req{method: "POST", path: "/v1/network/services/telemetry/export", token: readToken})
	wantError(t, w, http.StatusForbidden, api.CodeForbidden, "")
}

// TestExportRouteNotConfigured: without an exporter the route is 422
// missing_prerequisite naming otlp_endpoint, and reads nothing.
func TestExportRouteNotConfigured(t *testing.T) {
	e := newEnv(t)
	e.dp.flows = someFlows()
	w := e.do(req{method: "POST", path: "/v1/network/services/telemetry/export", token: adminToken})
	d := wantError(t, w, http.StatusUnprocessableEntity, api.CodeMissingPrerequisite, "")
	if d.Message == "" || !contains(d.Message, "otlp_endpoint not configured") {
		t.Errorf("message %q", d.Message)
	}
	if len(e.dp.flowReads) != 0 {
		t.Errorf("flows read without an exporter: %v", e.dp.flowReads)
	}
}

func contains(s, sub string) bool {
	return len(sub) == 0 || (len(s) >= len(sub) && (s[:len(sub)] == sub || contains(s[1:], sub)))
}

// receiver is an OTLP/HTTP logs endpoint on loopback that counts what it
// got and answers with status.
type receiver struct {
	mu       sync.Mutex
	requests int
	bytes    int
	status   int
}

func newReceiver(t *testing.T, status int) (*receiver, *httptest.Server) {
	rc := &receiver{status: status}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		rc.mu.Lock()
		if r.URL.Path == "/v1/logs" {
			rc.requests++
			rc.bytes += len(b)
		}
		rc.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(rc.status)
		_, _ = w.Write([]byte("{}"))
	}))
	t.Cleanup(srv.Close)
	return rc, srv
}

func newExporter(t *testing.T, endpoint string) *otlp.Exporter {
	x, err := otlp.New(otlp.Config{Endpoint: endpoint, NodeName: "node-a", MaxBatch: 2, QueueSize: 16, RetryMaxElapsed: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = x.Close(ctx)
	})
	return x
}

// TestExportRoute: with an otlp.Exporter, POST
// /v1/network/services/telemetry/export reads up to limit (default 1024)
// newest records, unfiltered, sends them to the receiver now (in batches
// of MaxBatch) and reports what it sent; a receiver that refuses is 503
// unavailable, saying so.
func TestExportRoute(t *testing.T) {
	rc, srv := newReceiver(t, http.StatusOK)
	x := newExporter(t, srv.URL)
	e := newEnv(t, func(o *api.Options) { o.Exporter = x })
	e.dp.flows = someFlows()

	w := e.do(req{method: "POST", path: "/v1/network/services/telemetry/export", token: adminToken})
	if w.Code != http.StatusOK {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	var resp api.ExportResponse
	dec := json.NewDecoder(w.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&resp); err != nil {
		t.Fatal(err)
	}
	rc.mu.Lock()
	reqs, n := rc.requests, rc.bytes
	rc.mu.Unlock()
	if resp.Read != 3 || resp.Sent.Records != 3 || resp.Sent.Batches != 2 || resp.Sent.Rejected != 0 ||
		resp.Sent.Encoding != otlp.EncodingJSON || resp.Sent.Bytes != n || reqs != 2 {
		t.Errorf("response %+v; the receiver got %d requests, %d bytes", resp, reqs, n)
	}
	if last := e.dp.flowReads[len(e.dp.flowReads)-1]; last.limit != api.DefaultExportLimit || last.filter != (flows.Filter{}) {
		t.Errorf("read %+v, want the default limit and no filter", last)
	}
	if st := x.Stats(); st.RecordsSent != 3 || st.BatchesSent != 2 {
		t.Errorf("exporter stats %+v", st)
	}

	w = e.do(req{method: "POST", path: "/v1/network/services/telemetry/export?limit=1", token: adminToken})
	if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil || w.Code != http.StatusOK || resp.Read != 1 || resp.Sent.Records != 1 {
		t.Errorf("limit=1: %d %s", w.Code, w.Body)
	}
	wantError(t, e.do(req{method: "POST", path: "/v1/network/services/telemetry/export?limit=4097", token: adminToken}),
		http.StatusBadRequest, api.CodeInvalidRequest, "limit")

	// Nothing recorded: nothing sent, no request.
	e.dp.flows = nil
	w = e.do(req{method: "POST", path: "/v1/network/services/telemetry/export", token: adminToken})
	if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil || w.Code != http.StatusOK || resp.Read != 0 || resp.Sent.Records != 0 {
		t.Errorf("no records: %d %s", w.Code, w.Body)
	}

	// A receiver that refuses (400: permanent, not retried).
	rc.mu.Lock()
	rc.status = http.StatusBadRequest
	rc.mu.Unlock()
	e.dp.flows = someFlows()
	w = e.do(req{method: "POST", path: "/v1/network/services/telemetry/export", token: adminToken})
	d := wantError(t, w, http.StatusServiceUnavailable, api.CodeUnavailable, "")
	if !contains(d.Message, "OTLP receiver") || !contains(d.Message, "read 3, sent 0") {
		t.Errorf("message %q", d.Message)
	}
	if st := x.Stats(); st.BatchesFailed != 1 {
		t.Errorf("exporter stats after the refusal %+v", st)
	}

	// The exporter's counters are in /metrics: 4 records sent in 3
	// requests, then one request of 2 refused and 1 record not sent.
	w = e.do(req{method: "GET", path: "/metrics", token: readToken})
	for _, want := range []string{
		"fluxvm_otlp_records_sent_total 4",
		"fluxvm_otlp_batches_sent_total 3",
		"fluxvm_otlp_failed_batches_total 1",
		"fluxvm_otlp_retries_total 0",
		`fluxvm_otlp_dropped_total{reason="failed"} 3`,
		`fluxvm_otlp_dropped_total{reason="queue_full"} 0`,
		"fluxvm_otlp_queued_records 0",
		"fluxvm_otlp_last_error_timestamp_seconds ",
		"fluxvm_services 0",
	} {
		if !contains(w.Body.String(), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

// TestMetricsWithoutExporter: no exporter, no fluxvm_otlp series.
func TestMetricsWithoutExporter(t *testing.T) {
	e := newEnv(t)
	w := e.do(req{method: "GET", path: "/metrics", token: readToken})
	if w.Code != http.StatusOK || contains(w.Body.String(), "fluxvm_otlp_") {
		t.Errorf("%d, OTLP series without an exporter:\n%s", w.Code, w.Body)
	}
}

// stoppingExporter fails every Export with err.
type stoppingExporter struct{ err error }

func (s stoppingExporter) Export(context.Context, []flows.Record) (otlp.Report, error) {
	return otlp.Report{Encoding: otlp.EncodingJSON}, s.err
}

// TestExportRouteStopping: an export the exporter's owner did not run
// because it is stopping (an error that is api.ErrExportStopping, or
// otlp.ErrClosed) is 503 unavailable with the exporter's own message,
// without blaming the receiver; any other failure does blame it.
func TestExportRouteStopping(t *testing.T) {
	stopping := fmt.Errorf("owner is stopping: refused: %w", api.ErrExportStopping)
	for _, c := range []struct {
		err      error
		prefix   string
		receiver bool
	}{
		{stopping, "owner is stopping: refused", false},
		{otlp.ErrClosed, otlp.ErrClosed.Error(), false},
		{fmt.Errorf("post: connection refused"), "the OTLP receiver did not take the records: post: connection refused", true},
	} {
		e := newEnv(t, func(o *api.Options) { o.Exporter = stoppingExporter{c.err} })
		e.dp.flows = someFlows()
		d := wantError(t, e.do(req{method: "POST", path: "/v1/network/services/telemetry/export", token: adminToken}),
			http.StatusServiceUnavailable, api.CodeUnavailable, "")
		if !strings.HasPrefix(d.Message, c.prefix) || contains(d.Message, "OTLP receiver") != c.receiver || !contains(d.Message, "read 3, sent 0") {
			t.Errorf("%v: message %q, want it to start with %q (blaming the receiver: %v)", c.err, d.Message, c.prefix, c.receiver)
		}
	}
}
