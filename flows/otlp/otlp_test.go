package otlp

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	collogs "go.opentelemetry.io/proto/otlp/collector/logs/v1"
	common "go.opentelemetry.io/proto/otlp/common/v1"
	logs "go.opentelemetry.io/proto/otlp/logs/v1"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp/otlptest"
)

// testRecords are a forwarded north-south flow with every field set and a
// dropped IPv6 flow without backend, SNAT or interface.
func testRecords() []flows.Record {
	first := time.Date(2026, 12, 1, 10, 0, 0, 123456789, time.UTC)
	return []flows.Record{{
		Seq:       41,
		Service:   "web",
		ServiceID: 7,
		BackendID: 3,
		Protocol:  "tcp",
		Client:    netip.MustParseAddrPort("10.0.0.5:41234"),
		VIP:       netip.MustParseAddrPort("10.96.0.10:80"),
		Backend:   netip.MustParseAddrPort("10.1.0.7:8080"),
		SNAT:      netip.MustParseAddrPort("10.2.0.1:61000"),
		Verdict:   flows.Forwarded,
		Hook:      "ns_in",
		Interface: "eth1",
		FirstSeen: first,
		LastSeen:  first.Add(1500 * time.Millisecond),
		Forward:   flows.Counts{Packets: 12, Bytes: 3400},
		Reply:     flows.Counts{Packets: 10, Bytes: 5600},
	}, {
		Seq:       42,
		ServiceID: 9,
		Protocol:  "udp",
		Client:    netip.MustParseAddrPort("[fd00::5]:5353"),
		VIP:       netip.MustParseAddrPort("[fd00:96::10]:53"),
		Verdict:   flows.Dropped,
		Reason:    "no_backend",
		Hook:      "from_vm",
		FirstSeen: first.Add(time.Second),
		LastSeen:  first.Add(2 * time.Second),
		Forward:   flows.Counts{Packets: 3, Bytes: 210},
		Drops:     3,
	}}
}

func attrMap(t *testing.T, kvs []*common.KeyValue) map[string]any {
	t.Helper()
	m := map[string]any{}
	for _, kv := range kvs {
		if _, dup := m[kv.Key]; dup {
			t.Errorf("attribute %s twice", kv.Key)
		}
		switch v := kv.Value.Value.(type) {
		case *common.AnyValue_StringValue:
			m[kv.Key] = v.StringValue
		case *common.AnyValue_IntValue:
			m[kv.Key] = v.IntValue
		default:
			t.Errorf("attribute %s has type %T", kv.Key, v)
		}
	}
	return m
}

// checkRequest checks a decoded request against the records sent.
func checkRequest(t *testing.T, req *collogs.ExportLogsServiceRequest, recs []flows.Record, before, after time.Time) {
	t.Helper()
	if len(req.ResourceLogs) != 1 || len(req.ResourceLogs[0].ScopeLogs) != 1 {
		t.Fatalf("want 1 resource with 1 scope, got %v", req)
	}
	rl := req.ResourceLogs[0]
	otlptest.CheckAttributes(t, "resource", attrMap(t, rl.Resource.Attributes), map[string]any{
		"service.name": "fluxvmd-test", "host.name": "node-a", "fluxvm.node": "node-a",
	})
	sl := rl.ScopeLogs[0]
	if sl.Scope.GetName() != ScopeName {
		t.Errorf("scope %q, want %q", sl.Scope.GetName(), ScopeName)
	}
	if len(sl.LogRecords) != len(recs) {
		t.Fatalf("%d log records, want %d", len(sl.LogRecords), len(recs))
	}
	for i, lr := range sl.LogRecords {
		r := recs[i]
		if got, want := lr.TimeUnixNano, uint64(r.LastSeen.UnixNano()); got != want {
			t.Errorf("rec %d: timeUnixNano %d, want %d (LastSeen)", i, got, want)
		}
		if obs := lr.ObservedTimeUnixNano; obs < uint64(before.UnixNano()) || obs > uint64(after.UnixNano()) {
			t.Errorf("rec %d: observedTimeUnixNano %d outside the export [%d, %d]", i, obs, before.UnixNano(), after.UnixNano())
		}
		wantSev, wantText := logs.SeverityNumber_SEVERITY_NUMBER_INFO, "INFO"
		if r.Verdict == flows.Dropped {
			wantSev, wantText = logs.SeverityNumber_SEVERITY_NUMBER_WARN, "WARN"
		}
		if lr.SeverityNumber != wantSev || lr.SeverityText != wantText {
			t.Errorf("rec %d: severity %v %q, want %v %q", i, lr.SeverityNumber, lr.SeverityText, wantSev, wantText)
		}
		if got := lr.Body.GetStringValue(); got != Summary(&r) || got == "" || strings.Contains(got, "\n") {
			t.Errorf("rec %d: body %q, want %q", i, got, Summary(&r))
		}
		if lr.EventName != EventName {
			t.Errorf("rec %d: event name %q", i, lr.EventName)
		}
		if len(lr.TraceId) != 0 || len(lr.SpanId) != 0 {
			t.Errorf("rec %d: ids set", i)
		}
		otlptest.CheckAttributes(t, "rec attributes", attrMap(t, lr.Attributes), otlptest.WantAttributes(r))
	}
}

