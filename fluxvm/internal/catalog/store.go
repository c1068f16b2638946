package catalog

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"

	"github.com/fluxvm/servicefabric/internal/atomicfile"
)

// DefaultCompactMinBytes is the journal size below which no compaction
// starts, when Config.CompactMinBytes is 0.
const DefaultCompactMinBytes = 1 << 20

// ErrClosed reports a change appended to a Store that was closed.
var ErrClosed = errors.New("catalog closed")

// Config is what a Store persists and how.
type Config struct {
	// Path is the catalog file; its journal files are Path.journal.N.
	// Required (a dataplane without a catalog file has no Store).
	Path string
	// Logger receives the warnings (a torn record dropped, a compaction
	// that failed). nil: slog.Default().
	Logger *slog.Logger
	// CompactMinBytes is the journal size below which no compaction
	// starts (it also waits for the journal to grow as large as the last
	// snapshot). 0: DefaultCompactMinBytes.
	CompactMinBytes int64
}

// Deps is what a Store needs from the dataplane.
type Deps struct {
	// Snapshot returns the state of the catalog (Seq and Version are
	// the Store's to fill). It must hold the lock under which the
	// changes are appended (Append) while it captures the state and
	// calls cut, and let it go before it returns: the state is then
	// exactly the changes appended before cut, and every change after
	// it goes to the next journal file while the snapshot is written.
	// A compaction calls it with no lock of the Store held. Required.
	Snapshot func(cut func()) File
}

// Status is what a Store reports.
type Status struct {
	Path string `json:"path"`
	// Seq is the last change appended, Durable the last one written and
	// fsynced (or in a snapshot).
	Seq     uint64 `json:"seq"`
	Durable uint64 `json:"durable"`
	// Generation is the journal file records go to (or went to last).
	Generation uint64 `json:"generation"`
	// JournalBytes is the journal's size since the last snapshot,
	// SnapshotBytes the last snapshot's.
	JournalBytes  int64 `json:"journal_bytes"`
	SnapshotBytes int64 `json:"snapshot_bytes"`
	// Compacting: a compaction is under way.
	Compacting bool `json:"compacting,omitempty"`
	// Broken is the failed write that broke the journal, until a
	// compaction repairs it; "" when it works.
	Broken string `json:"broken,omitempty"`
}

// Store persists a catalog: the journal with group commit and the
// compactions. Its methods are safe for concurrent use; Append is called
// with the dataplane's lock held (the one Deps.Snapshot takes), so that
// the order of the records is the order of the changes.
type Store struct {
	path     string
	log      *slog.Logger
	minBytes int64
	deps     Deps
	// running counts the compactions in the background.
	running sync.WaitGroup

	mu       sync.Mutex
	cond     sync.Cond
	f        *os.File // the journal file records go to
	gen      uint64
	dirSync  bool     // f's directory entry still needs an fsync
	pending  []byte   // records not yet written
	spare    []byte   // a written buffer, for reuse
	last     uint64   // seq of the last record appended
	durable  uint64   // seq of the last record written and fsynced
	flushing *os.File // the file a write is under way to, or nil
	err      error    // a failed write: the journal is broken until a compaction
	failed   uint64   // seq of the last record of the write that failed
	bytes    int64    // journal bytes since the last snapshot
	rotated  int64    // bytes when the compaction under way rotated
	// rotatedGen is the newest generation when the compaction under way
	// rotated: every record in it and in older files is at or below the
	// snapshot's seq. Newer files hold acknowledged records the snapshot
	// does not have, even after a failed write closed the current one.
	rotatedGen uint64
	snapSize   int64 // size of the last snapshot
	compact    bool  // a compaction is under way
	started    bool  // compactions in the background may start
	closed     bool
}

