package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
)

// FlowExporter sends flow records to a telemetry receiver now, as POST
// /v1/network/services/telemetry/export asks. *otlp.Exporter implements
// it. An Export error answers 503 unavailable: one that is
// ErrExportStopping (or otlp.ErrClosed) says its owner is stopping, and
// the answer carries its message as is; any other is the receiver's
// failure ("the OTLP receiver did not take the records: ...").
type FlowExporter interface {
	Export(ctx context.Context, recs []flows.Record) (otlp.Report, error)
}

// ErrExportStopping is what a FlowExporter's Export error is (errors.Is)
// when the export was not done because the exporter's owner is stopping:
// refused at once, or cancelled at the stop's deadline. The daemon's
// errors say which; the route answers them 503 without blaming the
// receiver.
var ErrExportStopping = errors.New("the exporter is stopping")

// DefaultMaxBodyBytes bounds request bodies when Options.MaxBodyBytes is 0.
const DefaultMaxBodyBytes int64 = 1 << 20

// DefaultBodyTimeout bounds the reading of a request body when
// Options.BodyTimeout is 0.
const DefaultBodyTimeout = 30 * time.Second

// refusedBodyGrace is how long the connection of a request answered
// before its announced body was read (401, 403, 404, 413, 415, ...) stays
// open for the rest of that body, so that a client that is sending it
// reads the answer rather than a reset; a client that never sends it
// loses the connection after this (or the body deadline, when sooner).
const refusedBodyGrace = 500 * time.Millisecond

// Options configure the handler made by [New].
type Options struct {
	// AdminTokens may call every route, mutations included.
	AdminTokens []string
	// ReadTokens may call the GET routes (and /metrics) only.
	ReadTokens []string
	// MaxBodyBytes bounds a request body; larger bodies get 413.
	// 0 means DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// MaxSnapshotBytes bounds the snapshot stream of POST
	// /v1/network/services/{name}/conntrack/import (read as it arrives,
	// never held whole); larger gets 413, after the chunks before the
	// bound were applied when the body announced no Content-Length.
	// 0 means DefaultMaxSnapshotBytes (256 MiB).
	MaxSnapshotBytes int64
	// MaxDeltaBytes bounds the JSON body of POST
	// /v1/network/services/{name}/conntrack/delta/import (a delta is
	// decoded whole); larger gets 413. 0 means DefaultMaxDeltaBytes
	// (64 MiB).
	MaxDeltaBytes int64
	// BodyTimeout bounds the time an authenticated request may take to
	// deliver its body, counted from the moment the handler receives the
	// request (its headers read). A body that has not arrived by then
	// fails with 408 and the connection is closed. 0 means
	// DefaultBodyTimeout. The deadline is set with
	// http.ResponseController.SetReadDeadline, which net/http's server
	// supports (HTTP/1 and HTTP/2); it is ignored where the
	// ResponseWriter does not support it.
	//
	// Whatever the timeout, a request answered before its body was read
	// (no or an unknown token, a read token on a mutation, an unknown
	// route, a body too large or of another media type) is answered at
	// once, without waiting for the body, and its HTTP/1 connection is
	// closed (after at most half a second for the rest of the body), so
	// a client that never sends the body it announced cannot hold it.
	BodyTimeout time.Duration
	// Logger receives one record per request (method, path, status,
	// duration; never a token) and the detail of internal errors.
	// nil discards them.
	Logger *slog.Logger
	// Exporter, when set, is what POST
	// /v1/network/services/telemetry/export sends the newest flow
	// records through (the daemon's otlp.Exporter when otlp_endpoint is
	// configured). nil: the route answers 422 missing_prerequisite
	// "otlp_endpoint not configured". The handler never closes it. When
	// it also implements OTLPStatsSource (*otlp.Exporter does), its
	// counters are in /metrics (NewOTLPCollector).
	Exporter FlowExporter
	// Registry, when set, receives the dataplane collector and is what
	// /metrics serves, so an embedder can add its own collectors (Go
	// runtime, process) to the same page. nil uses a private registry
	// holding only the dataplane collector.
	Registry *prometheus.Registry
	// TracerProvider, when set, receives a server span of every request,
	// named after its route (the request's method and the pattern's path:
	// "GET /v1/network/services/{name}", "HEAD ..." for a HEAD request;
	// the method alone for a request no route serves), with the
	// attributes of OpenTelemetry's HTTP conventions (http.request.method,
	// http.route, http.response.status_code, url.path, url.query,
	// url.scheme, error.type) and fluxvm.api.error_code for an error
	// answer; a 5xx, a panic after the answer started or an
	// http.ErrAbortHandler abort sets the span's status to Error. A
	// traceparent header makes it a child of the client's span only when
	// the request authenticated (see the package doc's Tracing section).
	// The dataplane's spans of the request (an apply, a GC round) are its
	// children when the dataplane has a provider too
	// (fluxvm.Options.TracerProvider). nil: no spans.
	TracerProvider trace.TracerProvider
	// IPCacheSource, when set, is read by POST
	// /v1/network/services/policies/reconcile, and what it returns is
	// applied (PolicyStore.SetIPCache) before every policy is recompiled;
	// the reference daemon reads its ipcache_file. An error of the
	// source (or an ipcache that intent.ValidateIPCache refuses) answers
	// 422 missing_prerequisite with its message, and nothing changes.
	// nil: the route recompiles and rewrites the current ipcache and
	// policies.
	IPCacheSource IPCacheSource
}

