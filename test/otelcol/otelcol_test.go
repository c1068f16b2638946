package otelcol

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/collector/component/componenttest"
	"go.opentelemetry.io/collector/consumer/consumertest"
	"go.opentelemetry.io/collector/pdata/plog"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/receiver/receivertest"
	collogs "go.opentelemetry.io/proto/otlp/collector/logs/v1"
	common "go.opentelemetry.io/proto/otlp/common/v1"
	logs "go.opentelemetry.io/proto/otlp/logs/v1"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
	"github.com/fluxvm/servicefabric/flows/otlp/otlptest"
)

// collector is the Collector's own OTLP receiver, HTTP only, in this
// process, handing what it decoded to a sink.
type collector struct {
	addr string // host:port
	sink *consumertest.LogsSink
	stop func()
}

func startCollector(t *testing.T, addr string) *collector {
	t.Helper()
	f := otlpreceiver.NewFactory()
	cfg := f.CreateDefaultConfig().(*otlpreceiver.Config)
	cfg.Protocols.HTTP.GetOrInsertDefault().ServerConfig.NetAddr.Endpoint = addr
	sink := new(consumertest.LogsSink)
	r, err := f.CreateLogs(context.Background(), receivertest.NewNopSettings(f.Type()), cfg, sink)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background(), componenttest.NewNopHost()); err != nil {
		t.Fatal(err)
	}
	c := &collector{addr: addr, sink: sink}
	var stopped atomic.Bool
	c.stop = func() {
		if stopped.CompareAndSwap(false, true) {
			if err := r.Shutdown(context.Background()); err != nil {
				t.Error(err)
			}
		}
	}
	t.Cleanup(c.stop)
	return c
}

// freeAddr is a localhost address nothing listens on (now).
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// records are n flows, alternately forwarded (IPv4, every field) and
// dropped (IPv6, no backend), with Seq base..base+n-1.
func records(base, n int) []flows.Record {
	t0 := time.Date(2026, 12, 1, 10, 0, 0, 987654321, time.UTC)
	recs := make([]flows.Record, n)
	for i := range recs {
		seq := base + i
		first := t0.Add(time.Duration(seq) * time.Millisecond)
		if seq%2 == 0 {
			recs[i] = flows.Record{
				Seq: uint64(seq), Service: "web", ServiceID: 7, BackendID: 3, Protocol: "tcp",
				Client:  netip.AddrPortFrom(netip.MustParseAddr("10.0.0.5"), uint16(40000+seq%20000)),
				VIP:     netip.MustParseAddrPort("10.96.0.10:80"),
				Backend: netip.MustParseAddrPort("10.1.0.7:8080"),
				SNAT:    netip.MustParseAddrPort("10.2.0.1:61000"),
				Verdict: flows.Forwarded, Hook: "ns_in", Interface: "eth1",
				FirstSeen: first, LastSeen: first.Add(1500 * time.Millisecond),
				Forward: flows.Counts{Packets: uint64(seq + 12), Bytes: 3400},
				Reply:   flows.Counts{Packets: 10, Bytes: 5600},
			}
		} else {
			recs[i] = flows.Record{
				Seq: uint64(seq), ServiceID: 9, Protocol: "udp",
				Client:  netip.MustParseAddrPort("[fd00::5]:5353"),
				VIP:     netip.MustParseAddrPort("[fd00:96::10]:53"),
				Verdict: flows.Dropped, Reason: "no_backend", Hook: "from_vm",
				FirstSeen: first, LastSeen: first.Add(time.Second),
				Forward: flows.Counts{Packets: 3, Bytes: 210}, Drops: 3,
			}
		}
	}
	return recs
}

// received flattens what the sink got into log records keyed by flow seq,
// checking each resource and scope on the way.
func received(t *testing.T, sink *consumertest.LogsSink) map[int64]plog.LogRecord {
	t.Helper()
	return receivedFrom(t, sink, "fluxvmd", "node-a")
}

