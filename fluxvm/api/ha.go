package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/ha"
)

// Bounds of the HA state transfer routes.
const (
	// DefaultMaxSnapshotBytes bounds the body of POST
	// /v1/network/services/{name}/conntrack/import when
	// Options.MaxSnapshotBytes is 0: 256 MiB, about two million flows
	// (ha.RecordSize bytes each).
	DefaultMaxSnapshotBytes int64 = 256 << 20
	// DefaultMaxDeltaBytes bounds the body of POST
	// /v1/network/services/{name}/conntrack/delta/import when
	// Options.MaxDeltaBytes is 0: 64 MiB, room for a delta of
	// MaxDeltaOps ops in JSON.
	DefaultMaxDeltaBytes int64 = 64 << 20
	// DefaultDeltaOps is the max_ops of GET
	// /v1/network/services/{name}/conntrack/delta when absent;
	// MaxDeltaOps the largest it may be.
	DefaultDeltaOps = 4096
	MaxDeltaOps     = 65536
)

// octetStream is the media type of a snapshot stream.
const octetStream = "application/octet-stream"

// The trailers of GET /v1/network/services/{name}/conntrack/export: the
// counts of ha.ExportResult, sent after the stream when it is complete.
const (
	TrailerExportFlows      = "X-Fluxvm-Export-Flows"
	TrailerExportExpired    = "X-Fluxvm-Export-Expired"
	TrailerExportNotCarried = "X-Fluxvm-Export-Not-Carried"
	TrailerExportNoBackend  = "X-Fluxvm-Export-No-Backend"
)

// DeltaAckRequest is the body of POST
// /v1/network/services/{name}/conntrack/delta/ack.
type DeltaAckRequest struct {
	// Seq is the newest batch every standby applied (required): the
	// journal forgets the batches up to it.
	Seq *uint64 `json:"seq"`
}

// haService is the {name} of an HA route; a reserved word is never a
// service there.
func haService(r *http.Request) (string, error) {
	name := r.PathValue("name")
	if fluxvm.IsReservedName(name) {
		return "", errReservedRoute(r, name)
	}
	return name, nil
}

// exportWriter is the response of an export: nothing is sent before the
// first byte of the stream, so that an error before it is still a JSON
// error answer.
type exportWriter struct {
	w       http.ResponseWriter
	service string
	started bool
}

func (e *exportWriter) Write(p []byte) (int, error) {
	if !e.started {
		e.started = true
		hdr := e.w.Header()
		hdr.Set("Content-Type", octetStream)
		hdr.Set("Content-Disposition", fmt.Sprintf("attachment; filename=%q", e.service+".fxvmha"))
		hdr.Set("Trailer", TrailerExportFlows+", "+TrailerExportExpired+", "+TrailerExportNotCarried+", "+TrailerExportNoBackend)
		e.w.WriteHeader(http.StatusOK)
	}
	return e.w.Write(p)
}

// exportConntrack answers GET /v1/network/services/{name}/conntrack/export:
// the snapshot stream of Snapshots.ExportFlows, written to the response as
// it is produced (never held whole). An error before its first byte is
// the usual JSON error answer. One after it cannot change the status: the
// connection is aborted (http.ErrAbortHandler) so that the answer ends
// without the end of a chunked body, and the stream lacks its end record,
// which every importer refuses (ha.ErrTruncated). A complete stream is
// followed by the trailers of the export's counts.
func (h *handler) exportConntrack(w http.ResponseWriter, r *http.Request) error {
	name, err := haService(r)
	if err != nil {
		return err
	}
	ew := &exportWriter{w: w, service: name}
	res, err := h.roles.Snapshots.ExportFlows(r.Context(), name, ew)
	if err != nil {
		if !ew.started {
			return err
		}
		if r.Context().Err() != nil {
			// The client went away (or the embedder's deadline passed).
			h.log.Warn("api: conntrack export ended with its request; the answer is aborted",
				"service", name, "flows", res.Flows, "error", err)
		} else {
			h.log.Error("api: conntrack export failed after the stream started; the answer is aborted",
				"service", name, "flows", res.Flows, "error", err)
		}
		panic(http.ErrAbortHandler)
	}
	if !ew.started {
		// An exporter that wrote nothing and succeeded: not a stream.
		return fmt.Errorf("export of %s wrote no snapshot", name)
	}
	hdr := w.Header()
	hdr.Set(TrailerExportFlows, strconv.FormatUint(res.Flows, 10))
	hdr.Set(TrailerExportExpired, strconv.FormatUint(res.Expired, 10))
	hdr.Set(TrailerExportNotCarried, strconv.FormatUint(res.NotCarried, 10))
	hdr.Set(TrailerExportNoBackend, strconv.FormatUint(res.NoBackend, 10))
	return nil
}

