// Package otlp exports FluxScope flow records to an OpenTelemetry receiver
// (a Collector, or any backend that speaks OTLP/HTTP) as logs.
//
// Why logs: a flow record is one event with many attributes and no
// duration of its own that a trace would add anything to; OTLP's logs
// signal carries exactly that, one LogRecord per flow, and collectors
// filter, route and store logs by attribute. The daemon's own work (REST
// requests, reconciles, GC rounds) has a start, an end and a cause, which
// is what spans are for: NewTracerProvider sends those to the same
// endpoint's traces path, so one collector shows both.
//
// Each LogRecord is timed at the flow's LastSeen, INFO when the flow went
// through and WARN when it was dropped, with a one-line summary as body and
// attributes named after OpenTelemetry's network semantic conventions
// (network.transport, network.type, source.*, destination.*) where one
// exists, and fluxvm.* for the rest (see the Attr* constants).
//
// Requests are OTLP/JSON, the product's contract, or binary protobuf
// (Config.Encoding). OTLP/JSON is not protojson's default output:
// MarshalJSON writes trace and span ids as hex and enums as integers, as
// the specification requires.
//
// An Exporter never blocks its callers on the network except in Export,
// which takes a context: Enqueue puts records in a bounded queue that a
// background loop sends every Config.Interval and whenever a batch is
// full; failures are retried with backoff on the statuses OTLP calls
// retryable, honouring Retry-After, and counted in Stats; Close flushes
// within its context's deadline.
package otlp
