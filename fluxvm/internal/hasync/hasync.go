// Package hasync is the flow-state replication component of the
// dataplane (HAOptions.Epoch, ha_epoch): the source side that records
// what the datapath learns into one ha.Journal per service, and the
// target side that follows a peer's journals.
//
// What it owns, under its own lock (mu): the journals, which follow the
// services of the catalog (Sync: a journal of a service gone is dropped,
// with its cursor); the drainer of the datapath's mutation queue
// (fluxvm_haq) and the goroutine that seals the journals every
// Config.Interval; the flows GC removed (Removed); the edge's lease, kept
// in Config.LeasePath, and the fencing it implies (UpdateLease: a newer
// epoch that supersedes this edge fences its journals, an advance renews
// them as new incarnations and forgets the cursors); and the cursors, how
// far this edge applied its peer's journal of each service (ImportDelta,
// ImportSnapshot). Two more locks order its callers: targetMu serializes
// the imports (a cursor moves only past what was applied), leaseMu the
// lease updates; each is taken before mu.
//
// What it needs from the rest of the dataplane it declares in Deps: a
// View of the services (their names and their live frontends' datapath
// ids), read only inside Sync; the opening of the mutation queue's
// drainer (NewDrainer); and Settle, which waits for a change of the
// services in progress. The imports' writes into the flow maps are the
// caller's (the apply and import funcs it passes), done with whatever
// the caller holds to keep the maps in place.
//
// Lock order: the facade may hold its own lock (d.mu) while it calls
// Sync (it must, so that the View is consistent); this component's locks
// are taken after d.mu, never before. It never calls the facade with one
// of its locks held: Settle is called with none held (from the drainer or
// GC's Removed), and the funcs an import runs with targetMu held write
// the flow maps only.
package hasync

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"iter"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/intent"
)

// Config is the component's configuration.
type Config struct {
	// Epoch is the lease epoch the control plane gave this edge; it must
	// be nonzero (a dataplane without replication makes no component). A
	// newer lease kept in LeasePath wins over it.
	Epoch ha.Epoch
	// Interval is how often the journals seal a batch; it must be
	// positive (the facade fills its default).
	Interval time.Duration
	// JournalMaxOps bounds each journal's history
	// (ha.JournalOptions.MaxOps; 0: ha.DefaultMaxOps).
	JournalMaxOps int
	// LeasePath is the file the lease is kept in; "": the lease is kept
	// in memory only.
	LeasePath string
	// Logger receives the lease changes and the drainer's failure; nil
	// discards them.
	Logger *slog.Logger
	// Group makes the edge one of a group (ha_group): every edge holds a
	// lease of its own and is a source, and each follows every other
	// edge's journals, with a cursor per service and source edge (named
	// by the deltas' and snapshots' Node). An edge's own lease then
	// fences only its own journals: it neither forgets the cursors nor
	// stops the imports when it advances, and the data of a source is
	// checked against the newest epoch taken from that source alone. Node
	// is required with it.
	Group bool
	// Node is this edge's name (node_name): data naming it is refused in
	// a group (an edge never imports itself).
	Node string
}

// ErrSource wraps the refusal of a group edge's import whose source is
// not another edge of the group: data naming no node, or this one.
var ErrSource = fmt.Errorf("%w: not another edge's data", intent.ErrInvalid)

// source is whose journal a cursor follows: the service, and in a group
// the source edge ("" for the one peer of a pair).
type source struct{ service, node string }

// View is the read-only view of the services the journals follow. Sync
// reads it in its caller's goroutine only: the caller holds whatever
// keeps it consistent.
type View interface {
	// Services yields every service's name and the datapath ids of its
	// frontends live in the datapath.
	Services() iter.Seq2[string, []uint32]
}

// Drainer reads the datapath's mutation queue into the journals
// (*ha.Drainer).
type Drainer interface {
	Run(ctx context.Context) error
	Stats() (read, skipped, dropped uint64, err error)
	Close() error
}