type captured struct {
	path, ctype string
	body        []byte
	at          time.Time
}

// receiver is an httptest server that answers with respond (200 when nil)
// and keeps what it was sent.
type receiver struct {
	*httptest.Server
	mu      sync.Mutex
	reqs    []captured
	respond func(n int, w http.ResponseWriter, r *http.Request) // n counts from 0
	release chan struct{}                                       // closed at cleanup: ends hanging handlers
}

func newReceiver(t *testing.T, respond func(n int, w http.ResponseWriter, r *http.Request)) *receiver {
	rc := &receiver{respond: respond, release: make(chan struct{})}
	rc.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		rc.mu.Lock()
		n := len(rc.reqs)
		rc.reqs = append(rc.reqs, captured{r.URL.Path, r.Header.Get("Content-Type"), body, time.Now()})
		rc.mu.Unlock()
		if rc.respond != nil {
			rc.respond(n, w, r)
		}
	}))
	t.Cleanup(func() { close(rc.release); rc.Close() })
	return rc
}

func (rc *receiver) requests() []captured {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return append([]captured(nil), rc.reqs...)
}

// hang is a respond func that never answers (until the test ends).
func (rc *receiver) hang(_ int, _ http.ResponseWriter, r *http.Request) {
	select {
	case <-r.Context().Done():
	case <-rc.release:
	}
}

func testConfig(endpoint string, enc Encoding) Config {
	return Config{
		Endpoint:        endpoint,
		Encoding:        enc,
		Interval:        time.Hour, // tests that want the loop set it
		Timeout:         2 * time.Second,
		NodeName:        "node-a",
		ServiceName:     "fluxvmd-test",
		RetryInitial:    10 * time.Millisecond,
		RetryMax:        100 * time.Millisecond,
		RetryMaxElapsed: 5 * time.Second,
	}
}

func newExporter(t *testing.T, cfg Config) *Exporter {
	t.Helper()
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		e.Close(ctx)
	})
	return e
}

func TestExportJSON(t *testing.T) {
	rc := newReceiver(t, nil)
	e := newExporter(t, testConfig(rc.URL, EncodingJSON))
	recs := testRecords()
	before := time.Now()
	rep, err := e.Export(context.Background(), recs)
	after := time.Now()
	if err != nil {
		t.Fatal(err)
	}
	if rep.Records != 2 || rep.Batches != 1 || rep.Rejected != 0 || rep.Encoding != EncodingJSON || rep.Bytes == 0 {
		t.Errorf("report %+v", rep)
	}
	got := rc.requests()
	if len(got) != 1 {
		t.Fatalf("%d requests", len(got))
	}
	if got[0].path != "/v1/logs" || got[0].ctype != "application/json" {
		t.Errorf("POST %s %s, want /v1/logs application/json", got[0].path, got[0].ctype)
	}
	var req collogs.ExportLogsServiceRequest
	if err := protojson.Unmarshal(got[0].body, &req); err != nil {
		t.Fatalf("protojson cannot read the body: %v\n%s", err, got[0].body)
	}
	checkRequest(t, &req, recs, before, after)

	// The OTLP/JSON rules, on the bytes themselves.
	raw := string(got[0].body)
	for _, want := range []string{
		`"resourceLogs":[`, `"scopeLogs":[`, `"logRecords":[`,
		`"timeUnixNano":"` + itoa(recs[0].LastSeen.UnixNano()) + `"`,
		`"observedTimeUnixNano":"`,
		`"severityNumber":9,`, `"severityNumber":13,`,
		`"severityText":"WARN"`,
		`"key":"source.port","value":{"intValue":"41234"}`,
		`"eventName":"fluxvm.flow"`,
	} {
		if !strings.Contains(raw, want) {
			t.Errorf("body lacks %s", want)
		}
	}
	for _, bad := range []string{"_unix_nano", "severity_number", "SEVERITY_NUMBER", "resource_logs", "traceId", "spanId"} {
		if strings.Contains(raw, bad) {
			t.Errorf("body has %s", bad)
		}
	}
	if !json.Valid(got[0].body) {
		t.Error("body is not valid JSON")
	}
}