// receivedFrom is received of an exporter whose resource is service.name
// serviceName on node.
func receivedFrom(t *testing.T, sink *consumertest.LogsSink, serviceName, node string) map[int64]plog.LogRecord {
	t.Helper()
	out := map[int64]plog.LogRecord{}
	for _, ld := range sink.AllLogs() {
		for i := 0; i < ld.ResourceLogs().Len(); i++ {
			rl := ld.ResourceLogs().At(i)
			otlptest.CheckAttributes(t, "resource", rl.Resource().Attributes().AsRaw(), map[string]any{
				"service.name": serviceName, "host.name": node, "fluxvm.node": node,
			})
			for j := 0; j < rl.ScopeLogs().Len(); j++ {
				sl := rl.ScopeLogs().At(j)
				if sl.Scope().Name() != otlp.ScopeName {
					t.Errorf("scope %q", sl.Scope().Name())
				}
				for k := 0; k < sl.LogRecords().Len(); k++ {
					lr := sl.LogRecords().At(k)
					seq, ok := lr.Attributes().Get("fluxvm.flow.seq")
					if !ok {
						t.Fatalf("record without fluxvm.flow.seq: %v", lr.Attributes().AsRaw())
					}
					if _, dup := out[seq.Int()]; dup {
						t.Errorf("seq %d received twice", seq.Int())
					}
					out[seq.Int()] = lr
				}
			}
		}
	}
	return out
}

func checkRecord(t *testing.T, lr plog.LogRecord, r flows.Record, before, after time.Time) {
	t.Helper()
	if got, want := lr.Timestamp().AsTime(), r.LastSeen; !got.Equal(want) {
		t.Errorf("seq %d: timestamp %v, want LastSeen %v", r.Seq, got, want)
	}
	if obs := lr.ObservedTimestamp().AsTime(); obs.Before(before) || obs.After(after) {
		t.Errorf("seq %d: observed %v outside the export [%v, %v]", r.Seq, obs, before, after)
	}
	wantSev, wantText := plog.SeverityNumberInfo, "INFO"
	if r.Verdict == flows.Dropped {
		wantSev, wantText = plog.SeverityNumberWarn, "WARN"
	}
	if lr.SeverityNumber() != wantSev || lr.SeverityText() != wantText {
		t.Errorf("seq %d: severity %v %q, want %v %q", r.Seq, lr.SeverityNumber(), lr.SeverityText(), wantSev, wantText)
	}
	if got := lr.Body().AsString(); got != otlp.Summary(&r) {
		t.Errorf("seq %d: body %q, want %q", r.Seq, got, otlp.Summary(&r))
	}
	if lr.EventName() != otlp.EventName {
		t.Errorf("seq %d: event name %q", r.Seq, lr.EventName())
	}
	if !lr.TraceID().IsEmpty() || !lr.SpanID().IsEmpty() {
		t.Errorf("seq %d: ids %v %v", r.Seq, lr.TraceID(), lr.SpanID())
	}
	otlptest.CheckAttributes(t, fmt.Sprintf("seq %d attributes", r.Seq), lr.Attributes().AsRaw(), otlptest.WantAttributes(r))
}

func exporterConfig(endpoint string, enc otlp.Encoding) otlp.Config {
	return otlp.Config{
		Endpoint:        endpoint,
		Encoding:        enc,
		Interval:        50 * time.Millisecond,
		Timeout:         2 * time.Second,
		NodeName:        "node-a",
		RetryInitial:    20 * time.Millisecond,
		RetryMax:        200 * time.Millisecond,
		RetryMaxElapsed: 30 * time.Second,
	}
}

func newExporter(t *testing.T, cfg otlp.Config) *otlp.Exporter {
	t.Helper()
	e, err := otlp.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		e.Close(ctx)
	})
	return e
}

func waitFor(t *testing.T, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, limit)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// settledStats are e's Stats once nothing is queued or in flight. The
// collector hands a request to its sink before it answers, and the
// exporter counts a batch only once the answer is read: a test that saw
// the records arrive waits for the counts too.
func settledStats(t *testing.T, e *otlp.Exporter) otlp.Stats {
	t.Helper()
	waitFor(t, "the exporter to settle", 5*time.Second, func() bool { return e.Stats().Queued == 0 })
	return e.Stats()
}

// Flows exported in each encoding, by Export and by the queue, are what
// the collector decodes, field by field.
func TestCollectorDecodesFlows(t *testing.T) {
	for _, enc := range []otlp.Encoding{otlp.EncodingJSON, otlp.EncodingProtobuf} {
		t.Run(string(enc), func(t *testing.T) {
			col := startCollector(t, freeAddr(t))
			cfg := exporterConfig("http://"+col.addr, enc)
			cfg.MaxBatch = 16
			e := newExporter(t, cfg)

			recs := records(0, 40)
			before := time.Now()
			rep, err := e.Export(context.Background(), recs[:20])
			if err != nil {
				t.Fatal(err)
			}
			if rep.Records != 20 || rep.Batches != 2 || rep.Rejected != 0 || rep.Retries != 0 {
				t.Errorf("report %+v", rep)
			}
			if a, d := e.Enqueue(recs[20:]); a != 20 || d != 0 {
				t.Fatalf("enqueue: %d accepted, %d dropped", a, d)
			}
			waitFor(t, "queued records at the collector", 10*time.Second, func() bool { return col.sink.LogRecordCount() == 40 })
			after := time.Now()

			got := received(t, col.sink)
			if len(got) != len(recs) {
				t.Fatalf("collector has %d distinct records, want %d", len(got), len(recs))
			}
			for _, r := range recs {
				checkRecord(t, got[int64(r.Seq)], r, before, after)
			}
			st := settledStats(t, e)
			if st.RecordsSent != 40 || st.BatchesFailed != 0 || st.DroppedFailed != 0 || st.DroppedQueueFull != 0 {
				t.Errorf("stats %+v", st)
			}
		})
	}
}

