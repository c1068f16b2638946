package api

import (
	"net/http"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// TracerName is the instrumentation scope of the REST API's spans.
const TracerName = "github.com/fluxvm/servicefabric/fluxvm/api"

// AttrErrorCode is the span attribute of an error answer's code
// (ErrorDetail.Code: not_found, invalid_request, ...).
const AttrErrorCode = attribute.Key("fluxvm.api.error_code")

// requestTracer starts the server span of every request (Options.TracerProvider).
type requestTracer struct {
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
}

func newRequestTracer(tp trace.TracerProvider) requestTracer {
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	return requestTracer{tracer: tp.Tracer(TracerName), propagator: propagation.TraceContext{}}
}

// start begins the span of r, a child of the W3C trace context the
// client sent (traceparent), if any. Its name is the method alone until
// the route is known (routed).
func (t requestTracer) start(r *http.Request) (*http.Request, trace.Span) {
	ctx := t.propagator.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
	method, original := spanMethod(r.Method)
	attrs := []attribute.KeyValue{semconv.HTTPRequestMethodKey.String(method), semconv.URLPath(r.URL.Path)}
	if original != "" {
		attrs = append(attrs, semconv.HTTPRequestMethodOriginal(original))
	}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	attrs = append(attrs, semconv.URLScheme(scheme))
	name := method
	if original != "" {
		name = "HTTP"
	}
	ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(attrs...))
	return r.WithContext(ctx), span
}

// routed names the span of r after the route that serves it: method and
// route pattern (GET /v1/network/services/{name}), never the path with
// its ids, as OpenTelemetry's HTTP conventions say.
func routed(r *http.Request, rt route) {
	span := trace.SpanFromContext(r.Context())
	span.SetName(rt.method + " " + rt.path)
	span.SetAttributes(semconv.HTTPRoute(rt.path))
}

// end records the answer's status and ends the span. A 5xx is an error
// of the server (its status is Error, error.type the status code); a 4xx
// is the client's and leaves the span's status unset, as the HTTP
// conventions say for server spans.
func endRequestSpan(span trace.Span, status int) {
	span.SetAttributes(semconv.HTTPResponseStatusCode(status))
	if status >= http.StatusInternalServerError {
		span.SetAttributes(semconv.ErrorTypeKey.String(strconv.Itoa(status)))
		span.SetStatus(codes.Error, http.StatusText(status))
	}
	span.End()
}

// errorSpan records an error answer on the request's span: its code, and
// for a 5xx the public message as the span's status (an internal error's
// cause is logged only, as it is never sent).
func errorSpan(r *http.Request, e *apiError) {
	span := trace.SpanFromContext(r.Context())
	span.SetAttributes(AttrErrorCode.String(string(e.code)))
	if e.status >= http.StatusInternalServerError {
		span.SetStatus(codes.Error, string(e.code)+": "+e.message)
	}
}

// spanMethod is http.request.method: the method when it is one HTTP
// defines, else "_OTHER" and the original.
func spanMethod(m string) (method, original string) {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodConnect, http.MethodOptions, http.MethodTrace:
		return m, ""
	}
	return "_OTHER", m
}