func itoa(n int64) string { b, _ := json.Marshal(n); return string(b) }

func TestExportProtobuf(t *testing.T) {
	rc := newReceiver(t, nil)
	e := newExporter(t, testConfig(rc.URL, EncodingProtobuf))
	recs := testRecords()
	before := time.Now()
	rep, err := e.Export(context.Background(), recs)
	after := time.Now()
	if err != nil {
		t.Fatal(err)
	}
	if rep.Records != 2 || rep.Encoding != EncodingProtobuf {
		t.Errorf("report %+v", rep)
	}
	got := rc.requests()
	if len(got) != 1 || got[0].path != "/v1/logs" || got[0].ctype != "application/x-protobuf" {
		t.Fatalf("requests %+v", got)
	}
	var req collogs.ExportLogsServiceRequest
	if err := proto.Unmarshal(got[0].body, &req); err != nil {
		t.Fatal(err)
	}
	checkRequest(t, &req, recs, before, after)
}

// Both encodings carry the same message, and MarshalJSON reads back with
// protojson as the very message it wrote (when no ids are set, protojson
// and OTLP/JSON agree on every field).
func TestMarshalJSONRoundTrip(t *testing.T) {
	recs := testRecords()
	recs[0].Service = "we\"b\\ \n\t\x01 ünï \u2028"
	req := NewRequest(recs, "s", "n", time.Unix(1700000000, 5))
	b, err := MarshalJSON(req)
	if err != nil {
		t.Fatal(err)
	}
	var back collogs.ExportLogsServiceRequest
	if err := protojson.Unmarshal(b, &back); err != nil {
		t.Fatalf("%v\n%s", err, b)
	}
	if !proto.Equal(req, &back) {
		t.Errorf("round trip differs:\nsent %v\ngot  %v", req, &back)
	}
}

// Trace and span ids are hex, other bytes base64, enums integers, 64-bit
// integers strings, doubles numbers: checked on a LogRecord built by hand,
// since flows carry no ids.
func TestMarshalJSONSpecRules(t *testing.T) {
	lr := &logs.LogRecord{
		TimeUnixNano:   1700000000000000001,
		SeverityNumber: logs.SeverityNumber_SEVERITY_NUMBER_ERROR,
		TraceId:        []byte{0x5b, 0x8e, 0xff, 0xf7, 0x98, 0x03, 0x81, 0x03, 0xd2, 0x69, 0xb6, 0x33, 0x81, 0x3f, 0xc6, 0x0c},
		SpanId:         []byte{0xee, 0xe1, 0x9b, 0x7e, 0xc3, 0xc1, 0xb1, 0x74},
		Flags:          1,
		Attributes: []*common.KeyValue{
			{Key: "b", Value: &common.AnyValue{Value: &common.AnyValue_BytesValue{BytesValue: []byte{0xff, 0x00}}}},
			{Key: "i", Value: &common.AnyValue{Value: &common.AnyValue_IntValue{IntValue: -5}}},
			{Key: "d", Value: &common.AnyValue{Value: &common.AnyValue_DoubleValue{DoubleValue: 0.25}}},
			{Key: "t", Value: &common.AnyValue{Value: &common.AnyValue_BoolValue{BoolValue: true}}},
		},
	}
	b, err := MarshalJSON(lr)
	if err != nil {
		t.Fatal(err)
	}
	raw := string(b)
	for _, want := range []string{
		`"timeUnixNano":"1700000000000000001"`,
		`"severityNumber":17`,
		`"traceId":"5b8efff798038103d269b633813fc60c"`,
		`"spanId":"eee19b7ec3c1b174"`,
		`"flags":1`,
		`{"key":"b","value":{"bytesValue":"/wA="}}`,
		`{"key":"i","value":{"intValue":"-5"}}`,
		`{"key":"d","value":{"doubleValue":0.25}}`,
		`{"key":"t","value":{"boolValue":true}}`,
	} {
		if !strings.Contains(raw, want) {
			t.Errorf("lacks %s in %s", want, raw)
		}
	}
	if !json.Valid(b) {
		t.Errorf("invalid JSON %s", b)
	}
	// What protojson would have written for the ids: the bug the
	// specification warns about.
	pj, _ := protojson.Marshal(lr)
	if strings.Contains(string(pj), "5b8efff7") {
		t.Errorf("protojson writes hex ids now? %s", pj)
	}
}