// The collector reads OTLP/JSON trace and span ids as hex: MarshalJSON's
// ids arrive intact, where protojson's base64 would not.
func TestCollectorReadsHexIDs(t *testing.T) {
	col := startCollector(t, freeAddr(t))
	traceID := []byte{0x5b, 0x8e, 0xff, 0xf7, 0x98, 0x03, 0x81, 0x03, 0xd2, 0x69, 0xb6, 0x33, 0x81, 0x3f, 0xc6, 0x0c}
	spanID := []byte{0xee, 0xe1, 0x9b, 0x7e, 0xc3, 0xc1, 0xb1, 0x74}
	req := &collogs.ExportLogsServiceRequest{ResourceLogs: []*logs.ResourceLogs{{
		ScopeLogs: []*logs.ScopeLogs{{LogRecords: []*logs.LogRecord{{
			TimeUnixNano:   1700000000000000001,
			SeverityNumber: logs.SeverityNumber_SEVERITY_NUMBER_ERROR,
			TraceId:        traceID,
			SpanId:         spanID,
			Body:           &common.AnyValue{Value: &common.AnyValue_StringValue{StringValue: "with ids"}},
		}}}},
	}}}
	post := func(body []byte) int {
		resp, err := http.Post("http://"+col.addr+"/v1/logs", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}

	b, err := otlp.MarshalJSON(req)
	if err != nil {
		t.Fatal(err)
	}
	if code := post(b); code != http.StatusOK {
		t.Fatalf("collector answered %d to %s", code, b)
	}
	all := col.sink.AllLogs()
	if len(all) != 1 {
		t.Fatalf("%d requests in the sink", len(all))
	}
	lr := all[0].ResourceLogs().At(0).ScopeLogs().At(0).LogRecords().At(0)
	if tid, sid := lr.TraceID(), lr.SpanID(); !bytes.Equal(tid[:], traceID) || !bytes.Equal(sid[:], spanID) {
		t.Errorf("collector decoded ids %v %v", tid, sid)
	}
	if lr.SeverityNumber() != plog.SeverityNumberError || lr.Timestamp() != 1700000000000000001 || lr.Body().AsString() != "with ids" {
		t.Errorf("collector decoded %v %v %q", lr.SeverityNumber(), lr.Timestamp(), lr.Body().AsString())
	}

	// protojson's defaults (base64 ids) are not OTLP/JSON.
	col.sink.Reset()
	pj, err := protojson.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	code := post(pj)
	t.Logf("protojson's default encoding: collector answered %d", code)
	if code == http.StatusOK {
		if all := col.sink.AllLogs(); len(all) == 1 {
			tid := all[0].ResourceLogs().At(0).ScopeLogs().At(0).LogRecords().At(0).TraceID()
			if bytes.Equal(tid[:], traceID) {
				t.Errorf("the collector read protojson's base64 ids too: the hex rule would not matter")
			}
		}
	}
}

// A receiver that is down at first: the exporter keeps what the queue
// bound allows, drops (and counts) the newest beyond it, never blocks,
// and delivers every kept record once the receiver is up.
func TestReceiverDownThenUp(t *testing.T) {
	addr := freeAddr(t)
	cfg := exporterConfig("http://"+addr, otlp.EncodingJSON)
	cfg.QueueSize = 50
	cfg.MaxBatch = 10
	e := newExporter(t, cfg)

	recs := records(0, 80)
	start := time.Now()
	var accepted int
	for i := 0; i < len(recs); i += 8 {
		a, _ := e.Enqueue(recs[i : i+8])
		accepted += a
	}
	if el := time.Since(start); el > 100*time.Millisecond {
		t.Errorf("Enqueue blocked: %v", el)
	}
	if accepted != 50 {
		t.Fatalf("accepted %d, want the queue bound 50", accepted)
	}
	waitFor(t, "retries against the closed port", 5*time.Second, func() bool { return e.Stats().Retries >= 2 })

	col := startCollector(t, addr)
	waitFor(t, "kept records at the collector", 15*time.Second, func() bool { return col.sink.LogRecordCount() >= 50 })
	time.Sleep(100 * time.Millisecond) // nothing more may come
	got := received(t, col.sink)
	if len(got) != 50 {
		t.Fatalf("collector has %d records, want 50", len(got))
	}
	for _, r := range recs[:50] { // the oldest are kept, the newest dropped
		if lr, ok := got[int64(r.Seq)]; !ok {
			t.Errorf("seq %d lost", r.Seq)
		} else {
			checkRecord(t, lr, r, start, time.Now())
		}
	}
	st := settledStats(t, e)
	if st.RecordsSent != 50 || st.DroppedQueueFull != 30 || st.DroppedFailed != 0 || st.BatchesFailed != 0 || st.Retries < 2 {
		t.Errorf("stats %+v", st)
	}
}

// A proxy in front of the collector answers 503 with Retry-After the first
// few times: nothing is lost, the retries are counted.
func TestCollectorBehind503(t *testing.T) {
	for _, enc := range []otlp.Encoding{otlp.EncodingJSON, otlp.EncodingProtobuf} {
		t.Run(string(enc), func(t *testing.T) {
			col := startCollector(t, freeAddr(t))
			target, _ := url.Parse("http://" + col.addr)
			proxy := httputil.NewSingleHostReverseProxy(target)
			const refusals = 3
			var n atomic.Int32
			front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if n.Add(1) <= refusals {
					w.Header().Set("Retry-After", "1")
					http.Error(w, "busy", http.StatusServiceUnavailable)
					return
				}
				proxy.ServeHTTP(w, r)
			}))
			t.Cleanup(front.Close)

			cfg := exporterConfig(front.URL, enc)
			cfg.MaxBatch = 10
			e := newExporter(t, cfg)
			recs := records(100, 30)
			start := time.Now()
			e.Enqueue(recs[:20])
			rep, err := e.Export(context.Background(), recs[20:])
			if err != nil {
				t.Fatal(err)
			}
			if rep.Records != 10 {
				t.Errorf("report %+v", rep)
			}
			waitFor(t, "all records at the collector", 20*time.Second, func() bool { return col.sink.LogRecordCount() >= 30 })
			got := received(t, col.sink)
			if len(got) != 30 {
				t.Fatalf("collector has %d records, want 30", len(got))
			}
			for _, r := range recs {
				checkRecord(t, got[int64(r.Seq)], r, start, time.Now())
			}
			if el := time.Since(start); el < time.Second {
				t.Errorf("done in %v: Retry-After: 1 was not honoured", el)
			}
			st := settledStats(t, e)
			if st.Retries != refusals || st.RecordsSent != 30 || st.BatchesFailed != 0 || st.DroppedFailed != 0 {
				t.Errorf("stats %+v", st)
			}
		})
	}
}

