package api

import (
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
)

// Defaults of the flow routes' limit parameter.
const (
	DefaultFlowsLimit  = 256  // GET /v1/network/services/flows
	DefaultExportLimit = 1024 // POST /v1/network/services/telemetry/export
)

// FlowsResponse is the body of GET /v1/network/services/flows.
type FlowsResponse struct {
	// Limit is the limit the records were read with.
	Limit int `json:"limit"`
	// Records, newest first; [] when none.
	Records []flows.Record `json:"records"`
}

// ExportResponse is the body of POST
// /v1/network/services/telemetry/export.
type ExportResponse struct {
	// Read is how many records were read from the ring (at most the
	// limit), all of them handed to the exporter.
	Read int `json:"read"`
	// Sent is what the exporter reports it sent.
	Sent otlp.Report `json:"sent"`
}

// queryError is a 400 about one query parameter.
func queryError(param, format string, args ...any) *apiError {
	e := newAPIError(CodeInvalidRequest, param+": "+fmt.Sprintf(format, args...))
	e.field = param
	return e
}

// parseLimit reads the limit parameter: def when absent, else an integer
// in 1..flows.MaxLimit.
func parseLimit(q url.Values, def int) (int, error) {
	if !q.Has("limit") {
		return def, nil
	}
	v := q.Get("limit")
	n, err := strconv.Atoi(v)
	switch {
	case err != nil:
		return 0, queryError("limit", "%q is not an integer", v)
	case n < 1 || n > flows.MaxLimit:
		return 0, queryError("limit", "%d is outside 1..%d (the most records one request returns)", n, flows.MaxLimit)
	}
	return n, nil
}

// parseFilter reads the filters of GET /v1/network/services/flows.
func parseFilter(q url.Values) (flows.Filter, error) {
	var f flows.Filter
	f.Service = q.Get("service")
	if v := q.Get("backend"); v != "" {
		a, err := netip.ParseAddr(v)
		if err != nil || a.Zone() != "" {
			return f, queryError("backend", "%q is not an IP address", v)
		}
		f.Backend = a
	}
	switch v := flows.Verdict(q.Get("verdict")); v {
	case "", flows.Forwarded, flows.Dropped, flows.Audited, flows.Redirected:
		f.Verdict = v
	default:
		return f, queryError("verdict", "%q is not a verdict (want %s, %s, %s or %s)", v, flows.Forwarded, flows.Dropped, flows.Audited, flows.Redirected)
	}
	if v := q.Get("since"); v != "" {
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			return f, queryError("since", "%q is not an RFC 3339 time such as 2026-01-02T15:04:05Z", v)
		}
		f.Since = t
	}
	return f, nil
}

// flows serves GET /v1/network/services/flows.
func (h *handler) flows(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	limit, err := parseLimit(q, DefaultFlowsLimit)
	if err != nil {
		return err
	}
	f, err := parseFilter(q)
	if err != nil {
		return err
	}
	recs, err := h.roles.Flows.Flows(r.Context(), limit, f)
	if err != nil {
		return err
	}
	if recs == nil {
		recs = []flows.Record{}
	}
	h.writeJSON(w, r, http.StatusOK, FlowsResponse{Limit: limit, Records: recs})
	return nil
}

