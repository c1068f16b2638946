package api

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/ha"
)

// The handler reaches the node's dataplane through small role interfaces,
// one per part of the REST surface, which [New] takes together as
// [Roles]. *fluxvm.Dataplane implements every one of them but
// Replication, which its HA() value (fluxvm.HA) implements: [RolesOf]
// fills Roles from a dataplane. A test, or an embedder with a dataplane of
// its own, implements only the roles it serves differently. Every
// implementation must be safe for concurrent use: the handler calls it
// from many requests at once.

// ServiceStore is the service catalog: GET, POST /v1/network/services and
// GET, DELETE /v1/network/services/{name}.
type ServiceStore interface {
	// ApplyService validates and applies one service (create or replace)
	// and returns what the node made of it.
	ApplyService(ctx context.Context, svc fluxvm.Service) (fluxvm.ServiceStatus, error)
	// DeleteService removes a service; it wraps fluxvm.ErrNotFound when
	// there is no such service.
	DeleteService(ctx context.Context, name string) error
	// Services lists every service.
	Services() []fluxvm.ServiceStatus
	// Service returns one service; it wraps fluxvm.ErrNotFound when absent.
	Service(name string) (fluxvm.ServiceStatus, error)
}

// Observer reports the node: GET …/status, …/stats, …/health,
// …/advertisements, /v1/vms/{id}/network/services/stats, and /metrics
// (whose collector reads its MetricsSource part).
type Observer interface {
	MetricsSource
	// VMStats reads the counters of one VM's edge interfaces; it wraps
	// fluxvm.ErrNotFound for an unknown VM.
	VMStats(ctx context.Context, vmID string) (fluxvm.VMStats, error)
	// Advertisements returns the current VIP advertisement snapshot, the
	// document the node's snapshot file holds.
	Advertisements() advert.Snapshot
}

// Admin runs the node's rounds now: POST …/conntrack/gc,
// …/health/reconcile and …/pressure/reconcile.
type Admin interface {
	// GC runs one conntrack garbage collection now.
	GC(ctx context.Context) (fluxvm.GCResult, error)
	// ReconcileHealth runs one round of every health check now and
	// returns the report.
	ReconcileHealth(ctx context.Context) (fluxvm.HealthReport, error)
	// ReconcilePressure runs one round of the map pressure controller
	// now and returns what it did.
	ReconcilePressure(ctx context.Context) (fluxvm.PressureRound, error)
	// SetSNATPeers replaces the SNAT addresses of the other edges of the
	// node's group (POST …/snat/peers): a refused set wraps
	// fluxvm.ErrInvalid, a node without a north-south edge
	// fluxvm.ErrPrerequisite, and nothing changes.
	SetSNATPeers(ctx context.Context, p fluxvm.SNATPeers) (fluxvm.SNATStatus, error)
}

// FlowReader reads the FluxScope flow records: GET …/flows and POST
// …/telemetry/export.
type FlowReader interface {
	// Flows returns up to limit FluxScope flow records that f keeps,
	// newest first; a limit outside 1..flows.MaxLimit wraps
	// flows.ErrLimit.
	Flows(ctx context.Context, limit int, f flows.Filter) ([]flows.Record, error)
}

// PolicyStore is the identity policy state: GET, POST …/policies, POST
// …/policies/reconcile, GET, DELETE …/{name}/policy and GET
// …/{name}/l7/envoy.
type PolicyStore interface {
	// Policies reports the node's identity policy state (ipcache,
	// compiled policies, counters).
	Policies(ctx context.Context) (fluxvm.PoliciesStatus, error)
	// Policy reports the identity policy of one service; it wraps
	// fluxvm.ErrNotFound when the service has none.
	Policy(ctx context.Context, service string) (fluxvm.PolicyStatus, error)
	// ApplyPolicies adds or replaces the policies of the services they
	// name as one reconcile, keeping the others and the ipcache; with no
	// policy it recompiles and rewrites the current state.
	ApplyPolicies(ctx context.Context, policies ...fluxvm.Policy) (fluxvm.PoliciesStatus, error)
	// SetIPCache replaces the ipcache, recompiling every policy.
	SetIPCache(ctx context.Context, ipc fluxvm.IPCache) (fluxvm.PoliciesStatus, error)
	// DeletePolicy removes the identity policy of a service; it wraps
	// fluxvm.ErrNotFound when the service has none.
	DeletePolicy(ctx context.Context, service string) error
	// Envoy returns the document an Envoy/xDS adapter configures a
	// service's L7 proxy from; it wraps fluxvm.ErrNotFound when the
	// service has no policy with an l7 part.
	Envoy(service string) (fluxvm.EnvoyDocument, error)
}

