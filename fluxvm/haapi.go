package fluxvm

import (
	"context"

	"github.com/fluxvm/servicefabric/ha"
)

// HA is the flow-state replication of a Dataplane (HAOptions.Epoch,
// ha_epoch): the journals its standbys follow (FlowDelta, AckFlowDelta),
// the deltas it applies as a standby (ImportFlowDelta), its lease
// (UpdateLease) and their status. Dataplane.HA returns it; it holds
// nothing of its own, so it may be kept or fetched again at will, and
// copied.
//
// Snapshots (Dataplane.ExportFlows and ImportFlows) stay on Dataplane:
// they need the north-south edge alone, not replication.
//
// With replication off, every call but Status fails with a
// ValidationError of kind ErrPrerequisite naming ha_epoch. The zero HA,
// and the HA of a nil Dataplane or of one Open did not make, is usable:
// every call fails with an error matching ErrClosed (Status returns the
// zero HAStatus), as do the calls of a closed Dataplane's.
type HA struct {
	d *Dataplane
}

// HA returns the dataplane's flow-state replication (see HA). It is
// valid on any Dataplane, nil included.
func (d *Dataplane) HA() HA { return HA{d: d} }

// FlowDelta is d.HA().FlowDelta.
//
// Deprecated: use d.HA().FlowDelta; this wrapper goes in the next release.
func (d *Dataplane) FlowDelta(ctx context.Context, service string, req FlowDeltaRequest) (ha.Delta, error) {
	return d.HA().FlowDelta(ctx, service, req)
}

// AckFlowDelta is d.HA().AckFlowDelta.
//
// Deprecated: use d.HA().AckFlowDelta; this wrapper goes in the next
// release.
func (d *Dataplane) AckFlowDelta(ctx context.Context, service string, seq uint64) (ha.JournalStats, error) {
	return d.HA().AckFlowDelta(ctx, service, seq)
}

// ImportFlowDelta is d.HA().ImportFlowDelta.
//
// Deprecated: use d.HA().ImportFlowDelta; this wrapper goes in the next
// release.
func (d *Dataplane) ImportFlowDelta(ctx context.Context, service string, delta ha.Delta) (HADeltaResult, error) {
	return d.HA().ImportFlowDelta(ctx, service, delta)
}

// UpdateLease is d.HA().UpdateLease.
//
// Deprecated: use d.HA().UpdateLease; this wrapper goes in the next
// release.
func (d *Dataplane) UpdateLease(ctx context.Context, l HALease) (HAStatus, error) {
	return d.HA().UpdateLease(ctx, l)
}

// HAStatus is d.HA().Status.
//
// Deprecated: use d.HA().Status; this wrapper goes in the next release.
func (d *Dataplane) HAStatus() HAStatus { return d.HA().Status() }