// A 503 with Retry-After is retried after the delay it asks, not the
// (much shorter) backoff, and counted; then the batch goes through.
func TestRetryAfter503(t *testing.T) {
	for _, ra := range []string{"1", "date"} {
		t.Run(ra, func(t *testing.T) {
			rc := newReceiver(t, func(n int, w http.ResponseWriter, r *http.Request) {
				if n == 0 {
					v := ra
					if v == "date" {
						v = time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat)
					}
					w.Header().Set("Retry-After", v)
					w.WriteHeader(http.StatusServiceUnavailable)
				}
			})
			e := newExporter(t, testConfig(rc.URL, EncodingJSON))
			rep, err := e.Export(context.Background(), testRecords())
			if err != nil {
				t.Fatal(err)
			}
			got := rc.requests()
			if len(got) != 2 {
				t.Fatalf("%d requests, want 2", len(got))
			}
			// An HTTP date has a resolution of a second: at least 1 s.
			if gap := got[1].at.Sub(got[0].at); gap < 900*time.Millisecond {
				t.Errorf("retried after %v, before the Retry-After delay", gap)
			}
			if rep.Retries != 1 || rep.Records != 2 {
				t.Errorf("report %+v", rep)
			}
			st := e.Stats()
			if st.Retries != 1 || st.BatchesSent != 1 || st.RecordsSent != 2 || st.BatchesFailed != 0 {
				t.Errorf("stats %+v", st)
			}
		})
	}
}

// 429 without Retry-After: exponential backoff (RetryInitial 10 ms, then
// 20 ms, each -50%..+50%).
func TestBackoff429(t *testing.T) {
	rc := newReceiver(t, func(n int, w http.ResponseWriter, r *http.Request) {
		if n < 3 {
			w.WriteHeader(http.StatusTooManyRequests)
		}
	})
	cfg := testConfig(rc.URL, EncodingProtobuf)
	cfg.RetryInitial = 40 * time.Millisecond
	cfg.RetryMax = time.Second
	e := newExporter(t, cfg)
	rep, err := e.Export(context.Background(), testRecords())
	if err != nil {
		t.Fatal(err)
	}
	got := rc.requests()
	if len(got) != 4 || rep.Retries != 3 || e.Stats().Retries != 3 {
		t.Fatalf("%d requests, report %+v", len(got), rep)
	}
	for i := 1; i < len(got); i++ {
		min := (cfg.RetryInitial << (i - 1)) / 2
		if gap := got[i].at.Sub(got[i-1].at); gap < min {
			t.Errorf("retry %d after %v, want >= %v", i, gap, min)
		}
	}
}

// A 400 is permanent: one request, no retry, counted as failed.
func TestPermanent400(t *testing.T) {
	rc := newReceiver(t, func(n int, w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, `{"code":3,"message":"bad   log record"}`)
	})
	e := newExporter(t, testConfig(rc.URL, EncodingJSON))
	rep, err := e.Export(context.Background(), testRecords())
	var se *StatusError
	if !errors.As(err, &se) || se.StatusCode != 400 || se.Retryable() || !strings.Contains(se.Message, "bad log record") {
		t.Fatalf("err %v, want a 400 StatusError with the message", err)
	}
	if n := len(rc.requests()); n != 1 {
		t.Errorf("%d requests, want 1", n)
	}
	if rep.Records != 0 || rep.Rejected != 2 || rep.Retries != 0 {
		t.Errorf("report %+v", rep)
	}
	st := e.Stats()
	if st.BatchesFailed != 1 || st.DroppedFailed != 2 || st.Retries != 0 || !strings.Contains(st.LastError, "400") || st.LastErrorTime.IsZero() {
		t.Errorf("stats %+v", st)
	}
}