// Snapshots moves a service's flows as a snapshot: GET
// …/{name}/conntrack/export and POST …/{name}/conntrack/import. They need
// the north-south edge only (else a fluxvm.ValidationError of kind
// fluxvm.ErrPrerequisite naming north_south_interfaces), not replication.
// An unknown service wraps fluxvm.ErrNotFound, a closed dataplane
// fluxvm.ErrClosed.
type Snapshots interface {
	// ExportFlows streams a snapshot of service's flows (package ha's
	// self-checking stream) to w, as it scans: the route writes it
	// straight into the response. Without replication the snapshot
	// carries epoch 0 and no journal cursor. A superseded edge wraps
	// ha.ErrFenced.
	ExportFlows(ctx context.Context, service string, w io.Writer) (ha.ExportResult, error)
	// ImportFlows applies a snapshot stream read from r to service,
	// chunk by verified chunk (an error leaves the chunks before it
	// applied); prune also deletes the service's flows the snapshot
	// lacks. A stream it cannot read wraps ha.ErrFormat, ha.ErrCorrupt
	// or ha.ErrTruncated; one of another service ha.ErrService; on an
	// edge holding a lease, one of an older epoch (or of none, epoch 0)
	// ha.ErrStaleEpoch.
	ImportFlows(ctx context.Context, service string, r io.Reader, prune bool) (ha.ImportResult, error)
}

// Replication is flow-state replication (fluxvm.HA, what
// Dataplane.HA returns): GET …/ha, POST …/ha/lease, GET
// …/{name}/conntrack/delta, POST …/delta/import and …/delta/ack. With
// replication off (no ha_epoch), every call but Status wraps a
// fluxvm.ValidationError of kind fluxvm.ErrPrerequisite naming ha_epoch.
// An unknown service wraps fluxvm.ErrNotFound, a closed dataplane
// fluxvm.ErrClosed, and the conditions of replication the errors of
// package ha.
type Replication interface {
	// FlowDelta returns the batches of service's journal after the
	// cursor (req.Journal, req.Seq), at most req.MaxOps ops but at least
	// one batch, or a delta saying ResetRequired when the journal cannot
	// continue the cursor. A seq past the journal wraps
	// ha.ErrCursorAhead.
	FlowDelta(ctx context.Context, service string, req fluxvm.FlowDeltaRequest) (ha.Delta, error)
	// ImportFlowDelta applies a delta of the peer's journal to service
	// after checking that it continues this edge's cursor (else
	// ha.ErrStaleEpoch, ha.ErrResetRequired, ha.ErrGap, ha.ErrInvalidOp
	// or ha.ErrNoEpoch, and nothing changes).
	ImportFlowDelta(ctx context.Context, service string, delta ha.Delta) (fluxvm.HADeltaResult, error)
	// AckFlowDelta trims service's journal up to seq; past the last
	// sealed batch wraps ha.ErrCursorAhead.
	AckFlowDelta(ctx context.Context, service string, seq uint64) (ha.JournalStats, error)
	// UpdateLease records a lease update of the control plane: an epoch
	// older than the edge's wraps ha.ErrStaleEpoch, an empty one
	// fluxvm.ErrInvalid.
	UpdateLease(ctx context.Context, l fluxvm.HALease) (fluxvm.HAStatus, error)
	// Join tells a group edge it holds the other edges' state (POST
	// …/ha/join): it advertises from then on. An edge outside a group
	// wraps fluxvm.ErrPrerequisite naming ha_group.
	Join(ctx context.Context) (fluxvm.HAStatus, error)
	// Status reports replication (Enabled false when it is off).
	Status() fluxvm.HAStatus
}

// Roles are the parts of the dataplane the handler serves, one per role.
// [New] needs every one.
type Roles struct {
	Services    ServiceStore
	Observer    Observer
	Admin       Admin
	Flows       FlowReader
	Policies    PolicyStore
	Snapshots   Snapshots
	Replication Replication
}

// RolesOf returns the roles of a dataplane: d for every one, and d.HA()
// for Replication. d must not be nil.
func RolesOf(d *fluxvm.Dataplane) Roles {
	return Roles{Services: d, Observer: d, Admin: d, Flows: d, Policies: d, Snapshots: d, Replication: d.HA()}
}

// check fails naming the roles that are nil (also an interface holding a
// nil pointer of a type that is not *fluxvm.Dataplane is the embedder's
// to avoid: it is not detected).
func (r Roles) check() error {
	var errs []error
	for _, role := range []struct {
		name string
		nil  bool
	}{
		{"Services", r.Services == nil}, {"Observer", r.Observer == nil}, {"Admin", r.Admin == nil},
		{"Flows", r.Flows == nil}, {"Policies", r.Policies == nil}, {"Snapshots", r.Snapshots == nil},
		{"Replication", r.Replication == nil},
	} {
		if role.nil {
			errs = append(errs, fmt.Errorf("Roles.%s is nil", role.name))
		}
	}
	return errors.Join(errs...)
}
