// Package otelcol proves flows/otlp against the OpenTelemetry Collector's
// own OTLP receiver, run in the test process: what the collector decodes
// is what was sent, in both encodings, and a receiver that is down or
// answers 503 loses nothing the exporter's queue bound promises.
//
// It is a module of its own so that the SDK's go.mod does not grow the
// collector's dependencies. Run it from this folder: go test ./...
package otelcol
