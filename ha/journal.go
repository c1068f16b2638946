package ha

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
)

// Errors of the journal and its cursors. Every error this file returns
// wraps one of them, so that a caller decides with errors.Is what to do
// next (retry, snapshot, stop serving) without reading messages.
var (
	// ErrNoEpoch: epoch 0, which no lease ever is. Data without an epoch
	// cannot be fenced, so it is refused everywhere.
	ErrNoEpoch = errors.New("no epoch")
	// ErrFenced: another edge holds a newer lease than this journal's, so
	// it must neither take nor serve changes: a partitioned old active
	// would otherwise overwrite the new one's flows on the standby.
	ErrFenced = errors.New("fenced by a newer epoch")
	// ErrStaleEpoch: data or a lease older than the newest already
	// accepted; taking it would let a superseded active win.
	ErrStaleEpoch = errors.New("stale epoch")
	// ErrResetRequired: the deltas cannot continue the target's state
	// (another journal incarnation, or history it needs is gone); the
	// target must load a full snapshot and reset its cursor.
	ErrResetRequired = errors.New("reset required")
	// ErrGap: a delta does not continue the target's cursor contiguously;
	// applying it would silently lose or repeat changes.
	ErrGap = errors.New("sequence gap")
	// ErrCursorAhead: a cursor names a batch the journal never sealed:
	// the caller confused journals or lost track of what it acked.
	ErrCursorAhead = errors.New("cursor ahead of the journal")
	// ErrInvalidOp: an op no target could apply (unknown kind, upsert
	// without a flow, no key); refused when recorded so that it never
	// reaches a standby.
	ErrInvalidOp = errors.New("invalid op")
)

// Default bounds of a Journal.
const (
	// DefaultMaxOps bounds the history a journal keeps for targets that
	// have not acked yet.
	DefaultMaxOps = 65536
	// DefaultMaxBatchOps bounds one batch, so that a burst of changes
	// within one replication interval is still served in bites.
	DefaultMaxBatchOps = 1024
)

// JournalOptions bounds a Journal's memory. Zero values take the defaults.
type JournalOptions struct {
	// MaxOps bounds the ops kept over all sealed batches not yet acked;
	// beyond it the oldest batches are dropped and targets still behind
	// them must resync from a snapshot. 0: DefaultMaxOps.
	MaxOps int
	// MaxBatchOps is how many ops a batch takes before it seals itself.
	// It may not exceed MaxOps (a batch bigger than the whole history
	// would be dropped as soon as sealed). 0: DefaultMaxBatchOps, or
	// MaxOps when that is smaller.
	MaxBatchOps int
}

// Batch is a sealed group of ops, the unit a target applies and
// acknowledges. Seqs are contiguous from 1 within a journal, which is what
// lets a target detect a lost batch.
type Batch struct {
	Seq uint64 `json:"seq"`
	// Epoch is the lease epoch under which the ops were recorded.
	Epoch Epoch `json:"epoch"`
	// Ops are applied in order. They (and the flows they point to) are
	// shared with the journal and other targets: read them, never modify
	// them.
	Ops []Op `json:"ops"`
}

// Delta is what a target pulls from a journal: the batches after its
// cursor, or the word that it must resync from a snapshot.
type Delta struct {
	Service string `json:"service"`
	// Node is the source edge's name (its node_name), when it has one:
	// what a group edge, which follows several sources, keeps a cursor
	// of this journal under. Journal.Since leaves it empty; the node
	// serving the delta fills it.
	Node string `json:"node,omitempty"`
	// Journal is the journal incarnation the batches belong to; a target
	// whose cursor names another must resync.
	Journal string `json:"journal"`
	// Epoch is the source's lease epoch when it served the delta.
	Epoch Epoch `json:"epoch"`
	// From is the cursor the delta continues; To the seq of its last
	// batch (From when there is nothing new).
	From uint64 `json:"from"`
	To   uint64 `json:"to"`
	// Batches are From+1..To, whole.
	Batches []Batch `json:"batches,omitempty"`
	// ResetRequired: the journal cannot continue the cursor (another
	// incarnation, or batches after it were dropped or acked away); the
	// target must load a full snapshot (taken after Journal.Checkpoint)
	// and reset its cursor.
	ResetRequired bool `json:"reset_required,omitempty"`
}

