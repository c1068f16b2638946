// Package otelcol proves flows/otlp against the OpenTelemetry Collector's
// own OTLP receiver (go.opentelemetry.io/collector/receiver/otlpreceiver),
// run in the test process, in both encodings (OTLP/HTTP JSON and
// protobuf).
//
// With made-up records, the exporter alone: what the collector decodes is
// what was sent, field by field; a receiver that is down, slow or answers
// 503 loses nothing the exporter's queue bound promises and never makes
// Enqueue wait.
//
// With real traffic (TestLabFlowsReachCollector, root only): the fluxvmd
// binary, built from this checkout, runs in a lab node with
// flow_sample_rate 1 and otlp_endpoint pointed at the receiver, listening
// in the node's namespace. Client VMs reach a VIP with two backend VMs
// (TCP connections with echoed payloads, UDP exchanges) and a service
// without a ready backend. The periodic export sends each flow once, and
// POST /v1/network/services/telemetry/export sends them again and reports
// it; the collector decodes one log record per flow whose attributes are
// the lab's truth (the client socket's address and port, the VIP, the
// backend VM that answered, protocol, forwarded or dropped with
// no_backend, counts covering the payload moved) and the daemon's own
// listing, under the configured service.name and node; /metrics counts
// the records sent and none lost.
//
// It is a module of its own so that the SDK's go.mod does not grow the
// collector's dependencies. Run it from this folder: go test ./...
// (FLUXVM_REQUIRE_PRIVILEGED=1 makes the lab test fail, not skip,
// without privileges.)
package otelcol