// New returns the Store of the catalog at cfg.Path. It reads nothing:
// Load does, before the first Append.
func New(cfg Config, deps Deps) (*Store, error) {
	if cfg.Path == "" {
		return nil, errors.New("catalog: no path")
	}
	if deps.Snapshot == nil {
		return nil, errors.New("catalog: no Snapshot")
	}
	if cfg.CompactMinBytes < 0 {
		return nil, fmt.Errorf("catalog: CompactMinBytes %d is negative", cfg.CompactMinBytes)
	}
	if cfg.CompactMinBytes == 0 {
		cfg.CompactMinBytes = DefaultCompactMinBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Store{path: cfg.Path, log: cfg.Logger, minBytes: cfg.CompactMinBytes, deps: deps, gen: 0}
	s.cond.L = &s.mu
	return s, nil
}

// Load reads the catalog (Read) and positions the journal after it: the
// next change is the one after the catalog's last, in a new journal
// file. dirty says the journal held something (records or a torn tail):
// the caller compacts it (Compact) once it has restored the catalog.
func (s *Store) Load() (cat File, dirty bool, err error) {
	cat, nextGen, dirty, err := load(s.path, s.log)
	if err != nil {
		return cat, false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.last, s.durable, s.gen = cat.Seq, cat.Seq, nextGen-1
	if fi, err := os.Stat(s.path); err == nil {
		s.snapSize = fi.Size()
	}
	return cat, dirty, nil
}

// Start lets compactions start in the background (one at a time, in a
// goroutine of their own that Close waits for) once the journal has
// grown enough or a failed write broke it.
func (s *Store) Start() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.started = true
	s.maybeCompact()
}

// Status reports the journal's state.
func (s *Store) Status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Status{Path: s.path, Seq: s.last, Durable: s.durable, Generation: s.gen,
		JournalBytes: s.bytes, SnapshotBytes: s.snapSize, Compacting: s.compact}
	if s.err != nil {
		st.Broken = s.err.Error()
	}
	return st
}

// Append adds a record for the next change and returns its sequence
// number; Wait makes it durable. It starts a compaction when the journal
// has grown enough. The dataplane's lock (Deps.Snapshot's) must be held.
func (s *Store) Append(r Record) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("catalog journal: %w", ErrClosed)
	}
	r.Seq = s.last + 1
	n := len(s.pending)
	var err error
	if s.pending, err = AppendRecord(s.pending, r); err != nil {
		return 0, fmt.Errorf("catalog journal: %w", err)
	}
	s.last = r.Seq
	s.bytes += int64(len(s.pending) - n)
	s.maybeCompact()
	return r.Seq, nil
}

// maybeCompact starts a compaction in the background when the journal
// has grown enough to be compacted (or is broken and needs one) and none
// is under way. s.mu must be held.
func (s *Store) maybeCompact() {
	if s.compact || s.closed || !s.started {
		return
	}
	if s.err != nil || (s.bytes >= s.minBytes && s.bytes >= s.snapSize) {
		s.compact = true
		s.running.Add(1)
		go s.background()
	}
}

// background runs the compaction maybeCompact started.
func (s *Store) background() {
	defer s.running.Done()
	if err := s.compactClaimed(); err != nil {
		s.log.Error("fluxvm: catalog compaction failed; the journal keeps growing until one succeeds", "err", err)
	}
}

