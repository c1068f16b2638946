package catalog

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
	"sort"
	"strconv"
	"strings"
)

// journalMagic starts every journal record ("FXJ1").
const journalMagic = 0x314a5846

// journalHeader is the size of a record's header.
const journalHeader = 12

// maxJournalRecord bounds a record's payload; a length field above it is
// damage.
const maxJournalRecord = 64 << 20

var crc32c = crc32.MakeTable(crc32.Castagnoli)

// ErrCorrupt reports a catalog journal that lost acknowledged changes: a
// damaged record followed by valid ones, or missing records.
var ErrCorrupt = errors.New("catalog journal is damaged")

// Record is one change of the catalog: exactly one of Put, Delete and
// Policies. Seq is set by Store.Append.
type Record struct {
	Seq    uint64   `json:"seq"`
	Put    *Service `json:"put,omitempty"`
	Delete string   `json:"delete,omitempty"`
	// Policies replaces the identity policy state.
	Policies *Policies `json:"policies,omitempty"`
}

// kinds is how many changes r carries: a valid record carries one.
func (r *Record) kinds() int {
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

// AppendRecord encodes r after buf as a journal record (header and
// payload), as Store.Append writes it.
func AppendRecord(buf []byte, r Record) ([]byte, error) {
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
func decodeRecord(b []byte) (r Record, size int, ok bool) {
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

// JournalFiles lists the paths of the journal files of the catalog at
// path, oldest first.
func JournalFiles(path string) ([]string, error) {
	files, err := journalFiles(path)
	out := make([]string, 0, len(files))
	for _, jf := range files {
		out = append(out, jf.path)
	}
	return out, err
}

func journalPath(path string, gen uint64) string {
	return path + ".journal." + strconv.FormatUint(gen, 10)
}

// Read reads the catalog at path: the snapshot with its journal files
// replayed over it, services sorted by name, Seq the last change. It
// changes nothing on disk (a dataplane sizing its maps reads the catalog
// before it opens it).
func Read(path string, log *slog.Logger) (File, error) {
	if log == nil {
		log = slog.Default()
	}
	cat, _, _, err := load(path, log)
	return cat, err
}

// load reads the snapshot at path and replays its journal files over it.
// It returns the catalog (services sorted by name, Seq the last change),
// the generation the next journal file should have, and whether the
// journal held anything (records or a torn tail).
func load(path string, log *slog.Logger) (cat File, nextGen uint64, dirty bool, err error) {
	cat, err = ReadFile(path)
	if err != nil {
		return cat, 0, false, err
	}
	files, err := journalFiles(path)
	if err != nil {
		return cat, 0, false, fmt.Errorf("fluxvm: catalog journal: %w", err)
	}
	byName := make(map[string]Service, len(cat.Services))
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
					return cat, 0, false, fmt.Errorf("fluxvm: catalog journal %s: the record at offset %d is damaged and a valid one follows at offset %d: %w", jf.path, off, at, ErrCorrupt)
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
				return cat, 0, false, fmt.Errorf("fluxvm: catalog journal %s: record %d at offset %d follows change %d: %w", jf.path, r.Seq, off-n, seq, ErrCorrupt)
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
