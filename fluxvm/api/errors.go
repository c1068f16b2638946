package api

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/policy"
)

// Code is the stable, machine-readable code of an error response. Clients
// branch on it, never on the message.
type Code string

// Error codes and the HTTP status each is sent with.
const (
	CodeInvalidRequest   Code = "invalid_request"    // 400
	CodeUnauthorized     Code = "unauthorized"       // 401
	CodeForbidden        Code = "forbidden"          // 403
	CodeNotFound         Code = "not_found"          // 404
	CodeMethodNotAllowed Code = "method_not_allowed" // 405
	// CodeRequestTimeout: the request's body did not arrive within the
	// body deadline (Options.BodyTimeout); the connection is closed.
	CodeRequestTimeout       Code = "request_timeout"        // 408
	CodeConflict             Code = "conflict"               // 409
	CodePayloadTooLarge      Code = "payload_too_large"      // 413
	CodeUnsupportedMediaType Code = "unsupported_media_type" // 415
	CodeUnsupported          Code = "unsupported"            // 422
	CodeMissingPrerequisite  Code = "missing_prerequisite"   // 422
	CodeLimitExceeded        Code = "limit_exceeded"         // 422
	CodeInternal             Code = "internal"               // 500
	// CodeUnavailable: the request ended (the client went away, or a
	// deadline of the embedder passed) before the node finished the work
	// it asked for (a GC, a health round); nothing is wrong with the node.
	CodeUnavailable Code = "unavailable" // 503

	// The codes of the HA state transfer routes (package ha's errors).

	// CodeResetRequired: the delta cannot continue this edge's cursor
	// (another journal incarnation, or history gone): load a snapshot
	// (ha.ErrResetRequired).
	CodeResetRequired Code = "reset_required" // 409
	// CodeSequenceGap: the delta does not continue the cursor
	// contiguously (ha.ErrGap): pull again from the cursor.
	CodeSequenceGap Code = "sequence_gap" // 409
	// CodeStaleEpoch: data or a lease of an epoch older than the newest
	// this edge accepted (ha.ErrStaleEpoch).
	CodeStaleEpoch Code = "stale_epoch" // 409
	// CodeFenced: this edge's lease was superseded: it serves and exports
	// nothing (ha.ErrFenced).
	CodeFenced Code = "fenced" // 409
	// CodeCursorAhead: a seq past the journal's last sealed batch
	// (ha.ErrCursorAhead).
	CodeCursorAhead Code = "cursor_ahead" // 409
	// CodeSnapshotCorrupt: a snapshot stream that is truncated or fails
	// its checksums (ha.ErrTruncated, ha.ErrCorrupt): send it again.
	CodeSnapshotCorrupt Code = "snapshot_corrupt" // 400
	// CodeSnapshotUnreadable: not a snapshot, or one of a format,
	// datapath schema or map set this node does not read (ha.ErrFormat).
	CodeSnapshotUnreadable Code = "snapshot_unreadable" // 422
	// CodeServiceMismatch: a snapshot or delta of another service than
	// the one of the path (ha.ErrService).
	CodeServiceMismatch Code = "service_mismatch" // 400
	// CodeSeedMismatch: a snapshot written by an edge whose hash_seed or
	// maglev_seed differs from this edge's (ha.ErrSeeds): the two are no
	// group; nothing was applied.
	CodeSeedMismatch Code = "seed_mismatch" // 409
)

// allCodes lists every code, in the order of the documentation.
var allCodes = []Code{
	CodeInvalidRequest, CodeUnauthorized, CodeForbidden, CodeNotFound,
	CodeMethodNotAllowed, CodeRequestTimeout, CodeConflict, CodePayloadTooLarge,
	CodeUnsupportedMediaType, CodeUnsupported, CodeMissingPrerequisite, CodeLimitExceeded,
	CodeInternal, CodeUnavailable,
	CodeResetRequired, CodeSequenceGap, CodeStaleEpoch, CodeFenced, CodeCursorAhead,
	CodeSnapshotCorrupt, CodeSnapshotUnreadable, CodeServiceMismatch, CodeSeedMismatch,
}

