package fluxvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/atomicfile"
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
}

// HALease is what the control plane tells an edge about leases
// (UpdateLease).
type HALease struct {
	// Epoch, when nonzero, is this edge's lease renewed or advanced; an
	// epoch older than the edge's is refused (ha.ErrStaleEpoch). An
	// advance past the epoch that superseded the edge lets its journals
	// serve again, as new incarnations: every standby resyncs from a
	// snapshot.
	Epoch ha.Epoch `json:"epoch,omitempty"`
	// SupersededBy, when nonzero and newer than the edge's epoch, is the
	// lease another edge now holds: this edge's journals stop recording
	// and serving, and its exports are refused (ha.ErrFenced), so that a
	// partitioned old active cannot overwrite the new one's flows.
	SupersededBy ha.Epoch `json:"superseded_by,omitempty"`
}

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
}

// HAQueueStatus counts the mutation queue (ha.Drainer.Stats).
type HAQueueStatus struct {
	Read    uint64 `json:"read"`
	Skipped uint64 `json:"skipped"`
	Dropped uint64 `json:"dropped"`
}

// HADeltaResult is what ImportFlowDelta did: the target's cursor after
// it and the counts of the ops applied.
type HADeltaResult struct {
	Cursor  ha.Cursor       `json:"cursor"`
	Applied ha.ImportResult `json:"applied"`
}

// haSync is the replication state of a dataplane with HA on.
type haSync struct {
	interval  time.Duration
	jopts     ha.JournalOptions
	leasePath string // "": the lease is kept in memory only

	mu        sync.Mutex
	epoch     ha.Epoch
	fencedBy  ha.Epoch
	journals  map[string]*ha.Journal
	sids      map[uint32]string // datapath service id -> service
	cursors   map[string]ha.Cursor
	gcDeletes uint64
	// syncGen counts syncHA calls; unknown remembers, per datapath id no
	// service had, the syncGen of that miss, so that a record of a
	// removed service waits for no change in progress twice.
	syncGen    uint64
	unknown    map[uint32]uint64
	unresolved uint64 // records of no service, dropped
	// importCancel cancels the import under way (targetMu held by it):
	// a lease that advances stops it. pending is the epoch an UpdateLease
	// is writing down: imports take nothing older meanwhile.
	importCancel context.CancelFunc
	pending      ha.Epoch

	// targetMu serializes what this edge applies from its peer
	// (ImportFlows, ImportFlowDelta), so that a cursor moves only past
	// what was applied; leaseMu serializes UpdateLease. Each is taken
	// before mu.
	targetMu sync.Mutex
	leaseMu  sync.Mutex

	drainer *ha.Drainer
	cancel  context.CancelFunc
	done    chan struct{}
}

// leaseFile is the lease kept next to the catalog.
type leaseFile struct {
	Epoch        ha.Epoch `json:"epoch"`
	SupersededBy ha.Epoch `json:"superseded_by,omitempty"`
}

// newHASync loads the lease kept next to the catalog (a newer one than
// the options' wins) and returns the state; nil when HA is off.
func newHASync(o Options) (*haSync, error) {
	if o.HA.Epoch == 0 {
		return nil, nil
	}
	h := &haSync{interval: o.HA.Interval, jopts: ha.JournalOptions{MaxOps: o.HA.JournalMaxOps}, epoch: o.HA.Epoch,
		journals: map[string]*ha.Journal{}, sids: map[uint32]string{}, cursors: map[string]ha.Cursor{}, unknown: map[uint32]uint64{}}
	if o.CatalogPath != "" {
		h.leasePath = o.CatalogPath + LeaseFileSuffix
		data, err := os.ReadFile(h.leasePath)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return nil, fmt.Errorf("ha lease: %w", err)
		default:
			var lf leaseFile
			if err := json.Unmarshal(data, &lf); err != nil {
				return nil, fmt.Errorf("ha lease %s: %w", h.leasePath, err)
			}
			h.epoch = max(h.epoch, lf.Epoch)
			if lf.SupersededBy > h.epoch {
				h.fencedBy = lf.SupersededBy
			}
		}
	}
	return h, nil
}