// New returns the REST handler for the dataplane's roles (RolesOf(d) for
// a *fluxvm.Dataplane d). It fails when a role is nil, when no token is
// configured, when a token is empty, malformed or configured both
// as admin and read token, when MaxBodyBytes, MaxSnapshotBytes,
// MaxDeltaBytes or BodyTimeout is negative,
// or when the
// collector cannot be registered in opts.Registry (for example because it
// already holds one).
func New(roles Roles, opts Options) (http.Handler, error) {
	if err := roles.check(); err != nil {
		return nil, fmt.Errorf("api: %w", err)
	}
	auth, err := newAuthenticator(opts.AdminTokens, opts.ReadTokens)
	if err != nil {
		return nil, fmt.Errorf("api: %w", err)
	}
	maxBody := opts.MaxBodyBytes
	switch {
	case maxBody < 0:
		return nil, fmt.Errorf("api: negative MaxBodyBytes %d", maxBody)
	case maxBody == 0:
		maxBody = DefaultMaxBodyBytes
	}
	maxSnapshot, maxDelta := opts.MaxSnapshotBytes, opts.MaxDeltaBytes
	switch {
	case maxSnapshot < 0:
		return nil, fmt.Errorf("api: negative MaxSnapshotBytes %d", maxSnapshot)
	case maxSnapshot == 0:
		maxSnapshot = DefaultMaxSnapshotBytes
	}
	switch {
	case maxDelta < 0:
		return nil, fmt.Errorf("api: negative MaxDeltaBytes %d", maxDelta)
	case maxDelta == 0:
		maxDelta = DefaultMaxDeltaBytes
	}
	bodyTimeout := opts.BodyTimeout
	switch {
	case bodyTimeout < 0:
		return nil, fmt.Errorf("api: negative BodyTimeout %v", bodyTimeout)
	case bodyTimeout == 0:
		bodyTimeout = DefaultBodyTimeout
	}
	logger := opts.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	reg := opts.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	if err := reg.Register(NewCollector(roles.Observer)); err != nil {
		return nil, fmt.Errorf("api: register metrics collector: %w", err)
	}
	if src, ok := opts.Exporter.(OTLPStatsSource); ok {
		if err := reg.Register(NewOTLPCollector(src)); err != nil {
			return nil, fmt.Errorf("api: register OTLP metrics collector: %w", err)
		}
	}

	h := &handler{
		roles:       roles,
		auth:        auth,
		maxBody:     maxBody,
		maxSnapshot: maxSnapshot,
		maxDelta:    maxDelta,
		bodyTimeout: bodyTimeout,
		log:         logger,
		mux:         http.NewServeMux(),
		exporter:    opts.Exporter,
		ipcache:     opts.IPCacheSource,
		tracer:      newRequestTracer(opts.TracerProvider),
	}
	h.metrics = newMetricsHandler(reg, logger)
	for _, rt := range routes {
		h.mux.Handle(rt.pattern(), h.endpoint(rt))
	}
	return h, nil
}

// handler is the http.Handler returned by New.
type handler struct {
	roles       Roles
	auth        *authenticator
	maxBody     int64
	maxSnapshot int64
	maxDelta    int64
	bodyTimeout time.Duration
	log         *slog.Logger
	mux         *http.ServeMux
	metrics     http.Handler
	exporter    FlowExporter
	ipcache     IPCacheSource
	tracer      requestTracer
}