// JournalStats is a journal's state for metrics and status: how much
// history it holds, how far targets have acked, and whether targets have
// been forced to resync by the bound.
type JournalStats struct {
	Journal string `json:"journal"`
	Epoch   Epoch  `json:"epoch"`
	Fenced  bool   `json:"fenced,omitempty"`
	// FirstSeq is the oldest kept batch (0 when none is kept), LastSeq the
	// newest sealed one, Acked the newest seq acknowledged.
	FirstSeq uint64 `json:"first_seq"`
	LastSeq  uint64 `json:"last_seq"`
	Acked    uint64 `json:"acked"`
	// Batches and Ops are the kept sealed history; OpenOps what waits for
	// the next seal.
	Batches int `json:"batches"`
	Ops     int `json:"ops"`
	OpenOps int `json:"open_ops"`
	// DroppedBatches and DroppedOps count history dropped by MaxOps before
	// it was acked: each is a target forced to resync.
	DroppedBatches uint64 `json:"dropped_batches"`
	DroppedOps     uint64 `json:"dropped_ops"`
}

// Journal is the source side of a service's flow replication: it collects
// the ops an edge applies, seals them into sequenced batches once per
// replication interval, and keeps them until Fabric acks that every target
// has them, within a memory bound. It is safe for concurrent use.
type Journal struct {
	service     string
	maxOps      int
	maxBatchOps int

	mu     sync.Mutex
	id     string
	epoch  Epoch
	fenced bool
	fence  Epoch // the newest epoch that fenced it; Renew must pass it
	// batches are the kept sealed batches, base+1..last: base+len == last.
	batches []Batch
	base    uint64 // seq of the newest batch no longer kept
	last    uint64 // seq of the newest sealed batch
	acked   uint64
	ops     int // ops over batches
	open    []Op

	droppedBatches, droppedOps uint64
}

// NewJournal returns an empty journal for service under the lease epoch
// Fabric gave this edge. Its incarnation ID is random, so that a target
// holding a cursor of an earlier incarnation (the source restarted and
// lost its history) is told to resync instead of reading seqs that now
// mean other batches.
func NewJournal(service string, epoch Epoch, opts JournalOptions) (*Journal, error) {
	if service == "" {
		return nil, errors.New("ha: journal: no service")
	}
	if epoch == 0 {
		return nil, fmt.Errorf("ha: journal %s: %w", service, ErrNoEpoch)
	}
	if opts.MaxOps < 0 || opts.MaxBatchOps < 0 {
		return nil, fmt.Errorf("ha: journal %s: negative bound (max ops %d, max batch ops %d)", service, opts.MaxOps, opts.MaxBatchOps)
	}
	if opts.MaxOps == 0 {
		opts.MaxOps = DefaultMaxOps
	}
	if opts.MaxBatchOps == 0 {
		opts.MaxBatchOps = min(DefaultMaxBatchOps, opts.MaxOps)
	}
	if opts.MaxBatchOps > opts.MaxOps {
		return nil, fmt.Errorf("ha: journal %s: max batch ops %d exceed max ops %d", service, opts.MaxBatchOps, opts.MaxOps)
	}
	id, err := newJournalID()
	if err != nil {
		return nil, fmt.Errorf("ha: journal %s: %w", service, err)
	}
	return &Journal{service: service, maxOps: opts.MaxOps, maxBatchOps: opts.MaxBatchOps, id: id, epoch: epoch}, nil
}