// Deps is what the component needs from the rest of the dataplane.
type Deps struct {
	// Services is read by Sync (required).
	Services View
	// NewDrainer opens the reader of the mutation queue, which records
	// into the journal its argument returns for a datapath service id
	// (required; called by Start).
	NewDrainer func(journal func(sid uint32) *ha.Journal) (Drainer, error)
	// Settle returns once the change of the services in progress, if
	// any, has ended (and its Sync with it): the journal of a datapath id
	// no service has yet is looked up again after it. It is called with
	// none of the component's locks held. nil: nothing to wait for.
	Settle func()
}

// Lease is what the control plane tells an edge about leases
// (UpdateLease).
type Lease struct {
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

// QueueStatus counts the mutation queue (ha.Drainer.Stats).
type QueueStatus struct {
	Read    uint64 `json:"read"`
	Skipped uint64 `json:"skipped"`
	Dropped uint64 `json:"dropped"`
}

// DeltaResult is what ImportDelta did: the target's cursor after it and
// the counts of the ops applied.
type DeltaResult struct {
	Cursor  ha.Cursor       `json:"cursor"`
	Applied ha.ImportResult `json:"applied"`
}

// Status is the state of the component.
type Status struct {
	// Epoch is the edge's lease epoch; SupersededBy the newer lease that
	// fenced it (0: not fenced).
	Epoch, SupersededBy ha.Epoch
	// Interval is how often the journals seal a batch.
	Interval time.Duration
	// Queue counts the mutation queue, its Skipped including the records
	// of datapath ids no service has; GCDeletes the flows GC removed that
	// the journals carry.
	Queue     QueueStatus
	GCDeletes uint64
	// Journals are the source side, Cursors the target side, by service;
	// in a group Sources replaces Cursors: by service, then source edge.
	Journals map[string]ha.JournalStats
	Cursors  map[string]ha.Cursor
	Sources  map[string]map[string]ha.Cursor
	// Group and Node are Config's; Joined says a group edge loaded the
	// other edges' state since it started (Join): until then it attracts
	// no traffic.
	Group  bool
	Node   string
	Joined bool
}

// Sync is the replication state of a dataplane with HA on.
type Sync struct {
	cfg   Config
	deps  Deps
	jopts ha.JournalOptions
	log   *slog.Logger

	mu        sync.Mutex
	epoch     ha.Epoch
	fencedBy  ha.Epoch
	services  map[string]bool // as of the last Sync
	journals  map[string]*ha.Journal
	sids      map[uint32]string // datapath service id -> service
	cursors   map[source]ha.Cursor
	gcDeletes uint64
	joined    bool // a group edge loaded the others' state (Join)
	// syncGen counts Sync calls; unknown remembers, per datapath id no
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
	drainer      Drainer
	cancel       context.CancelFunc
	done         chan struct{}
	closed       bool

	targetMu sync.Mutex
	leaseMu  sync.Mutex
}

// leaseFile is the lease kept in Config.LeasePath.
type leaseFile struct {
	Epoch        ha.Epoch `json:"epoch"`
	SupersededBy ha.Epoch `json:"superseded_by,omitempty"`
}

// ReadLease reads the lease kept at path; an error wrapping
// fs.ErrNotExist when there is none.
func ReadLease(path string) (Lease, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Lease{}, fmt.Errorf("ha lease: %w", err)
	}
	var lf leaseFile
	if err := json.Unmarshal(data, &lf); err != nil {
		return Lease{}, fmt.Errorf("ha lease %s: %w", path, err)
	}
	return Lease(lf), nil
}

