package fluxvm

import (
	"context"
	"fmt"
	"iter"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/hasync"
	"github.com/fluxvm/servicefabric/ha"
)

// HAOptions configures flow-state replication to a standby edge: the
// configuration's ha_epoch, ha_interval and ha_journal_max_ops. With an
// Epoch, Open turns the datapath's mutation queue on (every flow a
// forward path learns is queued), drains it into one ha.Journal per
// service, seals the journals every Interval, and adds GC's removals to
// them; FlowDelta, ImportFlowDelta, AckFlowDelta and UpdateLease answer,
// ExportFlows puts the lease epoch and the journal's checkpoint in its
// snapshots and ImportFlows refuses snapshots older than the lease. It
// needs the north-south edge (NorthSouth.Interfaces). With Epoch 0,
// ExportFlows and ImportFlows still move a service's flows between nodes
// (they need only the north-south edge), unfenced.
type HAOptions struct {
	// Epoch is the lease epoch the control plane gave this edge; 0 leaves
	// replication off. A newer lease given since (UpdateLease, kept next
	// to the catalog) wins over it.
	Epoch ha.Epoch
	// Interval is how often the journals seal a batch (0:
	// DefaultHAInterval): what a failover can lose.
	Interval time.Duration
	// JournalMaxOps is ha_journal_max_ops: it bounds each journal's
	// history (ha.JournalOptions.MaxOps; 0: ha.DefaultMaxOps).
	JournalMaxOps int
	// Deprecated: use JournalMaxOps.
	MaxOps int
	// Group is ha_group: the edge is one of a group, all active, each
	// following every other edge's journals (hasync.Config.Group). Needs
	// Epoch and Options.NodeName.
	Group bool
}

// HALease is what the control plane tells an edge about leases
// (UpdateLease).
type HALease = hasync.Lease

// HAStatus is the state of flow-state replication on this edge.
type HAStatus struct {
	Enabled bool `json:"enabled"`
	// Epoch is the edge's lease epoch; SupersededBy the newer lease that
	// fenced it (0: not fenced).
	Epoch        ha.Epoch `json:"epoch,omitempty"`
	SupersededBy ha.Epoch `json:"superseded_by,omitempty"`
	// Interval is how often the journals seal a batch.
	Interval Duration `json:"interval,omitzero"`
	// Queue counts the datapath's mutation queue: records read, records
	// skipped (of flows not replicated, or while fenced) and records the
	// datapath had no room for (fluxvm_hadrop: the snapshot-diff repairs
	// them). GCDeletes counts flows GC removed that the journals carry.
	Queue     HAQueueStatus `json:"queue"`
	GCDeletes uint64        `json:"gc_deletes"`
	// Journals are the source side, by service: what standbys pull.
	Journals map[string]ha.JournalStats `json:"journals,omitempty"`
	// Cursors are the target side, by service: how far this edge applied
	// its peer's journal (reset at a restart: the next pull asks for a
	// snapshot).
	Cursors map[string]ha.Cursor `json:"cursors,omitempty"`
	// Group says the edge is one of a group (ha_group), Node its name;
	// Sources then replaces Cursors: by service, then source edge.
	// Joined says the group edge loaded the other edges' state since it
	// started (HA.Join): until then its advertisements are withdrawn.
	Group   bool                            `json:"group,omitempty"`
	Node    string                          `json:"node,omitempty"`
	Joined  bool                            `json:"joined,omitempty"`
	Sources map[string]map[string]ha.Cursor `json:"sources,omitempty"`
}

// HAQueueStatus counts the mutation queue (ha.Drainer.Stats).
type HAQueueStatus = hasync.QueueStatus

// HADeltaResult is what ImportFlowDelta did: the target's cursor after
// it and the counts of the ops applied.
type HADeltaResult = hasync.DeltaResult

// haStatusOf is the component's status as the facade reports it.
func haStatusOf(s hasync.Status) HAStatus {
	return HAStatus{Enabled: true, Epoch: s.Epoch, SupersededBy: s.SupersededBy, Interval: Duration{Duration: s.Interval},
		Queue: s.Queue, GCDeletes: s.GCDeletes, Journals: s.Journals, Cursors: s.Cursors,
		Group: s.Group, Node: s.Node, Joined: s.Joined, Sources: s.Sources}
}

// FlowDeltaRequest is what a standby asks FlowDelta for: the batches of
// a service's journal after its cursor. The zero value asks for the whole
// journal of a standby with no state yet (the answer says
// ResetRequired: it loads a snapshot first).
type FlowDeltaRequest struct {
	// Journal is the journal incarnation the standby's cursor follows
	// (ha.Cursor.Journal; "" when it follows none yet).
	Journal string
	// Seq is the last batch of that journal the standby applied
	// (ha.Cursor.Seq; 0: none).
	Seq uint64
	// MaxOps bounds the ops of the answer, which holds at least one
	// batch all the same; 0 or less: no bound.
	MaxOps int
}

