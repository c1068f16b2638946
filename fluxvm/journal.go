package fluxvm

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/fluxvm/servicefabric/internal/atomicfile"
)

// The node-local catalog is kept as a snapshot and a journal.
//
// The snapshot is the catalog file (CatalogPath, format catalogFile,
// written atomically by atomicfile.Write). Its journal_seq is the sequence
// number of the last change it includes (0, or absent, in a catalog
// written before the journal existed).
//
// The journal holds the changes since, one record per ApplyService or
// DeleteService, appended to CatalogPath.journal.<generation> (the
// generation is a decimal number; a compaction starts the next one). A
// record is
//
//	magic   uint32 little-endian, journalMagic
//	length  uint32 little-endian, the payload's length in bytes
//	crc     uint32 little-endian, CRC-32C of the length field and the payload
//	payload JSON journalRecord: {"seq": n, "put": <catalog service>} or
//	        {"seq": n, "delete": "<name>"}
//
// A change is acknowledged (ApplyService or DeleteService returns nil)
// only once its record is written and the journal file fsynced (and, for
// the first record of a new journal file, its directory). Concurrent
// changes share one write and one fsync (group commit).
//
// Compaction writes the state of the catalog as a new snapshot in the
// background once the journal has grown as large as the last snapshot
// (and at least compactMinBytes), so that the journal's cost per change
// stays constant: the records from then on go to the next journal file,
// and the older journal files are removed once the snapshot is in place.
// Open replays the journal files over the snapshot (records the snapshot
// includes are skipped), restores the result and compacts it. Close
// compacts too, so that after a clean stop the snapshot alone is the
// catalog.
//
// Only the end of the last journal file can be torn by a crash, and only
// by a record that was never acknowledged: a record that fails its
// checksum or is cut short, with no valid record after it, is dropped
// with a warning. A damaged record followed by valid ones, or a gap in
// the sequence numbers, means acknowledged changes were lost: Open fails
// with ErrCatalogCorrupt and the file and offset.

// journalMagic starts every journal record ("FXJ1").
const journalMagic = 0x314a5846

// journalHeader is the size of a record's header.
const journalHeader = 12

// maxJournalRecord bounds a record's payload; a length field above it is
// damage.
const maxJournalRecord = 64 << 20

// compactMinBytes is the journal size below which no compaction starts
// (a variable for tests).
var compactMinBytes int64 = 1 << 20

var crc32c = crc32.MakeTable(crc32.Castagnoli)

// ErrCatalogCorrupt reports a catalog journal that lost acknowledged
// changes: a damaged record followed by valid ones, or missing records.
var ErrCatalogCorrupt = errors.New("catalog journal is damaged")

// journalRecord is one change of the catalog.
type journalRecord struct {
	Seq    uint64          `json:"seq"`
	Put    *catalogService `json:"put,omitempty"`
	Delete string          `json:"delete,omitempty"`
	// Policies replaces the identity policy state (policy.go).
	Policies *catalogPolicies `json:"policies,omitempty"`
}

// kinds is how many changes r carries: a valid record carries one.
func (r *journalRecord) kinds() int {
	n := 0
	if r.Put != nil {
		n++
	}
	if r.Delete != "" {
		n++
	}
	if r.Policies != nil {
		n++
	}
	return n
}

// appendRecord encodes r after buf.
func appendRecord(buf []byte, r journalRecord) ([]byte, error) {
	payload, err := json.Marshal(r)
	if err != nil {
		return buf, err
	}
	var h [journalHeader]byte
	binary.LittleEndian.PutUint32(h[0:], journalMagic)
	binary.LittleEndian.PutUint32(h[4:], uint32(len(payload)))
	crc := crc32.Update(crc32.Checksum(h[4:8], crc32c), crc32c, payload)
	binary.LittleEndian.PutUint32(h[8:], crc)
	buf = append(buf, h[:]...)
	return append(buf, payload...), nil
}

// decodeRecord decodes the record at the start of b. It returns the
// record and its size, or ok false when b does not start with an intact
// record.
func decodeRecord(b []byte) (r journalRecord, size int, ok bool) {
	if len(b) < journalHeader || binary.LittleEndian.Uint32(b) != journalMagic {
		return r, 0, false
	}
	n := binary.LittleEndian.Uint32(b[4:])
	if n > maxJournalRecord || uint64(len(b)-journalHeader) < uint64(n) {
		return r, 0, false
	}
	payload := b[journalHeader : journalHeader+int(n)]
	if crc32.Update(crc32.Checksum(b[4:8], crc32c), crc32c, payload) != binary.LittleEndian.Uint32(b[8:]) {
		return r, 0, false
	}
	if err := json.Unmarshal(payload, &r); err != nil || r.Seq == 0 || r.kinds() != 1 {
		return r, 0, false
	}
	return r, journalHeader + int(n), true
}