// Wait returns once the record seq is durable, writing and syncing the
// pending records itself when no other caller is: callers that arrive
// during a write have their records written together by the next one.
// The dataplane's lock must not be held. Wait(0) returns nil.
func (s *Store) Wait(seq uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.durable < seq {
		if s.err != nil {
			if s.compact {
				// A compaction under way may cover seq.
				s.cond.Wait()
				continue
			}
			return s.err
		}
		if s.flushing != nil {
			s.cond.Wait()
			continue
		}
		if err := s.openFile(); err != nil {
			s.err = fmt.Errorf("catalog journal: %w", err)
			continue
		}
		buf, last, f, dirSync := s.pending, s.last, s.f, s.dirSync
		s.pending, s.spare = s.spare[:0], nil
		s.flushing = f
		s.mu.Unlock()
		_, err := f.Write(buf)
		if err == nil {
			err = f.Sync()
		}
		if err == nil && dirSync {
			err = atomicfile.SyncDir(filepath.Dir(s.path))
		}
		s.mu.Lock()
		s.flushing = nil
		s.spare = buf
		if err != nil {
			// What reached the file is unknown now: every later
			// record fails too until a compaction writes the whole
			// catalog again.
			// The file may end in a torn record: nothing more goes to it.
			s.err = fmt.Errorf("catalog journal %s: %w", f.Name(), err)
			s.failed = last
			if s.f == f {
				s.f = nil
				f.Close()
			}
		} else {
			if f == s.f && dirSync {
				s.dirSync = false
			}
			s.durable = max(s.durable, last)
		}
		s.cond.Broadcast()
	}
	return nil
}

// CatchUp returns the seq to wait for (Settle) so that the change seq
// (its journal record) is durable, 0 when it is, and starts a compaction
// when a failed write broke the journal before it got there (the
// compaction heals it). The retry of a change whose record may have
// failed to reach the disk calls it (an unchanged apply, or the retry of
// a delete that was not saved).
func (s *Store) CatchUp(seq uint64) uint64 {
	if seq == 0 {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.durable >= seq {
		return 0
	}
	if s.err != nil {
		s.maybeCompact()
	}
	return seq
}

// Settle waits until the change seq (from CatchUp) is durable. A
// compaction that captured the catalog before the failed write it was to
// heal leaves the journal broken: then it starts one more, once. The
// dataplane's lock must not be held.
func (s *Store) Settle(seq uint64) error {
	if err := s.Wait(seq); err == nil {
		return nil
	}
	return s.Wait(s.CatchUp(seq))
}

// openFile opens the journal file of the current generation when none
// is open. s.mu must be held.
func (s *Store) openFile() error {
	if s.f != nil {
		return nil
	}
	s.gen++
	f, err := os.OpenFile(journalPath(s.path, s.gen), os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	s.f, s.dirSync = f, true
	return nil
}

// Compact captures the catalog (Deps.Snapshot) and writes it as the
// snapshot, once a compaction under way has finished. The restore calls
// it; afterwards the Store compacts on its own. The dataplane's lock must
// not be held.
func (s *Store) Compact() error {
	s.mu.Lock()
	for s.compact {
		s.cond.Wait()
	}
	if s.closed {
		s.mu.Unlock()
		return fmt.Errorf("fluxvm: catalog compaction: %w", ErrClosed)
	}
	s.compact = true
	s.mu.Unlock()
	return s.compactClaimed()
}

// compactClaimed is a compaction: the caller set s.compact.
func (s *Store) compactClaimed() error {
	var (
		seq uint64
		old *os.File
		cut bool
	)
	cat := s.deps.Snapshot(func() {
		seq, old = s.rotate()
		cut = true
	})
	if !cut {
		s.compactionDone()
		return errors.New("fluxvm: catalog compaction: the snapshot did not cut the journal")
	}
	cat.Version, cat.Seq = Version, seq
	if writeHook != nil {
		writeHook()
	}
	size, err := WriteFile(s.path, cat)
	if err != nil {
		s.compactionDone()
		return fmt.Errorf("fluxvm: catalog compaction: %w", err)
	}
	s.compacted(seq, size, old)
	return nil
}

// writeHook, when set (a test), runs before a compaction writes its
// snapshot.
var writeHook func()

// WaitCompaction returns once no compaction is under way.
func (s *Store) WaitCompaction() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.compact {
		s.cond.Wait()
	}
}

// rotate ends the current journal file: records appended from now on go
// to the next one. It returns the seq the state has now (the snapshot's
// journal_seq) and the file to remove once the snapshot is in place.
// Called by Deps.Snapshot's cut, with the dataplane's lock held, so that
// the state captured with it matches the seq.
func (s *Store) rotate() (seq uint64, old *os.File) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old, s.f = s.f, nil
	s.rotated = s.bytes
	s.rotatedGen = s.gen
	return s.last, old
}