// saveLease keeps a lease next to the catalog. A failure to sync the
// directory after the rename is only logged: the new file is in place.
func (h *haSync) saveLease(lf leaseFile, log *slog.Logger) error {
	if h.leasePath == "" {
		return nil
	}
	data, _ := json.Marshal(lf)
	err := atomicfile.Write(h.leasePath, data, 0o600)
	if dse := (*atomicfile.DirSyncError)(nil); errors.As(err, &dse) {
		log.Warn("fluxvm: HA lease written, but its directory was not synced: a power loss may bring back the previous lease", "err", err)
		return nil
	}
	return err
}

// journal returns service's journal, created under the current lease.
// h.mu held.
func (h *haSync) journal(service string) (*ha.Journal, error) {
	if j := h.journals[service]; j != nil {
		return j, nil
	}
	j, err := ha.NewJournal(service, h.epoch, h.jopts)
	if err != nil {
		return nil, err
	}
	if h.fencedBy > h.epoch {
		j.Fence(h.fencedBy)
	}
	h.journals[service] = j
	return j, nil
}

// lookup is the journal of datapath service sid; known false when no
// service has the id as of the last syncHA. h.mu held.
func (h *haSync) lookup(sid uint32) (j *ha.Journal, known bool) {
	name, ok := h.sids[sid]
	if !ok {
		return nil, false
	}
	j, err := h.journal(name)
	if err != nil {
		return nil, true
	}
	return j, true
}

// haJournalOf is the journal of datapath service sid, for the drainer
// and GC; nil for an id no service has (a record of a service removed
// meanwhile: dropped with it, counted). A frontend goes live in the
// datapath before its apply ends and syncHA names its service, so an
// unknown id first waits for the change in progress (d.mu), once per
// syncHA.
func (d *Dataplane) haJournalOf(sid uint32) *ha.Journal {
	h := d.ha
	h.mu.Lock()
	j, known := h.lookup(sid)
	if known {
		h.mu.Unlock()
		return j
	}
	if gen, seen := h.unknown[sid]; seen && gen == h.syncGen {
		h.unresolved++
		h.mu.Unlock()
		return nil
	}
	h.mu.Unlock()
	d.mu.Lock() // the apply in progress ends, with its syncHA
	d.mu.Unlock()
	h.mu.Lock()
	defer h.mu.Unlock()
	if j, known = h.lookup(sid); !known {
		if len(h.unknown) >= maxUnknownSIDs {
			clear(h.unknown)
		}
		h.unknown[sid] = h.syncGen
		h.unresolved++
	}
	return j
}

// maxUnknownSIDs bounds the negative cache of haJournalOf.
const maxUnknownSIDs = 4096

// syncHA gives the replication state the services' datapath ids after a
// change, and drops the journals of services gone. d.mu held.
func (d *Dataplane) syncHA() {
	h := d.ha
	if h == nil {
		return
	}
	sids := make(map[uint32]string, len(d.services))
	for name, s := range d.services {
		for _, fe := range s.frontends {
			if fe.live {
				sids[fe.sid] = name
			}
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.sids = sids
	h.syncGen++
	clear(h.unknown)
	for name := range h.journals {
		if d.services[name] == nil {
			delete(h.journals, name)
		}
	}
	for name := range h.cursors {
		if d.services[name] == nil {
			delete(h.cursors, name)
		}
	}
}

// haRemoved journals a flow GC removed (conntrack.Config.Removed): the
// north-south kinds, which are what a standby edge holds.
func (d *Dataplane) haRemoved(k conntrack.Key, sid uint32, kind conntrack.Kind) {
	h := d.ha
	if h == nil || (kind != conntrack.SNAT && kind != conntrack.DSR) {
		return
	}
	if j := d.haJournalOf(sid); j != nil && j.Record(ha.Op{Kind: ha.OpDelete, Key: k}) == nil {
		h.mu.Lock()
		h.gcDeletes++
		h.mu.Unlock()
	}
}

// startHA starts draining the mutation queue and sealing the journals.
func (d *Dataplane) startHA() error {
	h := d.ha
	if h == nil {
		return nil
	}
	m := d.dp.Maps()
	dr, err := ha.NewDrainer(ha.DrainerConfig{Queue: m.FluxvmHaq, Drops: m.FluxvmHadrop, Journal: d.haJournalOf})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.drainer, h.cancel, h.done = dr, cancel, make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := dr.Run(ctx); err != nil && ctx.Err() == nil {
			d.log.Error("fluxvm: HA mutation queue: the drainer stopped; the snapshot-diff alone replicates now", "err", err)
		}
	}()
	go func() {
		defer close(h.done)
		t := time.NewTicker(h.interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				wg.Wait()
				return
			case <-t.C:
				h.sealAll()
			}
		}
	}()
	d.log.Info("fluxvm: HA replication on", "epoch", h.epoch, "superseded_by", h.fencedBy, "interval", h.interval)
	return nil
}

