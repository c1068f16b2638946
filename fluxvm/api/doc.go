// Package api is the REST surface of the FluxVM Service Fabric: an
// [http.Handler] that the reference daemon serves on 127.0.0.1:7788 and that
// embedders can mount in their own server.
//
// # Model
//
// The handler owns no state. It authenticates the caller, decodes and
// bounds the request, and calls the node's dataplane through small role
// interfaces, one per part of the surface ([ServiceStore], [Observer], [Admin],
// [FlowReader], [PolicyStore], [Snapshots], [Replication]), which [New]
// takes as [Roles]: *fluxvm.Dataplane implements them all but
// Replication, which its HA() value implements, and [RolesOf] fills them
// from one. Tests and embedders with their own dataplane implement the
// roles they need.
//
// # Routes
//
//	GET    /v1/network/services                     list services (array of ServiceStatus)
//	POST   /v1/network/services                     apply one service (create or replace); 200 + ServiceStatus
//	GET    /v1/network/services/status              dataplane status
//	GET    /v1/network/services/stats               datapath statistics
//	POST   /v1/network/services/conntrack/gc        run a conntrack GC now; 200 + GCResult
//	GET    /v1/network/services/health              observed health of health-checked backends
//	POST   /v1/network/services/health/reconcile    run every health check now; 200 + HealthReport
//	GET    /v1/network/services/advertisements      VIP advertisement snapshot (as the file holds it)
//	GET    /v1/network/services/flows               FluxScope flow records, newest first (?limit= 1..4096,
//	                                                default 256; service, backend, verdict, since)
//	POST   /v1/network/services/telemetry/export    send the newest records (?limit=, default 1024) through
//	                                                Options.Exporter now; 200 + ExportResponse, 422 without one
//	GET    /v1/network/services/policies            identity policy state (PoliciesStatus)
//	POST   /v1/network/services/policies            apply one policy or an array of them as one reconcile;
//	                                                200 + PoliciesStatus; 422 missing_prerequisite for a
//	                                                service that does not exist
//	POST   /v1/network/services/policies/reconcile  re-read the ipcache (Options.IPCacheSource, when set) and
//	                                                recompile and rewrite every policy; 200 + PoliciesStatus
//	POST   /v1/network/services/pressure/reconcile  run a map pressure round now (GC, shedding, the hard
//	                                                action at the hard threshold); 200 + fluxvm.PressureRound
//	GET    /v1/network/services/{name}              one service; 404 when absent
//	DELETE /v1/network/services/{name}              remove a service; 204
//	GET    /v1/network/services/{name}/policy       one service's identity policy (PolicyStatus); 404 when none
//	DELETE /v1/network/services/{name}/policy       remove a service's identity policy; 204, 404 when none
//	GET    /v1/network/services/{name}/l7/envoy     the Envoy/xDS document of the service's L7 policy; 404 when
//	                                                the service has no l7 policy
//	GET    /v1/network/services/ha                  flow-state replication state (fluxvm.HAStatus)
//	POST   /v1/network/services/ha/lease            a lease update (fluxvm.HALease); 200 + HAStatus, 409 stale_epoch
//	GET    /v1/network/services/{name}/conntrack/export
//	                                                the service's flow snapshot, application/octet-stream,
//	                                                streamed; counts in trailers (X-Fluxvm-Export-Flows, ...)
//	POST   /v1/network/services/{name}/conntrack/import
//	                                                load a snapshot (application/octet-stream, streamed, at most
//	                                                Options.MaxSnapshotBytes; ?prune=true|false); 200 + ha.ImportResult
//	GET    /v1/network/services/{name}/conntrack/delta
//	                                                journal batches after ?journal=&seq= (max_ops 1..65536,
//	                                                default 4096); 200 + ha.Delta (reset_required inside)
//	POST   /v1/network/services/{name}/conntrack/delta/import
//	                                                apply an ha.Delta (JSON, at most Options.MaxDeltaBytes);
//	                                                200 + fluxvm.HADeltaResult; 409 reset_required, sequence_gap,
//	                                                stale_epoch
//	POST   /v1/network/services/{name}/conntrack/delta/ack
//	                                                {"seq": N}: trim the journal; 200 + ha.JournalStats,
//	                                                409 cursor_ahead
//	GET    /v1/vms/{id}/network/services/stats      one VM's service statistics
//	GET    /metrics                                 Prometheus text format
//
// The snapshot routes (export, import) need the node's north-south edge
// only: without it they answer 422 missing_prerequisite, field
// north_south_interfaces. Without replication (no ha_epoch) a snapshot
// carries epoch 0 and no journal cursor, and an import keeps no cursor;
// delta, delta import, ack and the lease answer 422
// missing_prerequisite, field ha_epoch: they need the journal.
//
// An export that fails after its first byte cannot change its status: the
// answer is aborted (http.ErrAbortHandler) and the stream lacks its end
// record, which every importer refuses. An error before it is an ordinary
// JSON error.
//
// The fixed segments under /v1/network/services/, those of these routes,
// are reserved ([fluxvm.ReservedNames]: advertisements,
// conntrack, flows, ha, health, policies, pressure, stats, status, telemetry):
// validation refuses them as service names, and the {name} routes never
// answer one as a service. GET of a reserved word that is only a prefix
// of routes (GET /v1/network/services/pressure) is 404 "no such route", so a
// later route never hides a service, nor a service a route. DELETE of a
// reserved word removes only a service restored under it from an older
// catalog (fluxvm keeps such a service serving, with a warning).
// docs/openapi.yaml in the module describes every route and schema.
//
// Applying a service is an idempotent upsert: the same request twice leaves
// the node unchanged and both answer 200 with the resulting ServiceStatus.
// The body must be a JSON fluxvm.Service sent as application/json; unknown
// fields are rejected.
//
// # Authentication
//
// Every request, /metrics and unknown paths included, needs an
// "Authorization: Bearer <token>" header with a configured token. Read
// tokens may call the GET routes; admin tokens may call every route.
// Mutations (POST, DELETE) need an admin token. Tokens are compared in
// constant time against every configured token. A handler needs at least
// one token; the reference daemon additionally refuses to start without an
// admin token.
//
// The token is checked from the headers alone, before anything of the
// body is read. A request refused before its body was read (401, 403,
// 404, 405, 413 by Content-Length, 415) is answered at once, without
// waiting for the body it announced, and its HTTP/1 connection is closed
// after the answer. The body of an accepted request must arrive within
// Options.BodyTimeout (408 otherwise), so a client that announces a body
// and never sends it cannot hold a connection.
//
// # Errors
//
// Errors are JSON objects with a stable code (see [Code]):
//
//	{"error": {"code": "invalid_request", "message": "...", "field": "backends[1].port"}}
//
//	code                    status  cause
//	invalid_request         400     fluxvm.ErrMalformed (bad JSON, unknown field), fluxvm.ErrInvalid
//	unauthorized            401     no or unknown bearer token (WWW-Authenticate: Bearer)
//	forbidden               403     read token on a mutation
//	not_found               404     unknown route, service or VM (fluxvm.ErrNotFound)
//	method_not_allowed      405     route exists with other methods (Allow lists them)
//	request_timeout         408     the body did not arrive within Options.BodyTimeout
//	conflict                409     fluxvm.ErrConflict; a service named twice in one policy request
//	payload_too_large       413     body over Options.MaxBodyBytes (fluxvm.ErrTooLarge)
//	unsupported_media_type  415     a POST body not of the route's media type (application/json;
//	                                application/octet-stream for …/conntrack/import)
//	unsupported             422     fluxvm.ErrUnsupported
//	missing_prerequisite    422     fluxvm.ErrPrerequisite (field: the setting missing, e.g. ha_epoch,
//	                                north_south_interfaces); a policy of a service that does not exist
//	                                (policy.ErrNoService); the IPCacheSource of a policy reconcile failed
//	limit_exceeded          422     fluxvm.ErrLimit
//	internal                500     anything else; the detail goes to the log only
//	unavailable             503     the request ended (client gone, deadline) before a GC or health round finished, or the dataplane is shutting down
//
// The HA state transfer routes add (package ha's errors):
//
//	reset_required          409     the delta cannot continue the cursor: load a snapshot (ha.ErrResetRequired)
//	sequence_gap            409     the delta does not continue the cursor contiguously (ha.ErrGap)
//	stale_epoch             409     an epoch older than the newest this edge accepted (ha.ErrStaleEpoch)
//	fenced                  409     this edge's lease was superseded (ha.ErrFenced)
//	cursor_ahead            409     a seq past the journal's last sealed batch (ha.ErrCursorAhead)
//	snapshot_corrupt        400     a snapshot truncated or failing its checksums (ha.ErrTruncated, ha.ErrCorrupt)
//	service_mismatch        400     a snapshot or delta of another service than the path's (ha.ErrService)
//	snapshot_unreadable     422     not a snapshot, or a format, schema or map set this node does not read (ha.ErrFormat)
//	seed_mismatch           409     a snapshot of an edge whose hash_seed or maglev_seed differs from this edge's (ha.ErrSeeds)
//
// "field" is present when a [fluxvm.ValidationError] names one.
//
// # Metrics
//
// /metrics serves a [prometheus.Registry] (Options.Registry or a private
// one) holding the collector of [NewCollector], which reads the dataplane's
// Stats and Status at scrape time, and, when Options.Exporter has Stats
// (an *otlp.Exporter), the collector of [NewOTLPCollector]. Embedders that
// serve their own /metrics can register them in their registry instead.
//
// # Tracing
//
// With Options.TracerProvider every request is an OpenTelemetry server
// span named after its route: the request's method and the route
// pattern's path ("GET /v1/network/services/{name}", never the path with
// its ids; "HEAD /v1/network/services/status" for a HEAD request, which
// http.ServeMux serves with the GET route; the method alone when no
// route serves it), with the attributes of the HTTP semantic
// conventions: http.request.method, http.route,
// http.response.status_code, url.path, url.query when the request has a
// query (as sent; the values of the signed-URL parameters the URL
// conventions name, such as sig and Signature, are redacted; the API's
// token is a header and never recorded), url.scheme, and error.type with
// an Error status for a 5xx; [AttrErrorCode] names the code of an error
// answer. A handler that panics after its answer started, or aborts with
// [net/http.ErrAbortHandler], ends its span as an error too (error.type
// "aborted" for the abort, which still drops the connection as net/http
// does; no status code when nothing was sent).
//
// Authentication comes before the trace context: the Authorization
// header is checked first (it reads no body), then the span starts,
// timed from the request's arrival. A W3C traceparent header is followed
// only for a request with a valid token; a request that fails
// authentication gets a span that is the root of a trace of its own, so
// that a caller without a token cannot place spans in a trace of its
// choosing, and refused requests are still seen. The span is in the
// context the dataplane is called with, so the spans of
// fluxvm.Options.TracerProvider (the apply a POST asked for, a GC round)
// are its children.
package api