// compacted records a snapshot of size bytes that includes every change
// up to seq, and removes the journal files it makes redundant (old and
// every older generation). A journal broken by a failed write works again
// from here: every change up to seq is in the snapshot.
func (s *Store) compacted(seq uint64, size int64, old *os.File) {
	s.mu.Lock()
	for old != nil && s.flushing == old {
		s.cond.Wait()
	}
	if s.err != nil && seq >= s.failed {
		// Every record the failed write held is in the snapshot.
		s.err = nil
	}
	s.durable = max(s.durable, seq)
	s.bytes -= s.rotated
	s.snapSize = size
	keep := s.rotatedGen + 1
	s.cond.Broadcast()
	s.mu.Unlock()
	// The compaction ends once the files are gone (WaitCompaction).
	defer s.compactionDone()
	if old != nil {
		old.Close() // a failed write may have closed it already
	}
	files, err := journalFiles(s.path)
	if err != nil {
		s.log.Warn("fluxvm: catalog journal: listing the files to remove after a compaction failed", "err", err)
		return
	}
	for _, jf := range files {
		if jf.gen < keep {
			if err := os.Remove(jf.path); err != nil && !errors.Is(err, os.ErrNotExist) {
				s.log.Warn("fluxvm: catalog journal: removing a compacted journal file failed", "file", jf.path, "err", err)
			}
		}
	}
}

// compactionDone ends a compaction (one that wrote no snapshot, or
// one done).
func (s *Store) compactionDone() {
	s.mu.Lock()
	s.compact = false
	s.cond.Broadcast()
	s.mu.Unlock()
}

// Close waits for a compaction under way, compacts what the journal
// holds so that the snapshot alone is the catalog, and closes the
// journal; later appends fail with ErrClosed. The dataplane calls it once
// no change is in flight, without its lock (the last compaction takes
// it, in Deps.Snapshot). A second Close (or one after Drop) does nothing.
func (s *Store) Close() error {
	if !s.stop() {
		return nil
	}
	var err error
	if s.hasRecords() {
		err = s.compactClaimed()
	}
	return errors.Join(err, s.closeFile())
}

// Drop waits for a compaction under way and closes the journal without
// compacting it: a cleanup removes the files next, and a failed start
// leaves them as they were. A second Drop (or one after Close) does
// nothing.
func (s *Store) Drop() error {
	if !s.stop() {
		return nil
	}
	return s.closeFile()
}

// stop ends the background compactions and waits for the one under way;
// false: stopped already. From then on appends fail, and the caller
// runs the last compaction (if any) on its own.
func (s *Store) stop() bool {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return false
	}
	s.closed = true
	s.mu.Unlock()
	s.running.Wait()
	s.mu.Lock()
	for s.compact { // a Compact of the restore's
		s.cond.Wait()
	}
	s.compact = true // the last compaction's, if any
	s.mu.Unlock()
	return true
}

// closeFile closes the journal file.
func (s *Store) closeFile() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.flushing != nil {
		s.cond.Wait()
	}
	s.compact = false
	s.cond.Broadcast()
	if s.f == nil {
		return nil
	}
	err := s.f.Close()
	s.f = nil
	return err
}

// hasRecords reports whether the journal holds changes the snapshot does
// not.
func (s *Store) hasRecords() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.bytes > 0 || s.err != nil
}

// FailNextWrite closes the journal file under the Store, so that the
// next write fails as a disk error would (fault injection, for tests of
// what a failed write answers). It fails when no journal file is open.
func (s *Store) FailNextWrite() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f == nil {
		return errors.New("catalog journal: no journal file open")
	}
	return s.f.Close()
}
