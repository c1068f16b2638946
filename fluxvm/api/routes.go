package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/fluxvm"
)

// route is one endpoint. The table below is the single list of endpoints:
// New registers exactly these, and a test checks docs/openapi.yaml against
// it in both directions.
type route struct {
	method string
	path   string // http.ServeMux path pattern
	admin  bool   // needs an admin token (all mutations do)
	// body says the endpoint reads a request body: it must be of media
	// (application/json when empty) and at most maxBody long.
	body bool
	// media is the media type of the body; "": application/json.
	media string
	// maxBody is the bound of the body; nil: Options.MaxBodyBytes.
	maxBody func(h *handler) int64
	// handle serves the request. An error it returns becomes the error
	// response: the dataplane's error message is sent as is for the
	// categories of fluxvm (it names the service or VM), and the
	// internal ones are logged with the method and path, never sent.
	handle func(h *handler, w http.ResponseWriter, r *http.Request) error
}

// pattern is the ServeMux pattern of the route.
func (rt route) pattern() string { return rt.method + " " + rt.path }

var routes = []route{
	{method: http.MethodGet, path: "/v1/network/services", handle: (*handler).listServices},
	{method: http.MethodPost, path: "/v1/network/services", admin: true, body: true, handle: (*handler).applyService},
	{method: http.MethodGet, path: "/v1/network/services/status", handle: (*handler).status},
	{method: http.MethodGet, path: "/v1/network/services/stats", handle: (*handler).stats},
	{method: http.MethodPost, path: "/v1/network/services/conntrack/gc", admin: true, body: true, handle: (*handler).gc},
	{method: http.MethodGet, path: "/v1/network/services/health", handle: (*handler).health},
	{method: http.MethodPost, path: "/v1/network/services/health/reconcile", admin: true, body: true, handle: (*handler).reconcileHealth},
	{method: http.MethodPost, path: "/v1/network/services/pressure/reconcile", admin: true, body: true, handle: (*handler).reconcilePressure},
	{method: http.MethodPost, path: "/v1/network/services/snat/peers", admin: true, body: true, handle: (*handler).setSNATPeers},
	{method: http.MethodGet, path: "/v1/network/services/advertisements", handle: (*handler).advertisements},
	{method: http.MethodGet, path: "/v1/network/services/flows", handle: (*handler).flows},
	{method: http.MethodPost, path: "/v1/network/services/telemetry/export", admin: true, handle: (*handler).exportFlows},
	{method: http.MethodGet, path: "/v1/network/services/policies", handle: (*handler).listPolicies},
	{method: http.MethodPost, path: "/v1/network/services/policies", admin: true, body: true, handle: (*handler).applyPolicies},
	{method: http.MethodPost, path: "/v1/network/services/policies/reconcile", admin: true, body: true, handle: (*handler).reconcilePolicies},
	{method: http.MethodGet, path: "/v1/network/services/{name}", handle: (*handler).getService},
	{method: http.MethodDelete, path: "/v1/network/services/{name}", admin: true, handle: (*handler).deleteService},
	{method: http.MethodGet, path: "/v1/network/services/{name}/policy", handle: (*handler).getPolicy},
	{method: http.MethodDelete, path: "/v1/network/services/{name}/policy", admin: true, handle: (*handler).deletePolicy},
	{method: http.MethodGet, path: "/v1/network/services/{name}/l7/envoy", handle: (*handler).getEnvoy},
	{method: http.MethodGet, path: "/v1/network/services/ha", handle: (*handler).haStatus},
	{method: http.MethodPost, path: "/v1/network/services/ha/lease", admin: true, body: true, handle: (*handler).updateLease},
	{method: http.MethodPost, path: "/v1/network/services/ha/join", admin: true, body: true, handle: (*handler).joinGroup},
	{method: http.MethodGet, path: "/v1/network/services/{name}/conntrack/export", handle: (*handler).exportConntrack},
	{method: http.MethodPost, path: "/v1/network/services/{name}/conntrack/import", admin: true, body: true, media: octetStream,
		maxBody: func(h *handler) int64 { return h.maxSnapshot }, handle: (*handler).importConntrack},
	{method: http.MethodGet, path: "/v1/network/services/{name}/conntrack/delta", handle: (*handler).getDelta},
	{method: http.MethodPost, path: "/v1/network/services/{name}/conntrack/delta/import", admin: true, body: true,
		maxBody: func(h *handler) int64 { return h.maxDelta }, handle: (*handler).importDelta},
	{method: http.MethodPost, path: "/v1/network/services/{name}/conntrack/delta/ack", admin: true, body: true, handle: (*handler).ackDelta},
	{method: http.MethodGet, path: "/v1/vms/{id}/network/services/stats", handle: (*handler).vmStats},
	{method: http.MethodGet, path: "/metrics", handle: (*handler).serveMetrics},
}

