package api_test

import (
	"errors"
	"net/http"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// spanAttrs is a span's attributes by key.
func spanAttrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// TestRequestSpans: with a tracer provider every request is a server span
// named after its route (method and pattern, never the path with its
// ids), with OpenTelemetry's HTTP attributes; a 5xx sets the span's
// status to Error, a 4xx does not; a traceparent header makes the span
// a child of the client's; the span is in the context the dataplane is
// called with.
func TestRequestSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	e := newEnv(t, func(o *api.Options) { o.TracerProvider = tp })
	e.mustApply("web")
	if w := e.do(req{method: "GET", path: "/v1/network/services/web", token: readToken}); w.Code != http.StatusOK {
		t.Fatalf("get: %d %s", w.Code, w.Body)
	}
	e.do(req{method: "GET", path: "/v1/network/services/nope", token: readToken})
	e.dp.gcErr = errors.New("map exploded")
	e.do(req{method: "POST", path: "/v1/network/services/conntrack/gc", token: adminToken})
	e.do(req{method: "GET", path: "/no/such/route", token: readToken})
	const parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	e.do(req{method: "GET", path: "/v1/network/services/status", token: readToken, header: http.Header{"Traceparent": {parent}}})

	type want struct {
		name, method, route, path string
		status                    int
		errCode                   string
		failed                    bool
	}
	wants := []want{
		{"POST /v1/network/services", "POST", "/v1/network/services", "/v1/network/services", 200, "", false},
		{"GET /v1/network/services/{name}", "GET", "/v1/network/services/{name}", "/v1/network/services/web", 200, "", false},
		{"GET /v1/network/services/{name}", "GET", "/v1/network/services/{name}", "/v1/network/services/nope", 404, "not_found", false},
		{"POST /v1/network/services/conntrack/gc", "POST", "/v1/network/services/conntrack/gc", "/v1/network/services/conntrack/gc", 500, "internal", true},
		{"GET", "GET", "", "/no/such/route", 404, "", false},
		{"GET /v1/network/services/status", "GET", "/v1/network/services/status", "/v1/network/services/status", 200, "", false},
	}
	spans := rec.Ended()
	if len(spans) != len(wants) {
		t.Fatalf("%d spans, want %d", len(spans), len(wants))
	}
	for i, w := range wants {
		s := spans[i]
		a := spanAttrs(s)
		if s.Name() != w.name || s.SpanKind() != trace.SpanKindServer {
			t.Errorf("span %d: %q (%v), want %q, a server span", i, s.Name(), s.SpanKind(), w.name)
		}
		if a["http.request.method"].AsString() != w.method || a["url.path"].AsString() != w.path ||
			a["http.response.status_code"].AsInt64() != int64(w.status) || a["http.route"].AsString() != w.route {
			t.Errorf("span %d (%s): attributes %v", i, w.name, s.Attributes())
		}
		if a[api.AttrErrorCode].AsString() != w.errCode {
			t.Errorf("span %d (%s): error code %q, want %q", i, w.name, a[api.AttrErrorCode].AsString(), w.errCode)
		}
		if failed := s.Status().Code == codes.Error; failed != w.failed {
			t.Errorf("span %d (%s): status %v, want error %v", i, w.name, s.Status(), w.failed)
		}
		if w.failed && a["error.type"].AsString() != "500" {
			t.Errorf("span %d (%s): error.type %q", i, w.name, a["error.type"].AsString())
		}
	}
	last := spans[len(spans)-1]
	if last.Parent().TraceID().String() != "0af7651916cd43dd8448eb211c80319c" || last.Parent().SpanID().String() != "b7ad6b7169203331" ||
		last.SpanContext().TraceID() != last.Parent().TraceID() {
		t.Errorf("traceparent not followed: parent %v, span %v", last.Parent(), last.SpanContext())
	}
	if e.dp.lastCtx == nil || trace.SpanContextFromContext(e.dp.lastCtx).SpanID() != spans[3].SpanContext().SpanID() {
		t.Error("the dataplane was not called within the request's span")
	}
}

// Without a provider nothing is traced, and nothing breaks.
func TestRequestSpansOff(t *testing.T) {
	e := newEnv(t)
	e.mustApply("web")
	if e.dp.lastCtx == nil || trace.SpanContextFromContext(e.dp.lastCtx).IsValid() {
		t.Error("a span without a provider")
	}
}