// New validates cfg and deps and loads the lease kept in cfg.LeasePath
// (a newer one than cfg.Epoch wins). It starts nothing.
func New(cfg Config, deps Deps) (*Sync, error) {
	switch {
	case cfg.Epoch == 0:
		return nil, fmt.Errorf("hasync: %w: a lease epoch is required", intent.ErrInvalid)
	case cfg.Interval <= 0:
		return nil, fmt.Errorf("hasync: %w: the seal interval must be positive", intent.ErrInvalid)
	case deps.Services == nil || deps.NewDrainer == nil:
		return nil, fmt.Errorf("hasync: %w: the services' view and the drainer are required", intent.ErrInvalid)
	case cfg.Group && cfg.Node == "":
		return nil, fmt.Errorf("hasync: %w: a group edge needs its node name", intent.ErrInvalid)
	}
	s := &Sync{cfg: cfg, deps: deps, jopts: ha.JournalOptions{MaxOps: cfg.JournalMaxOps}, log: cfg.Logger, epoch: cfg.Epoch,
		services: map[string]bool{}, journals: map[string]*ha.Journal{}, sids: map[uint32]string{},
		cursors: map[source]ha.Cursor{}, unknown: map[uint32]uint64{}}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if cfg.LeasePath != "" {
		l, err := ReadLease(cfg.LeasePath)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return nil, err
		default:
			s.epoch = max(s.epoch, l.Epoch)
			if l.SupersededBy > s.epoch {
				s.fencedBy = l.SupersededBy
			}
		}
	}
	return s, nil
}

// Start opens the mutation queue's drainer and starts it and the sealer.
// A Sync closed or started already starts nothing.
func (s *Sync) Start() error {
	s.mu.Lock()
	if s.closed || s.cancel != nil {
		s.mu.Unlock()
		return nil
	}
	s.mu.Unlock()
	dr, err := s.deps.NewDrainer(s.journalOf)
	if err != nil {
		return fmt.Errorf("hasync: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	s.mu.Lock()
	if s.closed || s.cancel != nil { // closed, or started, while the drainer opened
		s.mu.Unlock()
		cancel()
		return dr.Close()
	}
	s.drainer, s.cancel, s.done = dr, cancel, done
	epoch, fenced := s.epoch, s.fencedBy
	s.mu.Unlock()
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := dr.Run(ctx); err != nil && ctx.Err() == nil {
			s.log.Error("fluxvm: HA mutation queue: the drainer stopped; the snapshot-diff alone replicates now", "err", err)
		}
	})
	go func() {
		defer close(done)
		t := time.NewTicker(s.cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				wg.Wait()
				return
			case <-t.C:
				s.sealAll()
			}
		}
	}()
	s.log.Info("fluxvm: HA replication on", "epoch", epoch, "superseded_by", fenced, "interval", s.cfg.Interval)
	return nil
}

// Close stops the drainer and the sealer and waits for them. It is
// idempotent.
func (s *Sync) Close() error {
	s.mu.Lock()
	already := s.closed
	s.closed = true
	cancel, done, dr := s.cancel, s.done, s.drainer
	s.mu.Unlock()
	if already || cancel == nil { // closed before, or never started
		return nil
	}
	cancel()
	<-done
	return dr.Close()
}

// sealAll seals every journal's open batch: what standbys can pull.
func (s *Sync) sealAll() {
	s.mu.Lock()
	js := make([]*ha.Journal, 0, len(s.journals))
	for _, j := range s.journals {
		js = append(js, j)
	}
	s.mu.Unlock()
	for _, j := range js {
		j.Seal()
	}
}

// journal returns service's journal, created under the current lease.
// s.mu held.
func (s *Sync) journal(service string) (*ha.Journal, error) {
	if j := s.journals[service]; j != nil {
		return j, nil
	}
	j, err := ha.NewJournal(service, s.epoch, s.jopts)
	if err != nil {
		return nil, err
	}
	if s.fencedBy > s.epoch {
		j.Fence(s.fencedBy)
	}
	s.journals[service] = j
	return j, nil
}