func newJournalID() (string, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("incarnation id: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// ID is the journal's incarnation: cursors of any other are reset.
func (j *Journal) ID() string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.id
}

// Service is the service whose flows the journal carries.
func (j *Journal) Service() string { return j.service }

func (j *Journal) errorf(format string, args ...any) error {
	return fmt.Errorf("ha: journal %s/%s: "+format, append([]any{j.service, j.id}, args...)...)
}

// validOp tells why no target could apply op, or nil.
func validOp(op *Op) error {
	switch op.Kind {
	case OpUpsert:
		if op.Flow == nil {
			return fmt.Errorf("%w: upsert without a flow", ErrInvalidOp)
		}
		if !op.Flow.Client.IsValid() || !op.Flow.VIP.IsValid() {
			return fmt.Errorf("%w: upsert of %s: no client or VIP", ErrInvalidOp, op.Flow.Key())
		}
	case OpDelete:
		if !op.Key.Client.IsValid() || !op.Key.VIP.IsValid() {
			return fmt.Errorf("%w: delete of %s: no client or VIP", ErrInvalidOp, op.Key)
		}
	default:
		return fmt.Errorf("%w: %s", ErrInvalidOp, op.Kind)
	}
	return nil
}

// Record appends ops to the open batch, sealing it each time it reaches
// MaxBatchOps. Either all ops are taken or none (an invalid op, or a
// fenced journal: a superseded active must not produce changes a target
// could mistake for current). Upserted flows are copied, so the caller
// may reuse its Flow values.
func (j *Journal) Record(ops ...Op) error {
	for i := range ops {
		if err := validOp(&ops[i]); err != nil {
			return fmt.Errorf("ha: journal %s: record: op %d: %w", j.service, i, err)
		}
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.fenced {
		return j.errorf("record: epoch %d, fenced by %d: %w", j.epoch, j.fence, ErrFenced)
	}
	for _, op := range ops {
		if op.Kind == OpUpsert {
			f := *op.Flow
			if f.NAT != nil {
				nat := *f.NAT
				f.NAT = &nat
			}
			op.Flow = &f
			op.Key = f.Key() // one name per op, whatever the caller set
		} else {
			op.Flow = nil
		}
		j.open = append(j.open, op)
		if len(j.open) >= j.maxBatchOps {
			j.sealLocked()
		}
	}
	return nil
}

// Seal closes the open batch, if it has ops, so targets can pull it. The
// caller's replication interval calls it: what it bounds is how much a
// failover can lose.
func (j *Journal) Seal() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.sealLocked()
}

func (j *Journal) sealLocked() {
	if len(j.open) == 0 {
		return
	}
	j.last++
	b := Batch{Seq: j.last, Epoch: j.epoch, Ops: j.open}
	j.open = nil
	j.batches = append(j.batches, b)
	j.ops += len(b.Ops)
	// Drop the oldest history beyond the bound. The newest batch always
	// stays: MaxBatchOps <= MaxOps.
	n := 0
	for j.ops > j.maxOps && n < len(j.batches)-1 {
		j.ops -= len(j.batches[n].Ops)
		j.droppedBatches++
		j.droppedOps += uint64(len(j.batches[n].Ops))
		n++
	}
	j.trimLocked(n)
}

// trimLocked forgets the n oldest kept batches, releasing their ops; the
// caller accounts for j.ops.
func (j *Journal) trimLocked(n int) {
	if n == 0 {
		return
	}
	for i := range n {
		j.batches[i] = Batch{} // the array outlives the reslice
	}
	j.base += uint64(n)
	j.batches = j.batches[n:]
	if len(j.batches) == 0 {
		j.batches = nil
	}
}

// Since returns the sealed batches after cursor of journal journalID,
// whole, at most maxOps ops but at least one batch (maxOps <= 0: no
// limit). When the journal cannot continue the cursor, because it names
// another incarnation (or none: a target with no state yet, which must
// load a snapshot first, since flows older than the journal are in no
// batch) or batches after it are gone, the delta says ResetRequired and
// carries nothing.
func (j *Journal) Since(cursor uint64, journalID string, maxOps int) (Delta, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.fenced {
		return Delta{}, j.errorf("since %d: epoch %d, fenced by %d: %w", cursor, j.epoch, j.fence, ErrFenced)
	}
	d := Delta{Service: j.service, Journal: j.id, Epoch: j.epoch, From: cursor, To: cursor}
	if journalID != j.id {
		d.ResetRequired = true
		return d, nil
	}
	if cursor > j.last {
		return Delta{}, j.errorf("since %d: last seq %d: %w", cursor, j.last, ErrCursorAhead)
	}
	if cursor < j.base {
		d.ResetRequired = true
		return d, nil
	}
	ops := 0
	for _, b := range j.batches[cursor-j.base:] {
		if maxOps > 0 && len(d.Batches) > 0 && ops+len(b.Ops) > maxOps {
			break
		}
		ops += len(b.Ops)
		// A copy of the op list, so that a careless target cannot rewrite
		// the history other targets read.
		b.Ops = append([]Op(nil), b.Ops...)
		d.Batches = append(d.Batches, b)
		d.To = b.Seq
	}
	return d, nil
}

// Checkpoint seals the open batch and returns the cursor a target must
// reset to after loading a snapshot taken after this call. Replaying the
// batches after it over such a snapshot is exact, because every op sets a
// flow's whole state: ops the snapshot already reflects are rewritten by
// the same or a later value.
func (j *Journal) Checkpoint() (Cursor, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.fenced {
		return Cursor{}, j.errorf("checkpoint: epoch %d, fenced by %d: %w", j.epoch, j.fence, ErrFenced)
	}
	j.sealLocked()
	return Cursor{Journal: j.id, Seq: j.last, Epoch: j.epoch}, nil
}

// Ack forgets the batches up to cursor: Fabric passes the minimum cursor
// its targets replicated, so nothing a target still needs is trimmed.
// Going backwards is a no-op (acks may arrive out of order); a cursor
// beyond the last sealed batch is an error.
func (j *Journal) Ack(cursor uint64) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if cursor > j.last {
		return j.errorf("ack %d: last seq %d: %w", cursor, j.last, ErrCursorAhead)
	}
	if cursor <= j.acked {
		return nil
	}
	j.acked = cursor
	if cursor <= j.base {
		return nil
	}
	n := int(cursor - j.base)
	for _, b := range j.batches[:n] {
		j.ops -= len(b.Ops)
	}
	j.trimLocked(n)
	return nil
}