// haLink is what the replication component (fluxvm/internal/hasync)
// reads of the dataplane: the services (under d.mu, held by the caller
// of Sync), the end of a change in progress and the mutation queue. d is
// set by Open once the Dataplane is made, before the component starts.
type haLink struct{ d *Dataplane }

// Services yields every service and its live frontends' datapath ids.
// d.mu held.
func (l *haLink) Services() iter.Seq2[string, []uint32] {
	return func(yield func(string, []uint32) bool) {
		for name, s := range l.d.services {
			var sids []uint32
			for _, fe := range s.Frontends {
				if fe.Live() {
					sids = append(sids, fe.ID())
				}
			}
			if !yield(name, sids) {
				return
			}
		}
	}
}

// settle returns once the apply or delete in progress ended, with its
// syncHA.
func (l *haLink) settle() {
	l.d.mu.Lock()
	l.d.mu.Unlock() // nothing to do under it: waiting for it is the point
}

// newDrainer opens the reader of the datapath's mutation queue.
func (l *haLink) newDrainer(journal func(uint32) *ha.Journal) (hasync.Drainer, error) {
	m := l.d.dp.Maps()
	return ha.NewDrainer(ha.DrainerConfig{Queue: m.FluxvmHaq, Drops: m.FluxvmHadrop, Journal: journal})
}

// newHASync makes the replication component, loading the lease kept next
// to the catalog (a newer one than the options' wins); nil when HA is
// off. Open sets the link's Dataplane.
func newHASync(o Options) (*hasync.Sync, *haLink, error) {
	link := &haLink{}
	if o.HA.Epoch == 0 {
		return nil, link, nil
	}
	cfg := hasync.Config{Epoch: o.HA.Epoch, Interval: o.HA.Interval, JournalMaxOps: o.HA.JournalMaxOps, Logger: o.Logger,
		Group: o.HA.Group, Node: o.NodeName}
	if o.CatalogPath != "" {
		cfg.LeasePath = o.CatalogPath + LeaseFileSuffix
	}
	s, err := hasync.New(cfg, hasync.Deps{Services: link, NewDrainer: link.newDrainer, Settle: link.settle})
	return s, link, err
}

// syncHA gives the replication component the services after a change.
// d.mu held.
func (d *Dataplane) syncHA() {
	if d.ha != nil {
		d.ha.Sync()
	}
}

// haRemoved journals a flow GC removed (conntrack.Config.Removed).
func (d *Dataplane) haRemoved(k conntrack.Key, sid uint32, kind conntrack.Kind, idle time.Duration) {
	if d.ha != nil {
		d.ha.Removed(k, sid, kind, idle)
	}
}

// startHA starts draining the mutation queue and sealing the journals.
func (d *Dataplane) startHA() error {
	if d.ha == nil {
		return nil
	}
	return d.ha.Start()
}

// stopHA stops the drainer and the sealer. Call it after markClosed,
// without mu.
func (d *Dataplane) stopHA() {
	if d.ha != nil {
		d.ha.Close() // its only error is the close of the queue's reader
	}
}

// haOn returns the replication component, or an error wrapping
// ErrPrerequisite that names ha_epoch when HA is off.
func (d *Dataplane) haOn(what string) (*hasync.Sync, error) {
	d.mu.Lock()
	err := d.checkOpen(what)
	d.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if d.ha == nil {
		return nil, fmt.Errorf("fluxvm: %w", verr(ErrPrerequisite, "ha_epoch",
			"%s: needs flow-state replication, which keeps the journals, cursors and leases: set ha_epoch "+
				"(snapshots, ExportFlows and ImportFlows, need only the north-south edge)", what))
	}
	return d.ha, nil
}

// sourceJournal is service's journal on this edge (created when the
// service has none yet).
func (d *Dataplane) sourceJournal(ctx context.Context, what, service string) (*ha.Journal, error) {
	h, err := d.haOn(what + " " + service)
	if err != nil {
		return nil, err
	}
	j, err := h.SourceJournal(ctx, service)
	if err != nil {
		return nil, fmt.Errorf("fluxvm: %s %s: %w", what, service, err)
	}
	return j, nil
}

// haBegin counts an HA stream (export, import) as work under way, which
// Close waits for, and ties ctx to Close, which cancels it.
func (d *Dataplane) haBegin(ctx context.Context, what string) (context.Context, func(), error) {
	d.mu.Lock()
	if err := d.checkOpen(what); err != nil {
		d.mu.Unlock()
		return nil, nil, err
	}
	d.inflight.Add(1)
	d.mu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(d.gcCtx, cancel)
	return ctx, func() { stop(); cancel(); d.inflight.Done() }, nil
}

// haMetaFlags sets or clears the datapath's HA flag.
func haMetaFlags(m *bpf.Meta, on bool) {
	if on {
		m.Flags |= bpf.MetaFlagHA
	} else {
		m.Flags &^= bpf.MetaFlagHA
	}
}
