package fluxvm

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"path/filepath"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// recordedSpans are the ended spans of a recorder by name.
func recordedSpans(rec *tracetest.SpanRecorder, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func attrsOf(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// TestSpans: with Options.TracerProvider, the dataplane's control-plane
// work is traced: an apply (changed or not, refused with an error
// status), a delete, a GC round with what it scanned and collected, the
// catalog's restore at Open; and a span is the child of the caller's.
func TestSpans(t *testing.T) {
	testenv.RequirePrivileged(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	opts := Options{
		Loader:              bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierS},
		CatalogPath:         filepath.Join(t.TempDir(), "catalog.json"),
		ConntrackGCInterval: -1,
		Logger:              slog.New(slog.DiscardHandler),
		TracerProvider:      tp,
	}
	d, err := Open(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { d.Cleanup(context.Background()) }()
	ctx := context.Background()
	svc := Service{
		Name: "web", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
		Ports: []ServicePort{{Port: 80, Protocol: TCP}, {Port: 53, Protocol: UDP}},
		Backends: []Backend{
			{Address: netip.MustParseAddr("10.40.1.21"), Port: 8080},
			{Address: netip.MustParseAddr("10.40.1.22"), Port: 8080},
			{Address: netip.MustParseAddr("10.40.1.23"), Port: 8080},
		},
	}
	parentCtx, parent := tp.Tracer("test").Start(ctx, "request")
	if _, err := d.ApplyService(parentCtx, svc); err != nil {
		t.Fatal(err)
	}
	parent.End()
	if _, err := d.ApplyService(ctx, svc); err != nil { // the same again
		t.Fatal(err)
	}
	bad := svc
	bad.Name = "bad"
	bad.Ports = nil
	if _, err := d.ApplyService(ctx, bad); err == nil {
		t.Fatal("a service without ports applied")
	}
	applies := recordedSpans(rec, SpanApplyService)
	if len(applies) != 3 {
		t.Fatalf("%d apply spans, want 3", len(applies))
	}
	for i, w := range []struct {
		service string
		changed bool
		failed  bool
	}{{"web", true, false}, {"web", false, false}, {"bad", false, true}} {
		s, a := applies[i], attrsOf(applies[i])
		if a[AttrService].AsString() != w.service || a[AttrBackends].AsInt64() != 3 {
			t.Errorf("apply %d: attributes %v", i, s.Attributes())
		}
		if failed := s.Status().Code == codes.Error; failed != w.failed || (w.failed && len(s.Events()) == 0) {
			t.Errorf("apply %d: status %v, events %v; want failed %v with the error recorded", i, s.Status(), s.Events(), w.failed)
		}
		if !w.failed && (a[AttrChanged].AsBool() != w.changed || a[AttrFrontends].AsInt64() != 2 || a[AttrRevision].AsInt64() != 1) {
			t.Errorf("apply %d: attributes %v; want changed %v, 2 frontends, revision 1", i, s.Attributes(), w.changed)
		}
	}
	if applies[0].Parent().SpanID() != parent.SpanContext().SpanID() || applies[0].SpanContext().TraceID() != parent.SpanContext().TraceID() {
		t.Error("the apply span is not the child of the caller's span")
	}

	// Two flows that timed out long ago: GC collects them.
	for i := range 2 {
		k := bpf.Tuple4{Saddr: 0x0a000001 + uint32(i), Daddr: 0x0a60000a, Sport: bpf.Port(40000), Dport: bpf.Port(80), Proto: 6}
		if err := d.dp.Maps().FluxvmFct4.Put(k, bpf.CTValue{ServiceId: 1, BackendId: 1, CreatedNs: 1, LastSeenNs: 1, DeadlineNs: 2}); err != nil {
			t.Fatal(err)
		}
	}
	res, err := d.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	gcs := recordedSpans(rec, SpanGC)
	if len(gcs) != 1 {
		t.Fatalf("%d GC spans, want 1", len(gcs))
	}
	a := attrsOf(gcs[0])
	collected := res.Expired + res.Drained + res.BackendGone + res.Orphans
	if a[AttrGCScanned].AsInt64() != int64(res.Scanned) || res.Scanned < 2 || a[AttrGCCollected].AsInt64() != int64(collected) || collected < 2 ||
		a[AttrGCExpired].AsInt64() != int64(res.Expired) || a[AttrGCBackendGone].AsInt64() != int64(res.BackendGone) {
		t.Errorf("GC span attributes %v; GC result %+v", gcs[0].Attributes(), res)
	}

	if err := d.DeleteService(ctx, "web"); err != nil {
		t.Fatal(err)
	}
	if err := d.DeleteService(ctx, "web"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
	dels := recordedSpans(rec, SpanDeleteService)
	if len(dels) != 2 || dels[0].Status().Code == codes.Error || dels[1].Status().Code != codes.Error {
		t.Errorf("delete spans %v", dels)
	}

	// Open restores the catalog: one service.
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	rec2 := tracetest.NewSpanRecorder()
	opts.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec2))
	d, err = Open(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	restores := recordedSpans(rec2, SpanRestore)
	if len(restores) != 1 || attrsOf(restores[0])[AttrServices].AsInt64() != 1 {
		t.Errorf("restore spans %v", restores)
	}
}

// Without a provider the dataplane works and traces nothing.
func TestSpansOff(t *testing.T) {
	if tr := tracerOf(nil); tr == nil {
		t.Fatal("no tracer")
	}
	_, span := tracerOf(nil).Start(context.Background(), "x")
	if span.SpanContext().IsValid() || span.IsRecording() {
		t.Error("the no-op tracer records")
	}
	span.End()
}