// sealAll seals every journal's open batch: what standbys can pull.
func (h *haSync) sealAll() {
	h.mu.Lock()
	js := make([]*ha.Journal, 0, len(h.journals))
	for _, j := range h.journals {
		js = append(js, j)
	}
	h.mu.Unlock()
	for _, j := range js {
		j.Seal()
	}
}

// stopHA stops the drainer and the sealer. Call it after markClosed,
// without mu.
func (d *Dataplane) stopHA() {
	h := d.ha
	if h == nil || h.cancel == nil {
		return
	}
	h.cancel()
	<-h.done
	h.drainer.Close()
}

// haOn returns the replication state, or an error wrapping
// ErrPrerequisite that names ha_epoch when HA is off.
func (d *Dataplane) haOn(what string) (*haSync, error) {
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

// floor is the oldest epoch this edge takes data of for service: the
// newest it accepted from its peer, or its own lease when newer. h.mu
// held.
func (h *haSync) floor(service string) ha.Epoch {
	return max(h.cursors[service].Epoch, h.epoch, h.pending)
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

// FlowDelta returns the batches of service's journal after the cursor
// (req.Journal, req.Seq) a standby holds, at most req.MaxOps ops but at
// least one batch (ha.Journal.Since): or ResetRequired when the journal
// cannot continue it (another incarnation, none yet, or history acked or
// dropped since), and the standby loads a snapshot (ExportFlows). A
// superseded edge serves nothing (ha.ErrFenced). A ctx that ended before
// the read fails with an error wrapping ctx's, and no journal is made for
// the service.
func (r HA) FlowDelta(ctx context.Context, service string, req FlowDeltaRequest) (ha.Delta, error) {
	d := r.d
	if err := d.begin(ctx, "flow delta"); err != nil {
		return ha.Delta{}, err
	}
	_, j, err := d.sourceJournal(ctx, "flow delta of", service)
	if err != nil {
		return ha.Delta{}, err
	}
	delta, err := j.Since(req.Seq, req.Journal, req.MaxOps)
	if err != nil {
		return ha.Delta{}, fmt.Errorf("fluxvm: flow delta of %s: %w", service, err)
	}
	return delta, nil
}

// AckFlowDelta trims service's journal up to seq: the control plane
// passes the minimum cursor its standbys replicated. An ack past the last
// sealed batch wraps ha.ErrCursorAhead. A ctx that ended before the trim
// fails with an error wrapping ctx's and trims nothing.
func (r HA) AckFlowDelta(ctx context.Context, service string, seq uint64) (ha.JournalStats, error) {
	d := r.d
	if err := d.begin(ctx, "ack flow delta"); err != nil {
		return ha.JournalStats{}, err
	}
	_, j, err := d.sourceJournal(ctx, "ack flow delta of", service)
	if err != nil {
		return ha.JournalStats{}, err
	}
	if err := ctxErr(ctx, "ack flow delta of "+service); err != nil {
		return j.Stats(), err
	}
	if err := j.Ack(seq); err != nil {
		return j.Stats(), fmt.Errorf("fluxvm: ack flow delta of %s: %w", service, err)
	}
	return j.Stats(), nil
}

// sourceJournal is service's journal on this edge (created when the
// service has none yet).
func (d *Dataplane) sourceJournal(ctx context.Context, what, service string) (*haSync, *ha.Journal, error) {
	h, err := d.haOn(what + " " + service)
	if err != nil {
		return nil, nil, err
	}
	d.mu.Lock()
	_, ok := d.services[service]
	d.mu.Unlock()
	if !ok {
		return nil, nil, fmt.Errorf("fluxvm: %s %q: no such service: %w", what, service, ErrNotFound)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	// Cancelled while it waited for the locks: no journal is made.
	if err := ctxErr(ctx, what+" "+service); err != nil {
		return nil, nil, err
	}
	j, err := h.journal(service)
	if err != nil {
		return nil, nil, fmt.Errorf("fluxvm: %s %s: %w", what, service, err)
	}
	return h, j, nil
}

// ImportFlowDelta applies a delta of service's journal on its peer (what
// FlowDelta there returned) to this edge, after checking that it
// continues this edge's cursor: an error wrapping ha.ErrStaleEpoch (data
// of an epoch older than the newest this edge accepted or its own
// lease), ha.ErrResetRequired (load a snapshot: ImportFlows) or ha.ErrGap
// changes nothing. Deltas are applied one at a time. A ctx that ended
// before the delta is applied (on entry, or while the call waited for
// another import) applies nothing, moves no cursor and fails with an
// error wrapping ctx's; one that ends while the batches are applied stops
// the apply at its next op (ha.Apply), keeping the cursor where it was.
func (r HA) ImportFlowDelta(ctx context.Context, service string, delta ha.Delta) (HADeltaResult, error) {
	d := r.d
	if err := d.begin(ctx, "import flow delta"); err != nil {
		return HADeltaResult{}, err
	}
	h, err := d.haOn("import flow delta of " + service)
	if err != nil {
		return HADeltaResult{}, err
	}
	ctx, done, err := d.haBegin(ctx, "import flow delta of "+service)
	if err != nil {
		return HADeltaResult{}, err
	}
	// Writes into the flow maps: not while a compaction replaces them.
	d.flowMu.RLock()
	defer d.flowMu.RUnlock()
	defer done()
	t, err := d.haTarget("import flow delta of", service, false)
	if err != nil {
		return HADeltaResult{}, err
	}
	ctx, end := h.beginImport(ctx)
	defer end()
	// Cancelled while it waited for another import: nothing applied.
	if err := ctxErr(ctx, "import flow delta of "+service); err != nil {
		return HADeltaResult{}, err
	}
	h.mu.Lock()
	c := h.cursors[service]
	check := c
	check.Epoch = h.floor(service)
	h.mu.Unlock()
	if err := check.Check(delta); err != nil {
		return HADeltaResult{Cursor: c}, fmt.Errorf("fluxvm: import flow delta of %s: %w", service, err)
	}
	res, err := ha.Apply(ctx, delta, t)
	if err != nil {
		return HADeltaResult{Cursor: c, Applied: res}, fmt.Errorf("fluxvm: import flow delta of %s: %w", service, err)
	}
	c.Advance(delta)
	if err := d.setCursor(service, c); err != nil {
		return HADeltaResult{Cursor: c, Applied: res}, fmt.Errorf("fluxvm: import flow delta of %s: %w", service, err)
	}
	return HADeltaResult{Cursor: c, Applied: res}, nil
}

// beginImport takes targetMu for an import and makes ctx cancellable by
// a lease that advances (UpdateLease): the edge is then the active, and
// what its old active sends is stale. end releases both.
func (h *haSync) beginImport(ctx context.Context) (context.Context, func()) {
	h.targetMu.Lock()
	ctx, cancel := context.WithCancel(ctx)
	h.mu.Lock()
	h.importCancel = cancel
	h.mu.Unlock()
	return ctx, func() {
		h.mu.Lock()
		h.importCancel = nil
		h.mu.Unlock()
		cancel()
		h.targetMu.Unlock()
	}
}

// setCursor stores service's cursor after an import, unless the service
// went away meanwhile (its cursor must not outlive it: a service applied
// again under the name starts from a snapshot) or the edge's lease
// advanced past the data's epoch meanwhile.
func (d *Dataplane) setCursor(service string, c ha.Cursor) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.services[service] == nil {
		return fmt.Errorf("the service was deleted meanwhile: %w", ErrNotFound)
	}
	h := d.ha
	h.mu.Lock()
	defer h.mu.Unlock()
	if e := max(h.epoch, h.pending); c.Epoch < e {
		return fmt.Errorf("data of epoch %d, the edge's lease advanced to %d meanwhile: %w", c.Epoch, e, ha.ErrStaleEpoch)
	}
	h.cursors[service] = c
	return nil
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

// UpdateLease records what the control plane says about leases (see
// HALease) and keeps it next to the catalog, so that a restart does not
// go back to an older ha_epoch. Nothing changes when the update is
// refused. A lease that advances cancels an import from the peer under
// way (it is the edge's old active's: it stops at its next chunk or
// batch, before a snapshot-diff's deletes, and moves no cursor) and
// forgets the edge's cursors: as the active, it applies nobody's
// journal, and should it be a standby again it resyncs from a snapshot.
//
// A ctx that ended before the update takes effect (on entry, or while
// the call waited for another lease update) changes nothing and fails
// with an error wrapping ctx's. Past that point (the import under way
// cancelled, the lease file written) the call finishes, whatever ctx
// says: a lease half recorded would leave the edge's epoch and its
// journals disagreeing.
func (r HA) UpdateLease(ctx context.Context, l HALease) (HAStatus, error) {
	d := r.d
	if err := d.begin(ctx, "update lease"); err != nil {
		return HAStatus{}, err
	}
	h, err := d.haOn("update lease")
	if err != nil {
		return HAStatus{}, err
	}
	if l.Epoch == 0 && l.SupersededBy == 0 {
		return HAStatus{}, verr(ErrInvalid, "lease", "neither an epoch nor a superseding epoch")
	}
	h.leaseMu.Lock()
	defer h.leaseMu.Unlock()
	// Cancelled while it waited for another update: nothing changed.
	if err := ctxErr(ctx, "update lease"); err != nil {
		return HAStatus{}, err
	}
	h.mu.Lock()
	prevEpoch, prevFenced := h.epoch, h.fencedBy
	if l.Epoch != 0 && l.Epoch < prevEpoch {
		h.mu.Unlock()
		return HAStatus{}, fmt.Errorf("fluxvm: update lease: epoch %d, this edge holds %d: %w", l.Epoch, prevEpoch, ha.ErrStaleEpoch)
	}
	epoch, fenced := prevEpoch, prevFenced
	if l.Epoch != 0 {
		epoch = l.Epoch
		if epoch > fenced {
			fenced = 0
		}
	}
	if l.SupersededBy > epoch {
		fenced = max(fenced, l.SupersededBy)
	}
	advanced := epoch > prevEpoch
	if advanced {
		h.pending = epoch
		if h.importCancel != nil {
			h.importCancel()
		}
	}
	h.mu.Unlock()
	if epoch == prevEpoch && fenced == prevFenced {
		return r.Status(), nil
	}
	if err := h.saveLease(leaseFile{Epoch: epoch, SupersededBy: fenced}, d.log); err != nil {
		h.mu.Lock()
		h.pending = 0
		h.mu.Unlock()
		return HAStatus{}, fmt.Errorf("fluxvm: update lease: %w", err)
	}
	h.mu.Lock()
	h.epoch, h.fencedBy, h.pending = epoch, fenced, 0
	if advanced {
		clear(h.cursors)
	}
	for name, j := range h.journals {
		// Fence first: Renew past the fencing epoch then starts a new
		// incarnation, as a takeover by another edge requires.
		if fenced != 0 {
			j.Fence(fenced)
		}
		if err := j.Renew(epoch); err != nil {
			d.log.Warn("fluxvm: HA lease: journal renew failed; it is dropped, its standby resyncs", "service", name, "err", err)
			delete(h.journals, name)
		}
	}
	h.mu.Unlock()
	d.log.Info("fluxvm: HA lease updated", "epoch", epoch, "previous_epoch", prevEpoch, "superseded_by", fenced)
	return r.Status(), nil
}

// Status reports flow-state replication (Enabled false when it is off,
// and the zero HAStatus on a Dataplane Open did not make). It reads no
// kernel state and takes no context.
func (r HA) Status() HAStatus {
	d := r.d
	if d.unopened() {
		return HAStatus{}
	}
	h := d.ha
	if h == nil {
		return HAStatus{}
	}
	st := HAStatus{Enabled: true, Interval: Duration{Duration: h.interval}}
	if h.drainer != nil {
		st.Queue.Read, st.Queue.Skipped, st.Queue.Dropped, _ = h.drainer.Stats()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	st.Epoch, st.SupersededBy, st.GCDeletes = h.epoch, h.fencedBy, h.gcDeletes
	st.Queue.Skipped += h.unresolved // records of flows no service has
	if len(h.journals) > 0 {
		st.Journals = make(map[string]ha.JournalStats, len(h.journals))
		for name, j := range h.journals {
			st.Journals[name] = j.Stats()
		}
	}
	if len(h.cursors) > 0 {
		st.Cursors = make(map[string]ha.Cursor, len(h.cursors))
		for name, c := range h.cursors {
			st.Cursors[name] = c
		}
	}
	return st
}

// haMetaFlags sets or clears the datapath's HA flag.
func haMetaFlags(m *bpf.Meta, on bool) {
	if on {
		m.Flags |= bpf.MetaFlagHA
	} else {
		m.Flags &^= bpf.MetaFlagHA
	}
}