// Fence tells the journal that another edge holds the newer lease epoch
// newer: if it is newer than the journal's, the journal refuses to record
// and serve until Renew gives this edge a still newer lease. An older or
// equal newer is a stale notice and ignored.
func (j *Journal) Fence(newer Epoch) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if newer <= j.epoch {
		return
	}
	j.fenced = true
	j.fence = max(j.fence, newer)
}

// Renew records that Fabric renewed or advanced this edge's lease to e,
// which cannot be older than the journal's epoch. Batches sealed from now
// on carry e; the open batch is sealed first, so each batch carries the
// lease its ops were recorded under. When e is newer than the epoch that
// fenced the journal, the journal serves again, as a new incarnation with
// no history: another edge was active meanwhile, so no target's state can
// be continued by deltas from before and each must resync from a
// snapshot.
func (j *Journal) Renew(e Epoch) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if e == 0 {
		return j.errorf("renew: %w", ErrNoEpoch)
	}
	if e < j.epoch {
		return j.errorf("renew %d: epoch %d: %w", e, j.epoch, ErrStaleEpoch)
	}
	if e == j.epoch {
		return nil
	}
	if j.fenced && e > j.fence {
		id, err := newJournalID()
		if err != nil {
			return j.errorf("renew %d: %w", e, err)
		}
		// Seqs go on from the old incarnation's, so that an ack computed
		// from its cursors cannot trim the new one's batches.
		j.id = id
		j.open = nil
		j.trimLocked(len(j.batches))
		j.ops = 0
		j.acked = j.last
		j.fenced = false
		j.epoch = e
		return nil
	}
	j.sealLocked()
	j.epoch = e
	return nil
}

// Stats returns the journal's state.
func (j *Journal) Stats() JournalStats {
	j.mu.Lock()
	defer j.mu.Unlock()
	s := JournalStats{
		Journal: j.id, Epoch: j.epoch, Fenced: j.fenced,
		LastSeq: j.last, Acked: j.acked,
		Batches: len(j.batches), Ops: j.ops, OpenOps: len(j.open),
		DroppedBatches: j.droppedBatches, DroppedOps: j.droppedOps,
	}
	if len(j.batches) > 0 {
		s.FirstSeq = j.batches[0].Seq
	}
	return s
}

// Cursor is a target's position in a source's journal: which incarnation,
// the last batch applied, and the newest epoch accepted (the fence a
// superseded active's data meets). A target persists it with the flows it
// applied.
type Cursor struct {
	Journal string `json:"journal"`
	Seq     uint64 `json:"seq"`
	Epoch   Epoch  `json:"epoch"`
}

