package main

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

func TestOTLPConfig(t *testing.T) {
	const table = "[sandbox.dataplane.service]\n"
	c, err := parseConfig([]byte(table + `otlp_endpoint = "http://127.0.0.1:4318"
otlp_encoding = "protobuf"
otlp_interval = "2s"
otlp_timeout = "3s"
otlp_queue = 100
otlp_max_batch = 10
otlp_headers = { Authorization = "Bearer x" }
otlp_service_name = "edge"
node_name = "node-a"
`))
	if err != nil {
		t.Fatal(err)
	}
	got := c.OTLPConfig.exporterConfig(c.NodeName)
	if got.Endpoint != "http://127.0.0.1:4318" || got.Encoding != otlp.EncodingProtobuf || got.Interval != 2*time.Second ||
		got.Timeout != 3*time.Second || got.QueueSize != 100 || got.MaxBatch != 10 || got.Headers["Authorization"] != "Bearer x" ||
		got.ServiceName != "edge" || got.NodeName != "node-a" {
		t.Errorf("exporter config %+v", got)
	}
	if err := got.Validate(); err != nil {
		t.Error(err)
	}
	k := func(s string) string { return fluxvm.ConfigTable + "." + s }
	for _, c := range []struct{ doc, field string }{
		{`otlp_encoding = "xml"`, k("otlp_encoding")},
		{`otlp_interval = "10ms"`, k("otlp_interval")},
		{`otlp_interval = "2h"`, k("otlp_interval")},
		{`otlp_timeout = "1ms"`, k("otlp_timeout")},
		{`otlp_queue = -1`, k("otlp_queue")},
		{`otlp_queue = 2000000`, k("otlp_queue")},
		{"otlp_queue = 10\notlp_max_batch = 11", k("otlp_max_batch")},
		{`otlp_endpoint = "127.0.0.1:4318"`, k("otlp_endpoint")},
		{`otlp_endpoint = "http://127.0.0.1:4318/v1/logs"`, k("otlp_endpoint")},
		{"otlp_endpoint = \"http://127.0.0.1:4318\"\notlp_headers = { \"a b\" = \"c\" }", k("otlp_headers")},
	} {
		_, err := parseConfig([]byte(table + c.doc + "\n"))
		var ve *fluxvm.ValidationError
		if !errors.As(err, &ve) || ve.Field != c.field || !errors.Is(err, fluxvm.ErrInvalid) {
			t.Errorf("%q: %v, want an invalid %s", c.doc, err, c.field)
		} else {
			t.Logf("%q: %v", c.doc, err)
		}
	}
	// Without an endpoint the other keys are checked, and export is off.
	c, err = parseConfig([]byte(table + "otlp_interval = \"5s\"\notlp_queue = 100\n"))
	if err != nil || c.Endpoint != "" {
		t.Errorf("keys without an endpoint: %+v %v", c.OTLPConfig, err)
	}
}

// records is a flowSource of a fixed list, newest first.
type records struct {
	mu   sync.Mutex
	list []flows.Record
}

func (r *records) read(limit int, _ flows.Filter) ([]flows.Record, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.list[:min(limit, len(r.list))], nil
}

func (r *records) set(list ...flows.Record) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.list = list
}

