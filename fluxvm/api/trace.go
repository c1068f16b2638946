package api

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

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

// start begins the span of r at begin (when the request arrived). It is
// a child of the W3C trace context the client sent (traceparent) only
// when follow is set, that is when the request authenticated: a caller
// without a valid token cannot place its request in a trace of its
// choosing, and gets a root span. Its name is the method alone until the
// route is known (routed).
func (t requestTracer) start(r *http.Request, follow bool, begin time.Time) (*http.Request, trace.Span) {
	ctx := r.Context()
	if follow {
		ctx = t.propagator.Extract(ctx, propagation.HeaderCarrier(r.Header))
	}
	method, original := spanMethod(r.Method)
	attrs := []attribute.KeyValue{semconv.HTTPRequestMethodKey.String(method), semconv.URLPath(r.URL.Path)}
	if original != "" {
		attrs = append(attrs, semconv.HTTPRequestMethodOriginal(original))
	}
	if r.URL.RawQuery != "" {
		attrs = append(attrs, semconv.URLQuery(redactQuery(r.URL.RawQuery)))
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
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(attrs...), trace.WithTimestamp(begin)}
	if !follow {
		opts = append(opts, trace.WithNewRoot())
	}
	ctx, span := t.tracer.Start(ctx, name, opts...)
	return r.WithContext(ctx), span
}

// redactedQueryKeys are the query parameters whose values OpenTelemetry's
// URL conventions say to redact by default (signed-URL credentials). The
// REST API has no such parameter, and its token travels in the
// Authorization header, never in the query; a client that sends one
// anyway does not get it recorded.
var redactedQueryKeys = map[string]bool{"AWSAccessKeyId": true, "Signature": true, "sig": true, "X-Goog-Signature": true}

// redactQuery is url.query: the raw query as the client sent it, with
// the values of redactedQueryKeys replaced by REDACTED.
func redactQuery(raw string) string {
	parts := strings.Split(raw, "&")
	changed := false
	for i, p := range parts {
		k, _, hasValue := strings.Cut(p, "=")
		if !hasValue {
			continue
		}
		if uk, err := url.QueryUnescape(k); err == nil {
			k = uk
		}
		if redactedQueryKeys[k] {
			parts[i] = p[:strings.IndexByte(p, '=')+1] + "REDACTED"
			changed = true
		}
	}
	if !changed {
		return raw
	}
	return strings.Join(parts, "&")
}

// routed names the span of r after the route that serves it: the
// request's method and the route pattern's path
// (GET /v1/network/services/{name}), never the path with its ids, as
// OpenTelemetry's HTTP conventions say. The method is the request's, not
// the pattern's: http.ServeMux serves a HEAD request with a GET route,
// and its span is "HEAD /v1/...", like its http.request.method.
func routed(r *http.Request, rt route) {
	span := trace.SpanFromContext(r.Context())
	method, _ := spanMethod(r.Method)
	span.SetName(method + " " + rt.path)
	span.SetAttributes(semconv.HTTPRoute(rt.path))
}

// endRequestSpan records the answer's status and ends the span. A 5xx is
// an error of the server (its status is Error, error.type the status
// code); a 4xx is the client's and leaves the span's status unset, as the
// HTTP conventions say for server spans. status 0 means no answer was
// started: a handler that panicked (panicked non-nil) before writing.
//
// A panic is an error whatever was sent: error.type is "aborted" for
// http.ErrAbortHandler (the handler cut the answer off on purpose; net/http
// drops the connection), else the panic value's type when it is an error,
// else "panic". When the panic was answered with a 500 (nothing had been
// written yet), error.type stays "500".
func endRequestSpan(span trace.Span, status int, panicked any) {
	if status != 0 {
		span.SetAttributes(semconv.HTTPResponseStatusCode(status))
	}
	switch {
	case status >= http.StatusInternalServerError:
		span.SetAttributes(semconv.ErrorTypeKey.String(strconv.Itoa(status)))
		span.SetStatus(codes.Error, http.StatusText(status))
	case panicked != nil:
		span.SetAttributes(semconv.ErrorTypeKey.String(panicType(panicked)))
		if panicked == http.ErrAbortHandler {
			span.SetStatus(codes.Error, "handler aborted")
		} else {
			span.SetStatus(codes.Error, "handler panicked")
		}
	}
	span.End()
}

// panicType is the error.type of a panic value.
func panicType(v any) string {
	if err, ok := v.(error); ok {
		if errors.Is(err, http.ErrAbortHandler) {
			return "aborted"
		}
		return fmt.Sprintf("%T", err)
	}
	return "panic"
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