// journalFile is one journal file found at start.
type journalFile struct {
	path string
	gen  uint64
}

// journalFiles lists the journal files of the catalog at path, oldest
// first.
func journalFiles(path string) ([]journalFile, error) {
	dir, base := filepath.Dir(path), filepath.Base(path)+".journal."
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []journalFile
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), base)
		if !ok {
			continue
		}
		gen, err := strconv.ParseUint(rest, 10, 64)
		if err != nil || e.IsDir() {
			continue
		}
		out = append(out, journalFile{filepath.Join(dir, e.Name()), gen})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].gen < out[j].gen })
	return out, nil
}

func journalPath(path string, gen uint64) string {
	return path + ".journal." + strconv.FormatUint(gen, 10)
}

// loadCatalog reads the snapshot at path and replays its journal files
// over it. It returns the catalog (services sorted by name, Seq the last
// change), the generation the next journal file should have, and
// whether the journal held anything (records or a torn tail).
func loadCatalog(path string, log *slog.Logger) (cat catalogFile, nextGen uint64, dirty bool, err error) {
	cat, err = readCatalog(path)
	if err != nil {
		return cat, 0, false, err
	}
	files, err := journalFiles(path)
	if err != nil {
		return cat, 0, false, fmt.Errorf("fluxvm: catalog journal: %w", err)
	}
	byName := make(map[string]catalogService, len(cat.Services))
	for _, cs := range cat.Services {
		byName[cs.Service.Name] = cs
	}
	seq := cat.Seq // the last change applied
	nextGen = 1
	for _, jf := range files {
		nextGen = jf.gen + 1
		data, err := os.ReadFile(jf.path)
		if err != nil {
			return cat, 0, false, fmt.Errorf("fluxvm: catalog journal: %w", err)
		}
		if len(data) > 0 {
			dirty = true
		}
		off := 0
		for off < len(data) {
			r, n, ok := decodeRecord(data[off:])
			if !ok {
				// Torn only if nothing valid follows in this file. A
				// later file may hold valid records: a write that
				// failed leaves its file with a torn end, and the
				// changes after the compaction that repaired the
				// journal go to the next file. Nothing is lost
				// unnoticed either way: the records that follow must
				// continue the sequence (checked below), so a damaged
				// record that had been acknowledged shows as a gap.
				if at, later := validRecordAfter(data, off+1); later {
					return cat, 0, false, fmt.Errorf("fluxvm: catalog journal %s: the record at offset %d is damaged and a valid one follows at offset %d: %w", jf.path, off, at, ErrCatalogCorrupt)
				}
				log.Warn("fluxvm: catalog journal: dropped a torn last record (a change that was never acknowledged)",
					"file", jf.path, "offset", off, "bytes", len(data)-off)
				break
			}
			off += n
			if r.Seq <= seq {
				continue // the snapshot includes it
			}
			if r.Seq != seq+1 {
				return cat, 0, false, fmt.Errorf("fluxvm: catalog journal %s: record %d at offset %d follows change %d: %w", jf.path, r.Seq, off-n, seq, ErrCatalogCorrupt)
			}
			seq = r.Seq
			switch {
			case r.Put != nil:
				byName[r.Put.Service.Name] = *r.Put
			case r.Policies != nil:
				cat.Policies = r.Policies
			default:
				delete(byName, r.Delete)
			}
		}
	}
	cat.Seq = seq
	cat.Services = cat.Services[:0]
	for _, cs := range byName {
		cat.Services = append(cat.Services, cs)
	}
	sort.Slice(cat.Services, func(i, j int) bool { return cat.Services[i].Service.Name < cat.Services[j].Service.Name })
	return cat, nextGen, dirty, nil
}

// validRecordAfter finds an intact record in data at or after offset from.
func validRecordAfter(data []byte, from int) (int, bool) {
	var m [4]byte
	binary.LittleEndian.PutUint32(m[:], journalMagic)
	for from < len(data) {
		i := bytes.Index(data[from:], m[:])
		if i < 0 {
			return 0, false
		}
		if _, _, ok := decodeRecord(data[from+i:]); ok {
			return from + i, true
		}
		from += i + 1
	}
	return 0, false
}