// exportFlows serves POST /v1/network/services/telemetry/export: it reads
// the newest records (no filter) and sends them through the exporter now,
// within the request's context.
func (h *handler) exportFlows(w http.ResponseWriter, r *http.Request) error {
	if h.exporter == nil {
		return newAPIError(CodeMissingPrerequisite, "otlp_endpoint not configured: set it to export flows to an OTLP receiver")
	}
	limit, err := parseLimit(r.URL.Query(), DefaultExportLimit)
	if err != nil {
		return err
	}
	recs, err := h.roles.Flows.Flows(r.Context(), limit, flows.Filter{})
	if err != nil {
		return err
	}
	if len(recs) == 0 {
		h.writeJSON(w, r, http.StatusOK, ExportResponse{})
		return nil
	}
	rep, err := h.exporter.Export(r.Context(), recs)
	if err != nil {
		h.log.Warn("api: flow export failed", "read", len(recs), "sent", rep.Records, "error", err)
		counts := fmt.Sprintf("(read %d, sent %d in %d requests, %d rejected)", len(recs), rep.Records, rep.Batches, rep.Rejected)
		if errors.Is(err, ErrExportStopping) || errors.Is(err, otlp.ErrClosed) {
			// Not the receiver's doing: the exporter's owner is stopping.
			return newAPIError(CodeUnavailable, fmt.Sprintf("%v %s", err, counts))
		}
		return newAPIError(CodeUnavailable, fmt.Sprintf("the OTLP receiver did not take the records: %v %s", err, counts))
	}
	h.writeJSON(w, r, http.StatusOK, ExportResponse{Read: len(recs), Sent: rep})
	return nil
}

// OTLPStatsSource is what the OTLP collector reads: *otlp.Exporter.
type OTLPStatsSource interface {
	Stats() otlp.Stats
}

var (
	descOTLPSent      = desc("otlp_records_sent_total", "Flow records the OTLP receiver accepted (periodic and on-demand export).")
	descOTLPBatches   = desc("otlp_batches_sent_total", "OTLP export requests the receiver accepted.")
	descOTLPFailed    = desc("otlp_failed_batches_total", "OTLP export requests given up on: a permanent error, retries exhausted, the stop deadline or the client of an on-demand export gone.")
	descOTLPRetries   = desc("otlp_retries_total", "Retries of OTLP export requests (network errors, timeouts, 429, 502, 503, 504).")
	descOTLPDropped   = desc("otlp_dropped_total", "Flow records not exported, by reason: queue_full (refused by the full queue), failed (in a failed request, rejected by the receiver, or unsent at stop).", "reason")
	descOTLPQueued    = desc("otlp_queued_records", "Flow records waiting in the OTLP export queue or in flight.")
	descOTLPLastError = desc("otlp_last_error_timestamp_seconds", "Unix time of the last OTLP export error (absent before the first).")
)

type otlpCollector struct{ src OTLPStatsSource }

// NewOTLPCollector returns a Prometheus collector of an OTLP exporter's
// Stats, read at every scrape. New registers one, beside the dataplane
// collector, when Options.Exporter also implements OTLPStatsSource (as
// *otlp.Exporter does). It exports:
//
//	fluxvm_otlp_records_sent_total              counter
//	fluxvm_otlp_batches_sent_total              counter
//	fluxvm_otlp_failed_batches_total            counter
//	fluxvm_otlp_retries_total                   counter
//	fluxvm_otlp_dropped_total                   counter {reason: queue_full, failed}
//	fluxvm_otlp_queued_records                  gauge
//	fluxvm_otlp_last_error_timestamp_seconds    gauge (once an error happened)
func NewOTLPCollector(src OTLPStatsSource) prometheus.Collector { return otlpCollector{src: src} }

// Describe implements prometheus.Collector.
func (otlpCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descOTLPSent, descOTLPBatches, descOTLPFailed, descOTLPRetries, descOTLPDropped, descOTLPQueued, descOTLPLastError} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c otlpCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.src.Stats()
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	counter(descOTLPSent, st.RecordsSent)
	counter(descOTLPBatches, st.BatchesSent)
	counter(descOTLPFailed, st.BatchesFailed)
	counter(descOTLPRetries, st.Retries)
	counter(descOTLPDropped, st.DroppedQueueFull, "queue_full")
	counter(descOTLPDropped, st.DroppedFailed, "failed")
	ch <- prometheus.MustNewConstMetric(descOTLPQueued, prometheus.GaugeValue, float64(st.Queued))
	if !st.LastErrorTime.IsZero() {
		ch <- prometheus.MustNewConstMetric(descOTLPLastError, prometheus.GaugeValue, float64(st.LastErrorTime.UnixNano())/1e9)
	}
}