// readErrBody remembers the first error reading the request body other
// than io.EOF: the snapshot reader reports a short stream as
// ha.ErrTruncated without its cause, and the cause (a body over the
// limit, a deadline) decides the answer.
type readErrBody struct {
	r   io.Reader
	err error
}

func (b *readErrBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if err != nil && !errors.Is(err, io.EOF) && b.err == nil {
		b.err = err
	}
	return n, err
}

// importConntrack answers POST /v1/network/services/{name}/conntrack/import:
// the body, an application/octet-stream snapshot of at most
// Options.MaxSnapshotBytes, is read by Snapshots.ImportFlows as it
// arrives. prune=true also deletes the service's flows the snapshot lacks.
func (h *handler) importConntrack(w http.ResponseWriter, r *http.Request) error {
	name, err := haService(r)
	if err != nil {
		return err
	}
	prune, err := parseBool(r.URL.Query(), "prune")
	if err != nil {
		return err
	}
	body := &readErrBody{r: r.Body}
	res, err := h.roles.Snapshots.ImportFlows(r.Context(), name, body, prune)
	if err != nil {
		if body.err != nil {
			// The body broke off: its cause is the answer (413, 408, ...).
			return fmt.Errorf("%w (the chunks before it were applied: %d flows read, %d written)", body.err, res.Flows, res.Written)
		}
		return err
	}
	h.writeJSON(w, r, http.StatusOK, res)
	return nil
}

// parseBool reads an optional boolean query parameter: absent is false,
// else exactly true or false.
func parseBool(q url.Values, param string) (bool, error) {
	if !q.Has(param) {
		return false, nil
	}
	switch v := q.Get(param); v {
	case "true":
		return true, nil
	case "false":
		return false, nil
	default:
		return false, queryError(param, "%q is not true or false", v)
	}
}

// getDelta answers GET /v1/network/services/{name}/conntrack/delta: the
// batches of the service's journal after the cursor (journal, seq) the
// caller holds, at most max_ops ops (but at least one batch). A cursor
// the journal cannot continue (another or no journal, history gone) is a
// 200 whose delta says reset_required.
func (h *handler) getDelta(w http.ResponseWriter, r *http.Request) error {
	name, err := haService(r)
	if err != nil {
		return err
	}
	q := r.URL.Query()
	var seq uint64
	if q.Has("seq") {
		v := q.Get("seq")
		seq, err = strconv.ParseUint(v, 10, 64)
		if err != nil {
			return queryError("seq", "%q is not an unsigned integer", v)
		}
	}
	maxOps := DefaultDeltaOps
	if q.Has("max_ops") {
		v := q.Get("max_ops")
		n, err := strconv.Atoi(v)
		switch {
		case err != nil:
			return queryError("max_ops", "%q is not an integer", v)
		case n < 1 || n > MaxDeltaOps:
			return queryError("max_ops", "%d is outside 1..%d", n, MaxDeltaOps)
		}
		maxOps = n
	}
	d, err := h.roles.Replication.FlowDelta(r.Context(), name, fluxvm.FlowDeltaRequest{Journal: q.Get("journal"), Seq: seq, MaxOps: maxOps})
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, d)
	return nil
}

// importDelta answers POST
// /v1/network/services/{name}/conntrack/delta/import: the body is a delta
// of the service's journal on the peer (what GET …/conntrack/delta there
// answered), decoded strictly; the answer is the cursor after it and the
// counts.
func (h *handler) importDelta(w http.ResponseWriter, r *http.Request) error {
	name, d, err := haBody[ha.Delta](r)
	if err != nil {
		return err
	}
	if d.Service != name {
		e := newAPIError(CodeServiceMismatch, fmt.Sprintf("service: the delta is of %q, not of %q", d.Service, name))
		e.field = "service"
		return e
	}
	res, err := h.roles.Replication.ImportFlowDelta(r.Context(), name, d)
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, res)
	return nil
}