// TestPeriodicExport: each round enqueues the records opened after the
// start that are settled (idle an interval, or open settleMax intervals),
// each once, oldest first; the queue and the receiver get each record
// exactly once; a ring that starts again is followed.
func TestPeriodicExport(t *testing.T) {
	var mu sync.Mutex
	var bodies int
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		bodies++
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte("{}"))
	}))
	defer srv.Close()
	const every = time.Minute
	x, err := otlp.New(otlp.Config{Endpoint: srv.URL, NodeName: "n", Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	rec := func(seq uint64, first, last time.Duration) flows.Record {
		return flows.Record{Seq: seq, Service: "web", Verdict: flows.Forwarded, FirstSeen: now.Add(-first), LastSeen: now.Add(-last)}
	}
	src := &records{}
	src.set(rec(5, 10*every, 10*every)) // before the start
	p := newPeriodicExport(src.read, x, slog.New(slog.DiscardHandler))
	p.interval, p.now = every, func() time.Time { return now }
	if p.start != 5 {
		t.Fatalf("start %d, want 5", p.start)
	}
	round := func(want int) {
		t.Helper()
		if a, d := p.round(false); a != want || d != 0 {
			t.Errorf("round: %d accepted, %d dropped; want %d", a, d, want)
		}
	}
	round(0)
	src.set(rec(7, 3*every, 2*every), rec(6, time.Second, 0), rec(5, 10*every, 10*every))
	round(1) // 7 is idle; 6 active; 5 was there at the start
	round(0) // nothing new
	now = now.Add(every)
	round(1) // 6 idle now
	src.set(rec(9, 0, 0), rec(8, settleMax*every, 0), rec(7, 4*every, 3*every), rec(6, every, every))
	round(1) // 8 open for settleMax intervals; 9 just opened
	round(0)
	// The ring started again (a tier change recreated it).
	src.set(rec(1, 2*every, 2*every))
	round(1)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := x.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if st := x.Stats(); st.RecordsSent != 4 || st.DroppedQueueFull != 0 || st.BatchesFailed != 0 {
		t.Errorf("exporter stats %+v, want the 4 records sent once", st)
	}
	mu.Lock()
	defer mu.Unlock()
	if bodies == 0 {
		t.Error("the receiver got nothing")
	}
}

// TestPeriodicExportQueueFull: a full queue refuses records without
// blocking the round, and they are counted and not tried again.
func TestPeriodicExportQueueFull(t *testing.T) {
	block := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-block
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	defer close(block)
	x, err := otlp.New(otlp.Config{Endpoint: srv.URL, NodeName: "n", Interval: time.Hour, QueueSize: 2, MaxBatch: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		_ = x.Close(ctx)
	}()
	now := time.Now()
	src := &records{}
	p := newPeriodicExport(src.read, x, slog.New(slog.DiscardHandler))
	var list []flows.Record
	for s := uint64(5); s >= 1; s-- {
		list = append(list, flows.Record{Seq: s, FirstSeen: now.Add(-time.Hour), LastSeen: now.Add(-time.Hour)})
	}
	src.set(list...)
	start := time.Now()
	a, d := p.round(false)
	if a+d != 5 || d < 3 || time.Since(start) > time.Second {
		t.Errorf("round: %d accepted, %d dropped in %v; want 5 handed over, at least 3 refused, at once", a, d, time.Since(start))
	}
	if a2, d2 := p.round(false); a2 != 0 || d2 != 0 {
		t.Errorf("second round: %d, %d; want nothing again", a2, d2)
	}
	if st := x.Stats(); st.DroppedQueueFull != uint64(d) {
		t.Errorf("stats %+v", st)
	}
}

// TestStoppableExporter: stop lets an on-demand export in flight run
// until its deadline, then cancels it with errStopCancelled, and refuses
// later exports at once with errStopRefused.
func TestStoppableExporter(t *testing.T) {
	block := make(chan struct{})
	reached := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case reached <- struct{}{}:
		default:
		}
		select {
		case <-block:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(block)
	x, err := otlp.New(otlp.Config{Endpoint: srv.URL, NodeName: "n", Interval: time.Hour, Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close(context.Background())
	s := newStoppableExporter(x)
	errc := make(chan error, 1)
	go func() {
		_, err := s.Export(context.Background(), []flows.Record{{Seq: 1}})
		errc <- err
	}()
	<-reached
	const grace = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	start := time.Now()
	s.stop(ctx)
	if took := time.Since(start); took < grace || took > grace+2*time.Second {
		t.Errorf("stop took %v, want about %v", took, grace)
	}
	// The export in flight was cancelled, the later one refused: two
	// errors saying which, both api.ErrExportStopping (the route answers
	// them 503 as the daemon stopping, not as the receiver failing).
	if err := <-errc; !errors.Is(err, errStopCancelled) || !errors.Is(err, api.ErrExportStopping) || errors.Is(err, errStopRefused) {
		t.Errorf("the export in flight: %v, want errStopCancelled", err)
	}
	_, err = s.Export(context.Background(), []flows.Record{{Seq: 2}})
	if !errors.Is(err, errStopRefused) || !errors.Is(err, api.ErrExportStopping) || errors.Is(err, errStopCancelled) {
		t.Errorf("an export after stop: %v, want errStopRefused", err)
	}
	if err != nil && strings.Contains(err.Error(), "cancelled") {
		t.Errorf("an export refused at once says it was cancelled: %v", err)
	}
	if _, ok := any(s).(interface{ Stats() otlp.Stats }); !ok {
		t.Error("the API's exporter lost Stats: /metrics would lose fluxvm_otlp_*")
	}
}

// failingRecords is a flowSource that fails while fail is set.
type failingRecords struct {
	records
	fail bool
}

func (r *failingRecords) read(limit int, f flows.Filter) ([]flows.Record, error) {
	r.mu.Lock()
	fail := r.fail
	r.mu.Unlock()
	if fail {
		return nil, errors.New("ring unreadable")
	}
	return r.records.read(limit, f)
}

func (r *failingRecords) setFail(v bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail = v
}

// TestPeriodicExportReadFailure (review item 10): a failed read changes
// nothing. When the read at start fails, the first round that reads
// leaves out the records of an earlier process (first seen before the
// start) rather than sending the whole ring; a round whose read fails
// keeps the cursor, and the next sends what is new exactly once.
func TestPeriodicExportReadFailure(t *testing.T) {
	x, err := otlp.New(otlp.Config{Endpoint: "http://127.0.0.1:9", NodeName: "n", Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
		defer cancel()
		_ = x.Close(ctx)
	}()
	const every = time.Minute
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	started := now.Add(-10 * every)
	rec := func(seq uint64, first, last time.Duration) flows.Record {
		return flows.Record{Seq: seq, Service: "web", FirstSeen: now.Add(-first), LastSeen: now.Add(-last)}
	}
	src := &failingRecords{}
	src.set(rec(5, time.Hour, time.Hour)) // an earlier process's
	src.setFail(true)
	p := newPeriodicExport(src.read, x, slog.New(slog.DiscardHandler))
	p.interval, p.now, p.started = every, func() time.Time { return now }, started
	round := func(want int) {
		t.Helper()
		if a, d := p.round(false); a != want || d != 0 {
			t.Errorf("round: %d accepted, %d dropped; want %d", a, d, want)
		}
	}
	round(0) // still failing
	src.setFail(false)
	src.set(rec(6, 5*every, 3*every), rec(5, time.Hour, time.Hour))
	round(1) // 6 only: 5 was first seen before the start
	src.setFail(true)
	src.set(rec(7, 4*every, 2*every), rec(6, 5*every, 3*every), rec(5, time.Hour, time.Hour))
	round(0)
	round(0)
	src.setFail(false)
	round(1) // 7 only: the cursor was kept
	round(0)
	if st := x.Stats(); st.Queued != 2 || st.DroppedQueueFull != 0 {
		t.Errorf("exporter stats %+v, want 2 records queued", st)
	}
}

// TestFlowExportFinalRound (review item 10): at stop a final round
// enqueues what settled since the last round and what is still open, and
// the flush sends it: nothing opened since the start is lost, nothing is
// sent twice.
func TestFlowExportFinalRound(t *testing.T) {
	var mu sync.Mutex
	var bodies int
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		bodies++
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte("{}"))
	}))
	defer srv.Close()
	now := time.Now()
	rec := func(seq uint64, first, last time.Duration) flows.Record {
		return flows.Record{Seq: seq, Service: "web", FirstSeen: now.Add(-first), LastSeen: now.Add(-last)}
	}
	src := &records{}
	fx, err := startFlowExport(otlp.Config{Endpoint: srv.URL, NodeName: "n", Interval: time.Hour}, src.read, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	src.set(rec(1, 3*time.Hour, 2*time.Hour))
	if a, _ := fx.periodic.round(false); a != 1 {
		t.Fatalf("round: %d accepted, want 1", a)
	}
	// 2 settled since that round, 3 is still open.
	src.set(rec(3, time.Second, 0), rec(2, 3*time.Hour, 2*time.Hour), rec(1, 3*time.Hour, 2*time.Hour))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	fx.stop(ctx)
	if st := fx.x.Stats(); st.RecordsSent != 3 || st.DroppedFailed != 0 || st.DroppedQueueFull != 0 {
		t.Errorf("exporter stats %+v, want the 3 records sent once", st)
	}
	mu.Lock()
	defer mu.Unlock()
	if bodies == 0 {
		t.Error("the receiver got nothing")
	}
}

// gatedRecords is a flowSource whose reads wait while gate is open (a
// ring read that hangs), once armed.
type gatedRecords struct {
	records
	armed atomic.Bool
	gate  chan struct{}
}

func (r *gatedRecords) read(limit int, f flows.Filter) ([]flows.Record, error) {
	if r.armed.Load() {
		<-r.gate
	}
	return r.records.read(limit, f)
}

// TestFlowExportLateFinalRound: a final round whose read of the ring
// outlives the stop's flush deadline hands nothing to the exporter after
// its Close (nothing counted as queue_full); the records it would have
// sent are counted as unsent at stop, dropped for reason "failed", in
// the Stats /metrics reads (the API's exporter), as docs/operations.md
// says.
func TestFlowExportLateFinalRound(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte("{}"))
	}))
	defer srv.Close()
	now := time.Now()
	src := &gatedRecords{gate: make(chan struct{})}
	fx, err := startFlowExport(otlp.Config{Endpoint: srv.URL, NodeName: "n", Interval: time.Hour}, src.read, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	src.set(flows.Record{Seq: 2, FirstSeen: now, LastSeen: now}, flows.Record{Seq: 1, FirstSeen: now, LastSeen: now})
	src.armed.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	fx.stop(ctx)
	close(src.gate) // the hung read returns, after Close
	deadline := time.Now().Add(5 * time.Second)
	for fx.api.Stats().DroppedFailed != 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	st, xst := fx.api.Stats(), fx.x.Stats()
	if st.DroppedFailed != 2 || st.DroppedQueueFull != 0 || xst.DroppedQueueFull != 0 || st.Queued != 0 || st.RecordsSent != 0 {
		t.Errorf("stats %+v (exporter %+v); want the 2 records of the late round dropped as failed, none as queue_full", st, xst)
	}
	if a, d := fx.periodic.round(true); a != 0 || d != 0 || fx.x.Stats().DroppedQueueFull != 0 {
		t.Errorf("a round after the stop handed over %d, %d", a, d)
	}
}