// A partial success counts the rejected records.
func TestPartialSuccess(t *testing.T) {
	rc := newReceiver(t, func(n int, w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"partialSuccess":{"rejectedLogRecords":"1","errorMessage":"too old"}}`)
	})
	e := newExporter(t, testConfig(rc.URL, EncodingJSON))
	rep, err := e.Export(context.Background(), testRecords())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Records != 1 || rep.Rejected != 1 {
		t.Errorf("report %+v", rep)
	}
	if st := e.Stats(); st.RecordsSent != 1 || st.DroppedFailed != 1 || !strings.Contains(st.LastError, "too old") {
		t.Errorf("stats %+v", st)
	}
}

// A receiver that never answers: each request ends at Timeout, is retried,
// and the batch is given up once RetryMaxElapsed would pass; meanwhile
// Enqueue does not block.
func TestReceiverNeverAnswers(t *testing.T) {
	rc := newReceiver(t, nil)
	rc.respond = rc.hang
	cfg := testConfig(rc.URL, EncodingJSON)
	cfg.Interval = 20 * time.Millisecond
	cfg.Timeout = 100 * time.Millisecond
	cfg.RetryMaxElapsed = 300 * time.Millisecond
	cfg.QueueSize = 100
	cfg.MaxBatch = 10
	e := newExporter(t, cfg)

	start := time.Now()
	var acc, drop int
	for i := 0; i < 1000; i++ {
		a, d := e.Enqueue(testRecords())
		acc, drop = acc+a, drop+d
	}
	if el := time.Since(start); el > time.Second {
		t.Errorf("1000 Enqueue calls took %v", el)
	}
	if acc != 100 || drop != 1900 {
		t.Errorf("accepted %d, dropped %d; want 100, 1900", acc, drop)
	}
	deadline := time.Now().Add(10 * time.Second)
	for e.Stats().BatchesFailed == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	st := e.Stats()
	if st.BatchesFailed == 0 || st.Retries == 0 || st.DroppedFailed < 10 || !strings.Contains(st.LastError, "giving up") {
		t.Fatalf("stats %+v", st)
	}
	if !strings.Contains(st.LastError, "deadline exceeded") && !strings.Contains(st.LastError, "Timeout") {
		t.Errorf("last error %q does not say it timed out", st.LastError)
	}
	// Still no blocking while the loop is stuck on the next batch.
	start = time.Now()
	e.Enqueue(testRecords())
	if el := time.Since(start); el > 50*time.Millisecond {
		t.Errorf("Enqueue took %v", el)
	}
}

// The queue bound counts queued and in-flight records; what does not fit
// is the newest, dropped and counted. The rest arrives, in order.
func TestQueueFullDropsNewest(t *testing.T) {
	rc := newReceiver(t, nil)
	gate := make(chan struct{})
	rc.respond = func(n int, w http.ResponseWriter, r *http.Request) {
		select {
		case <-gate:
		case <-rc.release:
		}
	}
	cfg := testConfig(rc.URL, EncodingProtobuf)
	cfg.QueueSize = 10
	cfg.MaxBatch = 4
	e := newExporter(t, cfg)
	var recs []flows.Record
	for i := 0; i < 16; i++ {
		r := testRecords()[0]
		r.Seq = uint64(i)
		recs = append(recs, r)
	}
	if a, d := e.Enqueue(recs[:6]); a != 6 || d != 0 {
		t.Fatalf("accepted %d dropped %d", a, d)
	}
	// The loop takes a full batch (4) in flight; the bound still holds.
	waitFor(t, func() bool { return len(rc.requests()) == 1 })
	if a, d := e.Enqueue(recs[6:]); a != 4 || d != 6 {
		t.Fatalf("accepted %d dropped %d, want 4 6", a, d)
	}
	if st := e.Stats(); st.Queued != 10 || st.DroppedQueueFull != 6 {
		t.Errorf("stats %+v", st)
	}
	close(gate)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	var seqs []int64
	for _, c := range rc.requests() {
		var req collogs.ExportLogsServiceRequest
		if err := proto.Unmarshal(c.body, &req); err != nil {
			t.Fatal(err)
		}
		for _, lr := range req.ResourceLogs[0].ScopeLogs[0].LogRecords {
			seqs = append(seqs, attrMap(t, lr.Attributes)["fluxvm.flow.seq"].(int64))
		}
	}
	if len(seqs) != 10 {
		t.Fatalf("received %v, want seq 0..9", seqs)
	}
	for i, s := range seqs {
		if s != int64(i) {
			t.Fatalf("received %v, want seq 0..9 in order", seqs)
		}
	}
	if st := e.Stats(); st.RecordsSent != 10 || st.DroppedFailed != 0 || st.Queued != 0 {
		t.Errorf("stats %+v", st)
	}
	if a, d := e.Enqueue(recs[:2]); a != 0 || d != 2 {
		t.Errorf("after Close: accepted %d dropped %d", a, d)
	}
	if _, err := e.Export(context.Background(), recs[:1]); !errors.Is(err, ErrClosed) {
		t.Errorf("Export after Close: %v", err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 5 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Close with a short deadline returns on time while the receiver hangs,
// and counts what it could not deliver.
func TestCloseDeadlineHangingReceiver(t *testing.T) {
	rc := newReceiver(t, nil)
	rc.respond = rc.hang
	cfg := testConfig(rc.URL, EncodingJSON)
	cfg.Timeout = time.Minute
	cfg.RetryMaxElapsed = time.Hour
	cfg.MaxBatch = 2
	e := newExporter(t, cfg)
	for i := 0; i < 5; i++ {
		e.Enqueue(testRecords())
	}
	waitFor(t, func() bool { return len(rc.requests()) >= 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := e.Close(ctx)
	if el := time.Since(start); el > 700*time.Millisecond {
		t.Errorf("Close took %v with a 200 ms deadline", el)
	}
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "10 records") {
		t.Errorf("Close: %v", err)
	}
	if st := e.Stats(); st.DroppedFailed != 10 || st.RecordsSent != 0 || st.Queued != 0 {
		t.Errorf("stats %+v", st)
	}
}

// The loop exports on its interval, and a full batch at once.
func TestLoop(t *testing.T) {
	t.Run("interval", func(t *testing.T) {
		rc := newReceiver(t, nil)
		cfg := testConfig(rc.URL, EncodingJSON)
		cfg.Interval = 50 * time.Millisecond
		e := newExporter(t, cfg)
		e.Enqueue(testRecords())
		waitFor(t, func() bool { return e.Stats().RecordsSent == 2 })
	})
	t.Run("full batch", func(t *testing.T) {
		rc := newReceiver(t, nil)
		cfg := testConfig(rc.URL, EncodingJSON)
		cfg.MaxBatch = 4
		e := newExporter(t, cfg)
		e.Enqueue(testRecords())
		e.Enqueue(testRecords()[:1])
		time.Sleep(50 * time.Millisecond)
		if n := len(rc.requests()); n != 0 {
			t.Fatalf("%d requests before the batch was full or the interval passed", n)
		}
		e.Enqueue(testRecords()[:1])
		waitFor(t, func() bool { return e.Stats().BatchesSent == 1 })
		if st := e.Stats(); st.RecordsSent != 4 {
			t.Errorf("stats %+v", st)
		}
	})
}

// Connection refused is a network error: retried, then given up.
func TestNetworkErrorRetried(t *testing.T) {
	rc := newReceiver(t, nil)
	url := rc.URL
	rc.Close() // nothing listens there now
	cfg := testConfig(url, EncodingJSON)
	cfg.RetryMaxElapsed = 200 * time.Millisecond
	e := newExporter(t, cfg)
	rep, err := e.Export(context.Background(), testRecords())
	if err == nil || !strings.Contains(err.Error(), "giving up") || rep.Retries == 0 {
		t.Fatalf("err %v, report %+v", err, rep)
	}
}

// Export honours its context.
func TestExportContext(t *testing.T) {
	rc := newReceiver(t, nil)
	rc.respond = rc.hang
	e := newExporter(t, testConfig(rc.URL, EncodingJSON))
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := e.Export(ctx, testRecords())
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > time.Second {
		t.Errorf("err %v after %v", err, time.Since(start))
	}
}

func TestConfig(t *testing.T) {
	c, err := Config{Endpoint: "http://127.0.0.1:4318/", NodeName: "n"}.normalize()
	if err != nil {
		t.Fatal(err)
	}
	want := Config{Endpoint: "http://127.0.0.1:4318", Encoding: EncodingJSON, Interval: DefaultInterval,
		Timeout: DefaultTimeout, QueueSize: DefaultQueueSize, MaxBatch: DefaultMaxBatch, NodeName: "n",
		ServiceName: DefaultServiceName, RetryInitial: DefaultRetryInitial, RetryMax: DefaultRetryMax,
		RetryMaxElapsed: DefaultRetryMaxElapsed}
	if !equalConfig(c, want) {
		t.Errorf("defaults %+v\nwant %+v", c, want)
	}
	if c, _ := (Config{Endpoint: "https://otel.example:4318/prefix"}).normalize(); c.NodeName == "" || c.Endpoint != "https://otel.example:4318/prefix" {
		t.Errorf("%+v", c)
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no endpoint", Config{}, "no endpoint"},
		{"no scheme", Config{Endpoint: "127.0.0.1:4318"}, "scheme must be http or https"},
		{"grpc", Config{Endpoint: "grpc://h:4317"}, "scheme must be http or https"},
		{"no host", Config{Endpoint: "http:///x"}, "no host"},
		{"signal path", Config{Endpoint: "http://h:4318/v1/logs"}, "without /v1/logs"},
		{"query", Config{Endpoint: "http://h:4318?a=b"}, "no query"},
		{"userinfo", Config{Endpoint: "http://u:p@h:4318"}, "credentials"},
		{"encoding", Config{Endpoint: "http://h", Encoding: "xml"}, `encoding "xml"`},
		{"interval", Config{Endpoint: "http://h", Interval: -1}, "interval -1ns is negative"},
		{"timeout", Config{Endpoint: "http://h", Timeout: -time.Second}, "timeout -1s is negative"},
		{"queue", Config{Endpoint: "http://h", QueueSize: -1}, "queue size -1"},
		{"batch", Config{Endpoint: "http://h", MaxBatch: -1}, "max batch -1"},
		{"batch > queue", Config{Endpoint: "http://h", QueueSize: 10, MaxBatch: 11}, "exceeds the queue size"},
		{"header", Config{Endpoint: "http://h", Headers: map[string]string{"a b": "c"}}, "not a valid HTTP header"},
	} {
		err := tc.cfg.Validate()
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
		if _, err := New(tc.cfg); err == nil {
			t.Errorf("%s: New accepted it", tc.name)
		}
	}
	// A small queue shrinks the default batch with it.
	if c, _ := (Config{Endpoint: "http://h", QueueSize: 100}).normalize(); c.MaxBatch != 100 {
		t.Errorf("max batch %d", c.MaxBatch)
	}
}

func equalConfig(a, b Config) bool {
	return a.Endpoint == b.Endpoint && a.Encoding == b.Encoding && a.Interval == b.Interval &&
		a.Timeout == b.Timeout && a.QueueSize == b.QueueSize && a.MaxBatch == b.MaxBatch &&
		a.NodeName == b.NodeName && a.ServiceName == b.ServiceName && a.RetryInitial == b.RetryInitial &&
		a.RetryMax == b.RetryMax && a.RetryMaxElapsed == b.RetryMaxElapsed && len(a.Headers) == len(b.Headers)
}

func TestHeaders(t *testing.T) {
	var got http.Header
	rc := newReceiver(t, func(n int, w http.ResponseWriter, r *http.Request) { got = r.Header.Clone() })
	cfg := testConfig(rc.URL, EncodingJSON)
	cfg.Headers = map[string]string{"Authorization": "Bearer t0k", "Content-Type": "text/plain"}
	e := newExporter(t, cfg)
	if _, err := e.Export(context.Background(), testRecords()); err != nil {
		t.Fatal(err)
	}
	if got.Get("Authorization") != "Bearer t0k" || got.Get("Content-Type") != "application/json" {
		t.Errorf("headers %v", got)
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Duration{
		"":                              0,
		"3":                             3 * time.Second,
		" 120 ":                         2 * time.Minute,
		"0":                             0,
		"-4":                            0,
		"soon":                          0,
		"Tue, 01 Dec 2026 10:00:30 GMT": 30 * time.Second,
		"Tue, 01 Dec 2026 09:00:00 GMT": 0,
	} {
		if got := parseRetryAfter(in, now); got != want {
			t.Errorf("%q: %v, want %v", in, got, want)
		}
	}
}

// Every test closes what it started: no exporter loop, request or backoff
// goroutine outlives it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