// catalogStore persists the catalog: the journal with group commit and
// the compactions. Its methods are safe for concurrent use; append and
// rotate are called with Dataplane.mu held, so that the order of the
// records is the order of the changes.
type catalogStore struct {
	path string
	log  *slog.Logger

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
	closed     bool
}

// openStore starts the journal of a catalog whose state was loaded up to
// change seq: the next journal file has generation gen.
func openStore(path string, log *slog.Logger, seq, gen uint64) *catalogStore {
	s := &catalogStore{path: path, log: log, last: seq, durable: seq, gen: gen - 1}
	s.cond.L = &s.mu
	return s
}

// append adds a record for the next change and returns its sequence
// number; wait makes it durable. d.mu must be held.
func (s *catalogStore) append(r journalRecord) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("catalog journal: %w", ErrClosed)
	}
	r.Seq = s.last + 1
	n := len(s.pending)
	var err error
	if s.pending, err = appendRecord(s.pending, r); err != nil {
		return 0, fmt.Errorf("catalog journal: %w", err)
	}
	s.last = r.Seq
	s.bytes += int64(len(s.pending) - n)
	return r.Seq, nil
}

// wantCompaction reports whether the journal has grown enough to be
// compacted (or is broken and needs one), and marks a compaction as
// started when it has. d.mu must be held.
func (s *catalogStore) wantCompaction() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.compact || s.closed {
		return false
	}
	if s.err != nil || (s.bytes >= compactMinBytes && s.bytes >= s.snapSize) {
		s.compact = true
		return true
	}
	return false
}

