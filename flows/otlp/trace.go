package otlp

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// NewTracerProvider returns a TracerProvider for the daemon's own spans
// (REST requests, apply and reconcile, GC rounds) that sends them with
// otlptracehttp to cfg.Endpoint+"/v1/traces", in cfg.Encoding, with the
// same resource as the flow logs (service.name, host.name, fluxvm.node),
// so one collector shows both. Spans are batched: up to cfg.MaxBatch per
// request, at least every cfg.Interval, at most cfg.QueueSize waiting
// (the SDK drops beyond that); requests time out after cfg.Timeout and
// retry as otlptracehttp does, within cfg.RetryMaxElapsed. The caller
// owns the provider: Shutdown(ctx) flushes it within ctx.
func NewTracerProvider(ctx context.Context, cfg Config) (*sdktrace.TracerProvider, error) {
	cfg, err := cfg.normalize()
	if err != nil {
		return nil, err
	}
	enc := otlptracehttp.EncodingJSON
	if cfg.Encoding == EncodingProtobuf {
		enc = otlptracehttp.EncodingProtobuf
	}
	opts := []otlptracehttp.Option{
		otlptracehttp.WithEndpointURL(cfg.Endpoint + "/v1/traces"),
		otlptracehttp.WithEncoding(enc),
		otlptracehttp.WithTimeout(cfg.Timeout),
		otlptracehttp.WithRetry(otlptracehttp.RetryConfig{
			Enabled:         true,
			InitialInterval: cfg.RetryInitial,
			MaxInterval:     cfg.RetryMax,
			MaxElapsedTime:  cfg.RetryMaxElapsed,
		}),
	}
	if len(cfg.Headers) > 0 {
		opts = append(opts, otlptracehttp.WithHeaders(cfg.Headers))
	}
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("otlp: trace exporter: %w", err)
	}
	res := resource.NewWithAttributes(semconv.SchemaURL,
		semconv.ServiceName(cfg.ServiceName),
		semconv.HostName(cfg.NodeName),
		attribute.String(AttrNode, cfg.NodeName),
	)
	return sdktrace.NewTracerProvider(
		sdktrace.WithResource(res),
		sdktrace.WithBatcher(exp,
			sdktrace.WithBatchTimeout(cfg.Interval),
			sdktrace.WithMaxQueueSize(cfg.QueueSize),
			sdktrace.WithMaxExportBatchSize(cfg.MaxBatch),
			sdktrace.WithExportTimeout(cfg.Timeout),
		),
	), nil
}