// ServeHTTP authenticates the request, routes it and logs the outcome.
// Authentication looks at the headers only: nothing of the body is read
// before the caller is known, and a refused request is answered without
// waiting for its body (see Options.BodyTimeout).
func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	rw := &responseWriter{ResponseWriter: w, rc: http.NewResponseController(w), http1: r.ProtoMajor == 1}
	if hasBody(r) {
		// Read through the copy of the request made below: the server
		// must keep seeing its own body type in r (it decides from it how
		// to close a connection whose body was not read).
		rw.body = &trackedBody{ReadCloser: r.Body}
	}
	hdr := w.Header()
	hdr.Set("Content-Type", "application/json")
	hdr.Set("Cache-Control", "no-store")
	hdr.Set("X-Content-Type-Options", "nosniff")

	// Authentication reads the Authorization header only, so it runs
	// first: the span follows the client's traceparent only when the
	// token is valid (a refused request gets a root span of its own). The
	// span still starts when the request arrived.
	lvl := h.auth.authenticate(r.Header.Get("Authorization"))
	r, span := h.tracer.start(r, lvl != levelNone, start)
	var panicked any
	defer func() {
		status := rw.status
		if status == 0 && panicked == nil {
			status = http.StatusOK
		}
		endRequestSpan(span, status, panicked)
	}()
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				// net/http drops the connection, as without us; the
				// span records the abort.
				panicked = v
				panic(v)
			}
			h.log.Error("api: panic serving request", "method", r.Method, "path", r.URL.Path, "panic", v)
			if !rw.wroteHeader {
				rw.routed = true
				h.writeError(rw, r, newAPIError(CodeInternal, internalMessage))
			} else {
				// The answer was under way: it ends as it is, and only
				// the span and the log tell it was cut short.
				panicked = v
			}
		}
		h.logRequest(r, rw, start)
	}()

	if lvl == levelNone {
		rw.routed = true
		h.writeError(rw, r, errUnauthorized(r.Header.Get("Authorization") != ""))
		return
	}
	r = r.WithContext(context.WithValue(r.Context(), levelKey{}, lvl))
	if rw.body != nil {
		rw.setReadDeadline(start.Add(h.bodyTimeout))
		r.Body = rw.body
	}
	h.mux.ServeHTTP(rw, r)
}

// trackedBody is a request body that remembers whether it was read to
// its end.
type trackedBody struct {
	io.ReadCloser
	eof bool
}

func (b *trackedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if errors.Is(err, io.EOF) {
		b.eof = true
	}
	return n, err
}

// logRequest writes the access log record of one request.
func (h *handler) logRequest(r *http.Request, rw *responseWriter, start time.Time) {
	status := rw.status
	if status == 0 {
		status = http.StatusOK
	}
	lvl := slog.LevelInfo
	if status >= http.StatusInternalServerError {
		lvl = slog.LevelError
	}
	h.log.LogAttrs(r.Context(), lvl, "api request",
		slog.String("method", r.Method),
		slog.String("path", r.URL.Path),
		slog.Int("status", status),
		slog.Duration("duration", time.Since(start)),
		slog.Int64("bytes", rw.written),
		slog.String("remote", r.RemoteAddr),
	)
}

// levelKey is the context key of the caller's access level.
type levelKey struct{}

// responseWriter records the status for the log and turns the plain-text
// 404 and 405 answers of http.ServeMux into JSON errors: a write that
// happens before an endpoint of the route table claimed the request comes
// from the mux itself.
type responseWriter struct {
	http.ResponseWriter
	rc          *http.ResponseController
	http1       bool         // the request came over HTTP/1.x
	body        *trackedBody // the request's body; nil when it has none
	deadline    time.Time    // read deadline set on the connection
	status      int
	written     int64
	wroteHeader bool
	routed      bool // an endpoint (or ServeHTTP itself) writes the response
	swallow     bool // drop the body the mux writes after we replaced it
}

func (w *responseWriter) WriteHeader(code int) {
	if w.wroteHeader {
		return
	}
	if !w.routed {
		var e *apiError
		switch code {
		case http.StatusNotFound:
			e = newAPIError(CodeNotFound, "no such route")
		case http.StatusMethodNotAllowed:
			e = newAPIError(CodeMethodNotAllowed, "method not allowed; see the Allow header")
		}
		if e != nil {
			w.routed = true // from here on we write our own body
			w.Header().Del("Content-Length")
			writeErrorBody(w, e)
			w.swallow = true
			return
		}
		// A redirect to the cleaned path: it has no body.
		w.Header().Del("Content-Type")
	}
	w.dropUnreadBody()
	w.wroteHeader = true
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

// dropUnreadBody prepares the answer to a request whose body was not read
// to its end (a refusal, or a body that did not arrive in time). Left
// alone, net/http would read the rest of the body before sending the
// answer, to keep the connection: a client that never sends it would get
// no answer and hold the connection forever. Instead the HTTP/1
// connection closes after the answer, and the server's attempt to drain
// the body gives up after refusedBodyGrace.
func (w *responseWriter) dropUnreadBody() {
	if w.body == nil || w.body.eof {
		return
	}
	if w.http1 {
		w.Header().Set("Connection", "close")
	}
	w.setReadDeadline(time.Now().Add(refusedBodyGrace))
}

// setReadDeadline moves the read deadline of the request's connection
// (or stream) to t if that is sooner than the one already set. Writers
// that cannot (httptest.ResponseRecorder) are left as they are.
func (w *responseWriter) setReadDeadline(t time.Time) {
	if !w.deadline.IsZero() && !t.Before(w.deadline) {
		return
	}
	if err := w.rc.SetReadDeadline(t); err == nil {
		w.deadline = t
	}
}

func (w *responseWriter) Write(b []byte) (int, error) {
	if w.swallow {
		return len(b), nil
	}
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
		if w.swallow {
			return len(b), nil
		}
	}
	n, err := w.ResponseWriter.Write(b)
	w.written += int64(n)
	return n, err
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (w *responseWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