// haBody is the service an HA route names and its JSON body, decoded
// strictly.
func haBody[T any](r *http.Request) (string, T, error) {
	var v T
	name, err := haService(r)
	if err != nil {
		return "", v, err
	}
	body, err := readBody(r)
	if err != nil {
		return "", v, err
	}
	err = decodeStrictNoRepeat(body, &v)
	return name, v, err
}

// ackDelta answers POST /v1/network/services/{name}/conntrack/delta/ack.
func (h *handler) ackDelta(w http.ResponseWriter, r *http.Request) error {
	name, req, err := haBody[DeltaAckRequest](r)
	if err != nil {
		return err
	}
	if req.Seq == nil {
		e := newAPIError(CodeInvalidRequest, "seq: required")
		e.field = "seq"
		return e
	}
	st, err := h.roles.Replication.AckFlowDelta(r.Context(), name, *req.Seq)
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, st)
	return nil
}

// haStatus answers GET /v1/network/services/ha.
func (h *handler) haStatus(w http.ResponseWriter, r *http.Request) error {
	h.writeJSON(w, r, http.StatusOK, h.roles.Replication.Status())
	return nil
}

// joinRequest is the body of POST /v1/network/services/ha/join: empty or
// "{}".
type joinRequest struct{}

// joinGroup answers POST /v1/network/services/ha/join.
func (h *handler) joinGroup(w http.ResponseWriter, r *http.Request) error {
	if err := emptyBody(r, &joinRequest{}); err != nil {
		return err
	}
	st, err := h.roles.Replication.Join(r.Context())
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, st)
	return nil
}

// updateLease answers POST /v1/network/services/ha/lease.
func (h *handler) updateLease(w http.ResponseWriter, r *http.Request) error {
	body, err := readBody(r)
	if err != nil {
		return err
	}
	var l fluxvm.HALease
	if err := decodeStrictNoRepeat(body, &l); err != nil {
		return err
	}
	st, err := h.roles.Replication.UpdateLease(r.Context(), l)
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, st)
	return nil
}

// decodeStrictNoRepeat is decodeStrict that also refuses an object
// holding a key twice (encoding/json keeps the last), naming the field.
func decodeStrictNoRepeat(body []byte, v any) error {
	if err := decodeStrict(body, v); err != nil {
		return err
	}
	if f := repeatedKey(body); f != "" {
		e := newAPIError(CodeInvalidRequest, f+": repeated field")
		e.field = f
		return e
	}
	return nil
}

// repeatedKey returns the path of the first key an object of the JSON
// document body holds twice ("batches[0].ops[3].flow.vip"), or "". body
// is valid JSON (decodeStrict read it).
func repeatedKey(body []byte) string {
	type frame struct {
		obj  bool
		keys map[string]bool
		path string
		idx  int    // next element of an array
		key  string // the key whose value comes next, in an object
		want bool   // an object expects a key next
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var stack []*frame
	// child is the path of the value about to be read.
	child := func() string {
		if len(stack) == 0 {
			return ""
		}
		f := stack[len(stack)-1]
		if f.obj {
			if f.path == "" {
				return f.key
			}
			return f.path + "." + f.key
		}
		p := fmt.Sprintf("%s[%d]", f.path, f.idx)
		return p
	}
	// done marks a value of the top frame read.
	done := func() {
		if len(stack) == 0 {
			return
		}
		f := stack[len(stack)-1]
		if f.obj {
			f.want = true
		} else {
			f.idx++
		}
	}
	for {
		tok, err := dec.Token()
		if err != nil {
			return ""
		}
		if len(stack) > 0 {
			if f := stack[len(stack)-1]; f.obj && f.want {
				if k, ok := tok.(string); ok {
					if f.keys[k] {
						if f.path == "" {
							return k
						}
						return f.path + "." + k
					}
					f.keys[k] = true
					f.key, f.want = k, false
					continue
				}
			}
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, &frame{obj: true, keys: map[string]bool{}, path: child(), want: true})
		case json.Delim('['):
			stack = append(stack, &frame{path: child()})
		case json.Delim('}'), json.Delim(']'):
			stack = stack[:len(stack)-1]
			done()
		default:
			done()
		}
	}
}