// endpoint wraps a route's handler with the checks every route shares:
// access level, media type and body size.
func (h *handler) endpoint(rt route) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if rw, ok := w.(*responseWriter); ok {
			rw.routed = true
		}
		routed(r, rt)
		lvl, _ := r.Context().Value(levelKey{}).(level)
		if rt.admin && lvl != levelAdmin {
			h.writeError(w, r, newAPIError(CodeForbidden, "this route needs an admin token"))
			return
		}
		if rt.body {
			media, limit := rt.media, h.maxBody
			if media == "" {
				media = "application/json"
			}
			if rt.maxBody != nil {
				limit = rt.maxBody(h)
			}
			if hasBody(r) && !isMediaType(r.Header.Get("Content-Type"), media) {
				h.writeError(w, r, newAPIError(CodeUnsupportedMediaType, "request body must be "+media))
				return
			}
			if r.ContentLength > limit {
				h.writeError(w, r, toAPIError(&http.MaxBytesError{Limit: limit}))
				return
			}
			r.Body = http.MaxBytesReader(w, r.Body, limit)
		}
		if err := rt.handle(h, w, r); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				// Only the body has a read deadline (ServeHTTP).
				err = newAPIError(CodeRequestTimeout, fmt.Sprintf("the request body did not arrive within %v", h.bodyTimeout))
			}
			h.writeError(w, r, toAPIError(err))
		}
	})
}

// hasBody reports whether the request announces a body.
func hasBody(r *http.Request) bool {
	return r.ContentLength > 0 || (r.ContentLength < 0 && r.Body != nil && r.Body != http.NoBody)
}

// isMediaType reports whether a Content-Type is of media type want
// (parameters are ignored).
func isMediaType(contentType, want string) bool {
	mt, _, err := mime.ParseMediaType(contentType)
	return err == nil && mt == want
}

// readBody reads the whole (already bounded) request body.
func readBody(r *http.Request) ([]byte, error) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		return nil, fmt.Errorf("read request body: %w", err)
	}
	return b, nil
}

// writeJSON sends v with the given status.
func (h *handler) writeJSON(w http.ResponseWriter, r *http.Request, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		h.writeError(w, r, toAPIError(fmt.Errorf("encode response: %w", err)))
		return
	}
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

func (h *handler) listServices(w http.ResponseWriter, r *http.Request) error {
	list := h.roles.Services.Services()
	if list == nil {
		list = []fluxvm.ServiceStatus{}
	}
	list = slices.Clone(list)
	slices.SortStableFunc(list, func(a, b fluxvm.ServiceStatus) int {
		return strings.Compare(a.Service.Name, b.Service.Name)
	})
	h.writeJSON(w, r, http.StatusOK, list)
	return nil
}

func (h *handler) applyService(w http.ResponseWriter, r *http.Request) error {
	svc, err := fluxvm.DecodeServiceLimit(r.Body, h.maxBody)
	if err != nil {
		return err
	}
	st, err := h.roles.Services.ApplyService(r.Context(), svc)
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, st)
	return nil
}

// errReservedRoute is the 404 of a reserved word of the REST surface
// (fluxvm.ReservedNames) that reaches the {name} routes: the word names a
// route this build does not have (yet), never a service.
func errReservedRoute(r *http.Request, name string) *apiError {
	return newAPIError(CodeNotFound, fmt.Sprintf("no such route: %s %s; %q is reserved for a route of the REST API, not a service name",
		r.Method, r.URL.Path, name))
}

func (h *handler) getService(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if fluxvm.IsReservedName(name) {
		return errReservedRoute(r, name)
	}
	st, err := h.roles.Services.Service(name)
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, st)
	return nil
}

// deleteService removes a service. A reserved word removes only a
// service restored under it from an older catalog (see fluxvm's
// Dataplane.restore), the one way to get rid of it; otherwise it is a
// route that does not exist.
func (h *handler) deleteService(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := h.roles.Services.DeleteService(r.Context(), name); err != nil {
		if fluxvm.IsReservedName(name) && errors.Is(err, fluxvm.ErrNotFound) {
			return errReservedRoute(r, name)
		}
		return err
	}
	w.Header().Del("Content-Type")
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (h *handler) status(w http.ResponseWriter, r *http.Request) error {
	h.writeJSON(w, r, http.StatusOK, h.roles.Observer.Status())
	return nil
}

func (h *handler) stats(w http.ResponseWriter, r *http.Request) error {
	st, err := h.roles.Observer.Stats(r.Context())
	if err != nil {
		return err
	}
	if st.Services == nil {
		st.Services = map[string]fluxvm.Counters{}
	}
	if st.Drops == nil {
		st.Drops = map[string]uint64{}
	}
	if st.Parser == nil {
		st.Parser = map[string]uint64{}
	}
	h.writeJSON(w, r, http.StatusOK, st)
	return nil
}

// gcRequest is the body of POST /v1/network/services/conntrack/gc: empty or
// "{}" today; it exists so options can be added without breaking clients.
type gcRequest struct{}

// emptyBody reads a body that is empty or an empty options object (v,
// decoded strictly: a field it lacks is refused).
func emptyBody(r *http.Request, v any) error {
	body, err := readBody(r)
	if err != nil {
		return err
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return nil
	}
	return decodeStrict(body, v)
}

func (h *handler) gc(w http.ResponseWriter, r *http.Request) error {
	if err := emptyBody(r, &gcRequest{}); err != nil {
		return err
	}
	res, err := h.roles.Admin.GC(r.Context())
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, res)
	return nil
}