// wait returns once the record seq is durable, writing and syncing the
// pending records itself when no other caller is: callers that arrive
// during a write have their records written together by the next one.
func (s *catalogStore) wait(seq uint64) error {
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

// openFile opens the journal file of the current generation when none
// is open. s.mu must be held.
func (s *catalogStore) openFile() error {
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

// rotate ends the current journal file: records appended from now on go
// to the next one. It returns the seq the state has now (the snapshot's
// journal_seq) and the file to remove once the snapshot is in place.
// d.mu must be held, so that the state captured with it matches the seq.
func (s *catalogStore) rotate() (seq uint64, old *os.File) {
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
func (s *catalogStore) compacted(seq uint64, size int64, old *os.File) {
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
	s.compact = false
	keep := s.rotatedGen + 1
	s.cond.Broadcast()
	s.mu.Unlock()
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

// compactionFailed ends a compaction that wrote no snapshot.
func (s *catalogStore) compactionFailed() {
	s.mu.Lock()
	s.compact = false
	s.cond.Broadcast()
	s.mu.Unlock()
}

// close closes the journal file; later appends fail with ErrClosed.
func (s *catalogStore) close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.flushing != nil {
		s.cond.Wait()
	}
	s.closed = true
	if s.f == nil {
		return nil
	}
	err := s.f.Close()
	s.f = nil
	return err
}

// writeSnapshot writes cat as the catalog file.
func writeSnapshot(path string, cat catalogFile) (int64, error) {
	data, err := json.MarshalIndent(cat, "", "  ")
	if err != nil {
		return 0, err
	}
	if err := atomicfile.Write(path, data, 0o600); err != nil {
		return 0, err
	}
	return int64(len(data)), nil
}

// removeCatalogFiles removes the catalog at path and its journal files.
func removeCatalogFiles(path string) error {
	var errs []error
	if err := removeIfExists(path); err != nil {
		errs = append(errs, err)
	}
	files, err := journalFiles(path)
	errs = append(errs, err)
	for _, jf := range files {
		errs = append(errs, removeIfExists(jf.path))
	}
	return errors.Join(errs...)
}

// RemoveCatalog removes the node-local catalog at path: the catalog file
// and its journal files (see docs/operations.md). A missing catalog is
// not an error. Use it only on a node whose dataplane is not open.
func RemoveCatalog(path string) error {
	if err := removeCatalogFiles(path); err != nil {
		return fmt.Errorf("fluxvm: remove catalog %s: %w", path, err)
	}
	return nil
}

// catalogSnapshot is the state of the catalog as a catalogFile (without
// Seq). d.mu must be held.
func (d *Dataplane) catalogSnapshot() catalogFile {
	cat := catalogFile{Version: catalogVersion, Services: make([]catalogService, 0, len(d.services))}
	for _, s := range d.services {
		cat.Services = append(cat.Services, catalogServiceOf(s))
	}
	sort.Slice(cat.Services, func(i, j int) bool { return cat.Services[i].Service.Name < cat.Services[j].Service.Name })
	cat.Policies = d.pol.saved()
	return cat
}

// catalogServiceOf is s as the catalog records it. d.mu must be held.
func catalogServiceOf(s *service) catalogService {
	cs := catalogService{Service: s.intent, Revision: s.revision, AppliedAt: s.applied}
	for _, fe := range s.frontends {
		cf := catalogFrontend{VIP: fe.key.vip, Port: fe.key.port, Protocol: protocolOf(fe.key.proto), ServiceID: fe.sid,
			Backends: make([]catalogBackend, 0, len(fe.backends))}
		for ep, id := range fe.backends {
			cf.Backends = append(cf.Backends, catalogBackend{Endpoint: ep, BackendID: id})
		}
		slices.SortFunc(cf.Backends, func(a, b catalogBackend) int { return int(a.BackendID) - int(b.BackendID) })
		cs.Frontends = append(cs.Frontends, cf)
	}
	return cs
}

// compactNow captures the catalog and writes it as the snapshot. d.mu
// must not be held.
func (d *Dataplane) compactNow() error {
	d.mu.Lock()
	st := d.store
	if st == nil {
		d.mu.Unlock()
		return nil
	}
	cat := d.catalogSnapshot()
	seq, old := st.rotate()
	d.mu.Unlock()
	cat.Seq = seq
	size, err := writeSnapshot(st.path, cat)
	if err != nil {
		st.compactionFailed()
		return fmt.Errorf("fluxvm: catalog compaction: %w", err)
	}
	st.compacted(seq, size, old)
	return nil
}

// startCompaction compacts in the background; d.compacting lets Close
// wait for it.
func (d *Dataplane) startCompaction() {
	d.compacting.Add(1)
	go func() {
		defer d.compacting.Done()
		if err := d.compactNow(); err != nil {
			d.log.Error("fluxvm: catalog compaction failed; the journal keeps growing until one succeeds", "err", err)
		}
	}()
}

// journal records a change of service name (s nil: deleted) and returns
// the seq to wait for (0 without a catalog file). It starts a compaction
// when the journal has grown enough. d.mu must be held.
func (d *Dataplane) journal(name string, s *service) (uint64, error) {
	if d.store == nil {
		return 0, nil
	}
	r := journalRecord{Delete: name}
	if s != nil {
		cs := catalogServiceOf(s)
		r = journalRecord{Put: &cs}
	}
	seq, err := d.store.append(r)
	if err != nil {
		return 0, err
	}
	if d.store.wantCompaction() {
		d.startCompaction()
	}
	return seq, nil
}

// catchUp returns the seq to wait for (settle) so that the change seq
// (its journal record) is durable, 0 when it is, and starts a compaction
// when a failed write broke the journal before it got there (the
// compaction heals it). An unchanged apply, or the retry of a delete
// that was not saved, calls it: their change may be one whose record
// failed to reach the disk. d.mu must be held.
func (d *Dataplane) catchUp(seq uint64) uint64 {
	if d.store == nil || seq == 0 {
		return 0
	}
	seq, broken := d.store.behind(seq)
	if broken && d.store.wantCompaction() {
		d.startCompaction()
	}
	return seq
}

// settle waits until the change seq (from catchUp) is durable. A
// compaction that captured the catalog before the failed write it was to
// heal leaves the journal broken: then it starts one more, once. d.mu
// must not be held.
func (d *Dataplane) settle(seq uint64) error {
	err := d.persist(seq)
	if err == nil {
		return nil
	}
	d.mu.Lock()
	seq = d.catchUp(seq)
	d.mu.Unlock()
	return d.persist(seq)
}

// behind returns seq and whether the journal is broken, or 0 when the
// record seq is durable.
func (s *catalogStore) behind(seq uint64) (uint64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.durable >= seq {
		return 0, false
	}
	return seq, s.err != nil
}

// persist waits until the change seq (from journal) is durable. d.mu
// must not be held.
func (d *Dataplane) persist(seq uint64) error {
	if seq == 0 || d.store == nil {
		return nil
	}
	return d.store.wait(seq)
}

// closeCatalog waits for a compaction under way, compacts what the
// journal holds so that the snapshot alone is the catalog, and closes the
// journal. Close calls it once no change is in flight; d.mu must not be
// held.
func (d *Dataplane) closeCatalog() error {
	d.compacting.Wait()
	if d.store == nil {
		return nil
	}
	var err error
	if d.store.hasRecords() {
		err = d.compactNow()
	}
	return errors.Join(err, d.store.close())
}

// hasRecords reports whether the journal holds changes the snapshot does
// not.
func (s *catalogStore) hasRecords() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.bytes > 0 || s.err != nil
}