// lookup is the journal of datapath service sid; known false when no
// service has the id as of the last Sync. s.mu held.
func (s *Sync) lookup(sid uint32) (j *ha.Journal, known bool) {
	name, ok := s.sids[sid]
	if !ok {
		return nil, false
	}
	j, err := s.journal(name)
	if err != nil {
		return nil, true
	}
	return j, true
}

// maxUnknownSIDs bounds the negative cache of journalOf.
const maxUnknownSIDs = 4096

// journalOf is the journal of datapath service sid, for the drainer and
// GC; nil for an id no service has (a record of a service removed
// meanwhile: dropped with it, counted). A frontend goes live in the
// datapath before its apply ends and Sync names its service, so an
// unknown id first waits for the change in progress (Deps.Settle), once
// per Sync.
func (s *Sync) journalOf(sid uint32) *ha.Journal {
	s.mu.Lock()
	j, known := s.lookup(sid)
	if known {
		s.mu.Unlock()
		return j
	}
	if gen, seen := s.unknown[sid]; seen && gen == s.syncGen {
		s.unresolved++
		s.mu.Unlock()
		return nil
	}
	s.mu.Unlock()
	if s.deps.Settle != nil {
		s.deps.Settle()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if j, known = s.lookup(sid); !known {
		if len(s.unknown) >= maxUnknownSIDs {
			clear(s.unknown)
		}
		s.unknown[sid] = s.syncGen
		s.unresolved++
	}
	return j
}

// Sync reads the services (Deps.Services) after a change: the datapath
// ids the drainer and GC resolve, and the services whose journals and
// cursors are kept (those of a service gone are dropped). The caller
// holds what keeps the View consistent.
func (s *Sync) Sync() {
	sids := map[uint32]string{}
	names := map[string]bool{}
	for name, ids := range s.deps.Services.Services() {
		names[name] = true
		for _, id := range ids {
			sids[id] = name
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sids, s.services = sids, names
	s.syncGen++
	clear(s.unknown)
	for name := range s.journals {
		if !names[name] {
			delete(s.journals, name)
		}
	}
	for src := range s.cursors {
		if !names[src.service] {
			delete(s.cursors, src)
		}
	}
}

// Removed journals a flow GC removed (conntrack.Config.Removed): the
// north-south kinds, which are what a standby edge holds, with how long
// GC had not seen the flow (ha.Op.IdleMS: a target that saw it since
// keeps it).
func (s *Sync) Removed(k conntrack.Key, sid uint32, kind conntrack.Kind, idle time.Duration) {
	if kind != conntrack.SNAT && kind != conntrack.DSR {
		return
	}
	op := ha.Op{Kind: ha.OpDelete, Key: k}
	if idle > 0 {
		op.IdleMS = uint64(max(idle, time.Millisecond) / time.Millisecond)
	}
	if j := s.journalOf(sid); j != nil && j.Record(op) == nil {
		s.mu.Lock()
		s.gcDeletes++
		s.mu.Unlock()
	}
}

// SourceJournal is service's journal on this edge, created when the
// service has none yet: an error wrapping errs.ErrNotFound when no
// service has the name (as of the last Sync), and ctx's when it ended
// before (no journal is made then). Its errors do not name the service:
// the caller's context does.
func (s *Sync) SourceJournal(ctx context.Context, service string) (*ha.Journal, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.services[service] {
		return nil, fmt.Errorf("no such service: %w", errs.ErrNotFound)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return s.journal(service)
}

// Join records that the control plane loaded the other edges' state into
// this group edge since it started: it may attract traffic now. changed
// says whether it had not joined before. Outside a group it does nothing.
func (s *Sync) Join() (changed bool) {
	if !s.cfg.Group {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	changed, s.joined = !s.joined, true
	return changed
}

// Joined reports whether the edge may attract traffic: a group edge once
// it joined (Join), any other edge always.
func (s *Sync) Joined() bool {
	if !s.cfg.Group {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.joined
}