// snatPeersRequest is the body of POST /v1/network/services/snat/peers
// (fluxvm.SNATPeers): the whole set; an empty list clears it, a missing
// one is refused.
type snatPeersRequest struct {
	Addresses *[]netip.Addr `json:"addresses"`
	Announce  []netip.Addr  `json:"announce,omitempty"`
}

func (h *handler) setSNATPeers(w http.ResponseWriter, r *http.Request) error {
	body, err := readBody(r)
	if err != nil {
		return err
	}
	var req snatPeersRequest
	if err := decodeStrictNoRepeat(body, &req); err != nil {
		return err
	}
	if req.Addresses == nil {
		e := newAPIError(CodeInvalidRequest, "addresses: required (the whole set; [] clears it)")
		e.field = "addresses"
		return e
	}
	st, err := h.roles.Admin.SetSNATPeers(r.Context(), fluxvm.SNATPeers{Addresses: *req.Addresses, Announce: req.Announce})
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, st)
	return nil
}

func (h *handler) health(w http.ResponseWriter, r *http.Request) error {
	h.writeJSON(w, r, http.StatusOK, healthReport(h.roles.Observer.Health()))
	return nil
}

// reconcileRequest is the body of POST
// /v1/network/services/health/reconcile: empty or "{}" today.
type reconcileRequest struct{}

func (h *handler) reconcileHealth(w http.ResponseWriter, r *http.Request) error {
	if err := emptyBody(r, &reconcileRequest{}); err != nil {
		return err
	}
	rep, err := h.roles.Admin.ReconcileHealth(r.Context())
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, healthReport(rep))
	return nil
}

// reconcilePressure answers POST /v1/network/services/pressure/reconcile
// (body empty or "{}"): one round of the map pressure controller now, and
// what it did.
func (h *handler) reconcilePressure(w http.ResponseWriter, r *http.Request) error {
	if err := emptyBody(r, &reconcileRequest{}); err != nil {
		return err
	}
	round, err := h.roles.Admin.ReconcilePressure(r.Context())
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, round)
	return nil
}

// healthReport makes the lists of a report [] rather than null.
func healthReport(rep fluxvm.HealthReport) fluxvm.HealthReport {
	if rep.Services == nil {
		rep.Services = []fluxvm.ServiceHealth{}
	}
	for i := range rep.Services {
		if rep.Services[i].Backends == nil {
			rep.Services[i].Backends = []fluxvm.BackendHealth{}
		}
	}
	return rep
}

// advertisements sends the VIP advertisement snapshot byte for byte as
// the file holds it (package advert): indented JSON and a final newline,
// entries never null.
func (h *handler) advertisements(w http.ResponseWriter, r *http.Request) error {
	s := h.roles.Observer.Advertisements()
	if s.Entries == nil {
		s.Entries = []advert.Entry{}
	}
	for i := range s.Entries {
		if s.Entries[i].Ports == nil {
			s.Entries[i].Ports = []advert.Port{}
		}
	}
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return fmt.Errorf("encode advertisements: %w", err)
	}
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(append(b, '\n'))
	return nil
}

func (h *handler) vmStats(w http.ResponseWriter, r *http.Request) error {
	st, err := h.roles.Observer.VMStats(r.Context(), r.PathValue("id"))
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, st)
	return nil
}

func (h *handler) serveMetrics(w http.ResponseWriter, r *http.Request) error {
	h.metrics.ServeHTTP(w, r)
	return nil
}

// decodeStrict decodes one JSON value into v, rejecting unknown fields and
// trailing data.
func decodeStrict(body []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		e := newAPIError(CodeInvalidRequest, err.Error())
		var te *json.UnmarshalTypeError
		if f := unknownField(err); f != "" {
			e.field = f
			e.message = f + ": unknown field"
		} else if errors.As(err, &te) && te.Field != "" {
			e.field = te.Field
		}
		return e
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return newAPIError(CodeInvalidRequest, "trailing data after the JSON value")
	}
	return nil
}

// unknownField extracts the field name from encoding/json's unknown-field
// error, or returns "".
func unknownField(err error) string {
	const prefix = `json: unknown field "`
	msg := err.Error()
	if !strings.HasPrefix(msg, prefix) {
		return ""
	}
	return strings.TrimSuffix(strings.TrimPrefix(msg, prefix), `"`)
}