// A slow collector (every answer 200 ms late) never makes Enqueue wait,
// and everything within the queue bound arrives.
func TestSlowCollector(t *testing.T) {
	col := startCollector(t, freeAddr(t))
	target, _ := url.Parse("http://" + col.addr)
	proxy := httputil.NewSingleHostReverseProxy(target)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(200 * time.Millisecond)
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)

	cfg := exporterConfig(front.URL, otlp.EncodingProtobuf)
	cfg.QueueSize = 100
	cfg.MaxBatch = 5
	e := newExporter(t, cfg)
	recs := records(1000, 60)
	start := time.Now()
	for i := 0; i < len(recs); i += 3 {
		if a, d := e.Enqueue(recs[i : i+3]); a != 3 || d != 0 {
			t.Fatalf("enqueue: %d accepted, %d dropped", a, d)
		}
	}
	// 12 batches at 200 ms each would take 2.4 s.
	if el := time.Since(start); el > 200*time.Millisecond {
		t.Errorf("Enqueue waited for the slow collector: %v", el)
	}
	waitFor(t, "all records at the collector", 20*time.Second, func() bool { return col.sink.LogRecordCount() >= 60 })
	got := received(t, col.sink)
	for _, r := range recs {
		if lr, ok := got[int64(r.Seq)]; !ok {
			t.Errorf("seq %d lost", r.Seq)
		} else {
			checkRecord(t, lr, r, start, time.Now())
		}
	}
	if st := settledStats(t, e); st.RecordsSent != 60 || st.BatchesSent != 12 || st.Retries != 0 {
		t.Errorf("stats %+v", st)
	}
}