// Check tells whether d continues c and may be applied, without changing
// c: ErrStaleEpoch for data of an epoch older than c's, ErrResetRequired
// when the target must resync from a snapshot, ErrGap when batches are
// missing or out of order, ErrInvalidOp for an op no target could apply.
// Check before applying, Advance after.
func (c *Cursor) Check(d Delta) error {
	if d.Epoch == 0 {
		return fmt.Errorf("ha: cursor %s/%d: delta of %s: %w", c.Journal, c.Seq, d.Journal, ErrNoEpoch)
	}
	if d.Epoch < c.Epoch {
		return fmt.Errorf("ha: cursor %s/%d: delta of %s at epoch %d, accepted %d: %w", c.Journal, c.Seq, d.Journal, d.Epoch, c.Epoch, ErrStaleEpoch)
	}
	if d.ResetRequired {
		return fmt.Errorf("ha: cursor %s/%d: journal %s: %w", c.Journal, c.Seq, d.Journal, ErrResetRequired)
	}
	// A cursor of no journal holds no state a delta could continue: the
	// flows older than any journal are in no batch, so the target loads a
	// snapshot first (Reset), whatever seq the delta starts at.
	if d.Journal == "" || c.Journal == "" || d.Journal != c.Journal {
		return fmt.Errorf("ha: cursor %s/%d: delta of journal %q: %w", c.Journal, c.Seq, d.Journal, ErrResetRequired)
	}
	if d.From != c.Seq {
		return fmt.Errorf("ha: cursor %s/%d: delta from %d: %w", c.Journal, c.Seq, d.From, ErrGap)
	}
	if len(d.Batches) == 0 {
		if d.To != d.From {
			return fmt.Errorf("ha: cursor %s/%d: delta %d..%d without batches: %w", c.Journal, c.Seq, d.From, d.To, ErrGap)
		}
		return nil
	}
	// Fencing is the envelope's epoch (the serving journal's lease, above);
	// the batches of one incarnation carry the leases they were recorded
	// under, never decreasing, and may be older than what the cursor
	// accepted from an earlier page of the same history.
	want, prev := d.From+1, Epoch(0)
	for i := range d.Batches {
		b := &d.Batches[i]
		if b.Seq != want {
			return fmt.Errorf("ha: cursor %s/%d: batch %d where %d was due: %w", c.Journal, c.Seq, b.Seq, want, ErrGap)
		}
		if b.Epoch == 0 {
			return fmt.Errorf("ha: cursor %s/%d: batch %d: %w", c.Journal, c.Seq, b.Seq, ErrNoEpoch)
		}
		if b.Epoch < prev {
			return fmt.Errorf("ha: cursor %s/%d: batch %d at epoch %d after %d: %w", c.Journal, c.Seq, b.Seq, b.Epoch, prev, ErrStaleEpoch)
		}
		if b.Epoch > d.Epoch {
			// The source's epoch only grows, so a batch newer than the
			// delta that carries it means the delta's envelope is stale.
			return fmt.Errorf("ha: cursor %s/%d: batch %d at epoch %d in a delta at %d: %w", c.Journal, c.Seq, b.Seq, b.Epoch, d.Epoch, ErrStaleEpoch)
		}
		for k := range b.Ops {
			if err := validOp(&b.Ops[k]); err != nil {
				return fmt.Errorf("ha: cursor %s/%d: batch %d op %d: %w", c.Journal, c.Seq, b.Seq, k, err)
			}
		}
		prev = b.Epoch
		want++
	}
	if last := d.Batches[len(d.Batches)-1].Seq; last != d.To {
		return fmt.Errorf("ha: cursor %s/%d: delta to %d ends at batch %d: %w", c.Journal, c.Seq, d.To, last, ErrGap)
	}
	return nil
}

// Advance moves c past d once the caller applied its ops. It does not
// check d: call Check first.
func (c *Cursor) Advance(d Delta) {
	c.Journal = d.Journal
	c.Seq = d.To
	c.Epoch = max(c.Epoch, d.Epoch)
}

// Reset moves c to the checkpoint of a full snapshot the caller loaded
// (Journal.Checkpoint), unless the snapshot's epoch is older than the
// newest c accepted: a superseded active's snapshot must not replace the
// new one's flows.
func (c *Cursor) Reset(journal string, seq uint64, epoch Epoch) error {
	if epoch == 0 {
		return fmt.Errorf("ha: cursor %s/%d: reset to %s/%d: %w", c.Journal, c.Seq, journal, seq, ErrNoEpoch)
	}
	if epoch < c.Epoch {
		return fmt.Errorf("ha: cursor %s/%d: reset to %s/%d at epoch %d, accepted %d: %w", c.Journal, c.Seq, journal, seq, epoch, c.Epoch, ErrStaleEpoch)
	}
	if journal == "" {
		return fmt.Errorf("ha: cursor %s/%d: reset to seq %d of no journal: %w", c.Journal, c.Seq, seq, ErrResetRequired)
	}
	c.Journal, c.Seq, c.Epoch = journal, seq, epoch
	return nil
}
