package fluxvm

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// TracerName is the instrumentation scope of the dataplane's spans.
const TracerName = "github.com/fluxvm/servicefabric/fluxvm"

// Span names of the dataplane's control-plane work (Options.TracerProvider).
const (
	SpanApplyService    = "fluxvm.ApplyService"    // ApplyService: one service created or updated
	SpanDeleteService   = "fluxvm.DeleteService"   // DeleteService
	SpanRestore         = "fluxvm.Restore"         // Open: the catalog restored into the datapath
	SpanGC              = "fluxvm.GC"              // GC: one conntrack/NAT GC round (timer or on demand)
	SpanReconcileHealth = "fluxvm.ReconcileHealth" // ReconcileHealth: one round of every health check
	// SpanReconcilePolicies: ReconcilePolicies, ApplyPolicies, SetIPCache
	// or DeletePolicy: the identity policies compiled and written.
	SpanReconcilePolicies = "fluxvm.ReconcilePolicies"
)

// Span attributes of the dataplane's spans: what the work was about and
// what it did.
const (
	AttrService        = attribute.Key("fluxvm.service")            // the service's name
	AttrRevision       = attribute.Key("fluxvm.service.revision")   // its revision after the apply
	AttrFrontends      = attribute.Key("fluxvm.service.frontends")  // its frontends (VIP, port, protocol)
	AttrBackends       = attribute.Key("fluxvm.service.backends")   // its backends in the intent
	AttrChanged        = attribute.Key("fluxvm.apply.changed")      // false: the same intent again, nothing written
	AttrServices       = attribute.Key("fluxvm.services")           // services restored, or health-checked
	AttrGCScanned      = attribute.Key("fluxvm.gc.scanned")         // conntrack entries scanned
	AttrGCExpired      = attribute.Key("fluxvm.gc.expired")         // entries removed: timed out
	AttrGCDrained      = attribute.Key("fluxvm.gc.drained")         // entries removed: drain deadline passed
	AttrGCBackendGone  = attribute.Key("fluxvm.gc.backend_gone")    // entries removed: backend removed
	AttrGCOrphans      = attribute.Key("fluxvm.gc.orphans_removed") // reverse-NAT entries removed without a flow
	AttrGCRepaired     = attribute.Key("fluxvm.gc.repaired")        // entries repaired
	AttrGCCollected    = attribute.Key("fluxvm.gc.collected")       // all entries removed
	AttrHealthBackends = attribute.Key("fluxvm.health.backends")    // backends in the health report
	AttrPolicies       = attribute.Key("fluxvm.policies")           // identity policies after a reconcile
)

// tracerOf is the tracer of tp, a no-op one when tp is nil.
func tracerOf(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	return tp.Tracer(TracerName)
}

// startSpan starts a span of the dataplane's work under ctx.
func (d *Dataplane) startSpan(ctx context.Context, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	if ctx == nil {
		ctx = context.Background()
	}
	return d.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...))
}

// endSpan ends span, recording *err when it is not nil; use it deferred
// with a pointer to the function's named error.
func endSpan(span trace.Span, err *error) {
	if err != nil && *err != nil {
		span.RecordError(*err)
		span.SetStatus(codes.Error, (*err).Error())
	}
	span.End()
}