// Status returns the HTTP status an error with code c is sent with
// (500 for an unknown code).
func (c Code) Status() int {
	switch c {
	case CodeInvalidRequest, CodeSnapshotCorrupt, CodeServiceMismatch:
		return http.StatusBadRequest
	case CodeUnauthorized:
		return http.StatusUnauthorized
	case CodeForbidden:
		return http.StatusForbidden
	case CodeNotFound:
		return http.StatusNotFound
	case CodeMethodNotAllowed:
		return http.StatusMethodNotAllowed
	case CodeRequestTimeout:
		return http.StatusRequestTimeout
	case CodeConflict, CodeResetRequired, CodeSequenceGap, CodeStaleEpoch, CodeFenced, CodeCursorAhead, CodeSeedMismatch:
		return http.StatusConflict
	case CodePayloadTooLarge:
		return http.StatusRequestEntityTooLarge
	case CodeUnsupportedMediaType:
		return http.StatusUnsupportedMediaType
	case CodeUnsupported, CodeMissingPrerequisite, CodeLimitExceeded, CodeSnapshotUnreadable:
		return http.StatusUnprocessableEntity
	case CodeUnavailable:
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

// ErrorResponse is the body of every error response.
type ErrorResponse struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail describes one error.
type ErrorDetail struct {
	// Code is stable; see the constants.
	Code Code `json:"code"`
	// Message is for humans and may change between versions.
	Message string `json:"message"`
	// Field names the offending request field (for example
	// "backends[1].port") when one is known.
	Field string `json:"field,omitempty"`
}

// internalMessage is all a client learns about an internal error.
const internalMessage = "internal error; see the node's log"

// apiError is an error on its way to the client.
type apiError struct {
	status  int
	code    Code
	message string
	field   string
	cause   error  // logged for internal errors, never sent
	wwwAuth string // WWW-Authenticate value of a 401
}

func newAPIError(code Code, message string) *apiError {
	return &apiError{status: code.Status(), code: code, message: message}
}

func (e *apiError) Error() string { return string(e.code) + ": " + e.message }

// errUnauthorized is the 401 answer; presented says whether the request
// carried an Authorization header at all.
func errUnauthorized(presented bool) *apiError {
	if presented {
		e := newAPIError(CodeUnauthorized, "invalid bearer token")
		e.wwwAuth = `Bearer realm="fluxvm", error="invalid_token"`
		return e
	}
	e := newAPIError(CodeUnauthorized, "missing bearer token")
	e.wwwAuth = `Bearer realm="fluxvm"`
	return e
}

// toAPIError classifies an error returned by decoding or by the dataplane.
func toAPIError(err error) *apiError {
	var ae *apiError
	if errors.As(err, &ae) {
		return ae
	}
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return newAPIError(CodePayloadTooLarge,
			"request body larger than "+strconv.FormatInt(mbe.Limit, 10)+" bytes")
	}

	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return newAPIError(CodeUnavailable, "the request ended before the node finished: "+err.Error())
	}
	if errors.Is(err, fluxvm.ErrClosed) {
		return newAPIError(CodeUnavailable, "the dataplane is shutting down")
	}

	if e := haAPIError(err); e != nil {
		return e
	}

	var code Code
	switch {
	case errors.Is(err, fluxvm.ErrTooLarge):
		code = CodePayloadTooLarge
	case errors.Is(err, fluxvm.ErrNotFound):
		code = CodeNotFound
	case errors.Is(err, fluxvm.ErrUnsupported):
		code = CodeUnsupported
	case errors.Is(err, fluxvm.ErrPrerequisite), errors.Is(err, policy.ErrNoService):
		// A policy of a service the node does not have: apply the
		// service first.
		code = CodeMissingPrerequisite
	case errors.Is(err, fluxvm.ErrConflict):
		code = CodeConflict
	case errors.Is(err, fluxvm.ErrLimit):
		code = CodeLimitExceeded
	case errors.Is(err, fluxvm.ErrMalformed), errors.Is(err, fluxvm.ErrInvalid), errors.Is(err, flows.ErrLimit), isJSONError(err):
		code = CodeInvalidRequest
	default:
		e := newAPIError(CodeInternal, internalMessage)
		e.cause = err
		return e
	}
	// A validation error carries the field and a message without the
	// wrapping of the layers it came through.
	var ve *fluxvm.ValidationError
	if errors.As(err, &ve) {
		e := newAPIError(code, ve.Error())
		e.field = ve.Field
		return e
	}
	return newAPIError(code, err.Error())
}

// haAPIError classifies the errors of package ha (flow-state replication),
// or returns nil. Their message is sent as is: it names the service, the
// journal and the seqs or epochs involved.
func haAPIError(err error) *apiError {
	var code Code
	switch {
	case errors.Is(err, ha.ErrFenced):
		code = CodeFenced
	case errors.Is(err, ha.ErrStaleEpoch):
		code = CodeStaleEpoch
	case errors.Is(err, ha.ErrResetRequired):
		code = CodeResetRequired
	case errors.Is(err, ha.ErrGap):
		code = CodeSequenceGap
	case errors.Is(err, ha.ErrCursorAhead):
		code = CodeCursorAhead
	case errors.Is(err, ha.ErrService):
		code = CodeServiceMismatch
	case errors.Is(err, ha.ErrSeeds):
		code = CodeSeedMismatch
	case errors.Is(err, ha.ErrFormat):
		code = CodeSnapshotUnreadable
	case errors.Is(err, ha.ErrCorrupt), errors.Is(err, ha.ErrTruncated):
		code = CodeSnapshotCorrupt
	case errors.Is(err, ha.ErrInvalidOp), errors.Is(err, ha.ErrNoEpoch):
		code = CodeInvalidRequest
	default:
		return nil
	}
	return newAPIError(code, err.Error())
}

// isJSONError reports errors of encoding/json and of a short body, in case
// a decoder returns them without wrapping fluxvm.ErrInvalid.
func isJSONError(err error) bool {
	var (
		se *json.SyntaxError
		te *json.UnmarshalTypeError
	)
	return errors.As(err, &se) || errors.As(err, &te) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// writeError sends e as JSON and logs the cause of internal errors.
func (h *handler) writeError(w http.ResponseWriter, r *http.Request, e *apiError) {
	errorSpan(r, e)
	if e.code == CodeInternal && e.cause != nil {
		h.log.Error("api: internal error", "method", r.Method, "path", r.URL.Path, "error", e.cause)
	}
	if e.wwwAuth != "" {
		w.Header().Set("WWW-Authenticate", e.wwwAuth)
	}
	writeErrorBody(w, e)
}

// writeErrorBody writes the status and JSON body of e.
func writeErrorBody(w http.ResponseWriter, e *apiError) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	_ = json.NewEncoder(w).Encode(ErrorResponse{Error: ErrorDetail{Code: e.code, Message: e.message, Field: e.field}})
}
