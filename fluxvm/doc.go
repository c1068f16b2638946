// Package fluxvm is the node's service dataplane: [Open] loads and attaches
// the eBPF programs from [Options] (or a TOML configuration through
// [OptionsFrom]), restores the catalog of services, and the returned
// [Dataplane] applies and deletes services ([Dataplane.ApplyService]),
// runs the conntrack GC, the health checks and the VIP advertisements,
// and reads statistics and FluxScope flow records. Flow-state
// replication (journals, deltas, leases) is behind [Dataplane.HA].
//
// # Contexts
//
// Every call that does I/O takes a context.Context first. The reports
// that answer from the dataplane's memory take none: Services, Service,
// Health, Advertisements, Envoy, Conntrack (a handle), HA().Status, and
// Status but for its Memory part (a bounded read of the maps' sizes). A
// context that
// ended before the call changes anything makes it change nothing and
// return an error wrapping the context's (errors.Is(err,
// context.Canceled)); each call checks it on entry and again after every
// wait for a lock, up to its commit. A call with a point of no return
// (Open's switch of the attachments, Cleanup's first removal, a lease
// written, a policy state written) says so in its doc comment and
// finishes from there whatever the context says.
//
// # Tracing
//
// With [Options].TracerProvider (an OpenTelemetry trace.TracerProvider;
// nil means none) the dataplane starts a span for each piece of its
// control-plane work: [SpanApplyService], [SpanDeleteService],
// [SpanRestore] (the catalog at Open), [SpanGC] (every GC round, of the
// timer or on demand), [SpanReconcileHealth] and [SpanReconcilePolicies]
// (a policy apply or reconcile, an ipcache change, a policy delete). Spans carry what the work
// was about and what it did as attributes ([AttrService],
// [AttrFrontends], [AttrBackends], [AttrChanged], [AttrGCScanned],
// [AttrGCCollected], ...), an error as a span event with an Error status,
// and are children of the span in the caller's context: the REST API's
// request span when [github.com/fluxvm/servicefabric/fluxvm/api] has the
// same provider. The package never exports anything itself: the owner of
// the provider chooses the exporter (the reference daemon sends spans
// with otlptracehttp to its otlp_endpoint, beside the flow records) and
// shuts it down after [Dataplane.Close].
package fluxvm
