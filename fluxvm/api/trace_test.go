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

// tracedEnv is a test env whose requests are traced into a recorder.
func tracedEnv(t *testing.T) (*testEnv, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	return newEnv(t, func(o *api.Options) { o.TracerProvider = tp }), rec
}

// onlySpan is the one span the recorder ended.
func onlySpan(t *testing.T, rec *tracetest.SpanRecorder) sdktrace.ReadOnlySpan {
	t.Helper()
	spans := rec.Ended()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want 1", len(spans))
	}
	return spans[0]
}

// TestRequestSpanQuery: a request with a query has url.query (the HTTP
// conventions make it required then), as sent, with the values of the
// signed-URL parameters the URL conventions name redacted; a request
// without one has no url.query.
func TestRequestSpanQuery(t *testing.T) {
	for _, c := range []struct{ path, want string }{
		{"/v1/network/services/flows?limit=256", "limit=256"},
		{"/v1/network/services/flows?limit=2&verdict=dropped", "limit=2&verdict=dropped"},
		{"/v1/network/services/flows?limit=2&sig=s3cret&Signature=x%3D", "limit=2&sig=REDACTED&Signature=REDACTED"},
		{"/v1/network/services/flows", ""},
	} {
		e, rec := tracedEnv(t)
		if w := e.do(req{method: "GET", path: c.path, token: readToken}); w.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", c.path, w.Code, w.Body)
		}
		a := spanAttrs(onlySpan(t, rec))
		q, ok := a["url.query"]
		if ok != (c.want != "") || q.AsString() != c.want {
			t.Errorf("%s: url.query %q (present %v), want %q", c.path, q.AsString(), ok, c.want)
		}
		if a["url.path"].AsString() != "/v1/network/services/flows" {
			t.Errorf("%s: url.path %q", c.path, a["url.path"].AsString())
		}
	}
}

// TestRequestSpanHead: http.ServeMux serves a HEAD request with the GET
// route; its span is named after the request's method, HEAD, like its
// http.request.method, with the route's path.
func TestRequestSpanHead(t *testing.T) {
	e, rec := tracedEnv(t)
	if w := e.do(req{method: "HEAD", path: "/v1/network/services/status", token: readToken}); w.Code != http.StatusOK {
		t.Fatalf("head: %d %s", w.Code, w.Body)
	}
	s := onlySpan(t, rec)
	a := spanAttrs(s)
	if s.Name() != "HEAD /v1/network/services/status" || a["http.request.method"].AsString() != "HEAD" ||
		a["http.route"].AsString() != "/v1/network/services/status" {
		t.Errorf("span %q, attributes %v", s.Name(), s.Attributes())
	}
}

// TestRequestSpanAbort: a handler that aborts with http.ErrAbortHandler
// still panics out of ServeHTTP (net/http drops the connection, as
// before), and its span is an error: error.type "aborted", status Error,
// and no http.response.status_code, as no answer was sent.
func TestRequestSpanAbort(t *testing.T) {
	e, rec := tracedEnv(t)
	e.dp.statusAbort = true
	func() {
		defer func() {
			if v := recover(); v != http.ErrAbortHandler {
				t.Errorf("ServeHTTP recovered %v, want http.ErrAbortHandler re-panicked", v)
			}
		}()
		e.do(req{method: "GET", path: "/v1/network/services/status", token: readToken})
	}()
	s := onlySpan(t, rec)
	a := spanAttrs(s)
	if s.Name() != "GET /v1/network/services/status" || a["error.type"].AsString() != "aborted" || s.Status().Code != codes.Error {
		t.Errorf("span %q: status %v, attributes %v", s.Name(), s.Status(), s.Attributes())
	}
	if _, ok := a["http.response.status_code"]; ok {
		t.Errorf("an aborted request with a status code: %v", s.Attributes())
	}
}

// TestRequestSpanUnauthenticated: the traceparent of a request that fails
// authentication (no token, a wrong one) is not followed: its span is a
// root of a trace of its own. The same header with a valid token is.
func TestRequestSpanUnauthenticated(t *testing.T) {
	const parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	for _, c := range []struct {
		token  string
		status int
		follow bool
	}{
		{"", http.StatusUnauthorized, false},
		{"not-a-token", http.StatusUnauthorized, false},
		{readToken, http.StatusOK, true},
	} {
		e, rec := tracedEnv(t)
		if w := e.do(req{method: "GET", path: "/v1/network/services/status", token: c.token, header: http.Header{"Traceparent": {parent}}}); w.Code != c.status {
			t.Fatalf("token %q: %d %s", c.token, w.Code, w.Body)
		}
		s := onlySpan(t, rec)
		followed := s.Parent().IsValid() || s.SpanContext().TraceID().String() == "0af7651916cd43dd8448eb211c80319c"
		if followed != c.follow {
			t.Errorf("token %q: parent %v, trace %v; want traceparent followed %v", c.token, s.Parent(), s.SpanContext().TraceID(), c.follow)
		}
		if a := spanAttrs(s); a["http.response.status_code"].AsInt64() != int64(c.status) {
			t.Errorf("token %q: attributes %v", c.token, s.Attributes())
		}
	}
}
