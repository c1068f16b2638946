package fluxvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// jsvc is a catalog entry for journal tests: service i with weight w.
func jsvc(i int, w uint32) catalogService {
	svc := benchService(i, w)
	cf := catalogFrontend{VIP: svc.VIPs[0], Port: 80, Protocol: TCP, ServiceID: uint32(i + 1)}
	for j, b := range svc.Backends {
		cf.Backends = append(cf.Backends, catalogBackend{Endpoint: b.Endpoint(), BackendID: uint32(i*10 + j + 1)})
	}
	return catalogService{Service: svc, Revision: uint64(w), AppliedAt: time.Unix(1700000000, 0).UTC(), Frontends: []catalogFrontend{cf}}
}

// model is what the catalog must hold after the acknowledged changes.
type model map[string]catalogService

func (m model) services() []catalogService {
	var out []catalogService
	for _, cs := range m {
		out = append(out, cs)
	}
	cat := catalogFile{Services: out}
	b, _ := json.Marshal(cat) // normalise as the files do
	_ = json.Unmarshal(b, &cat)
	sortCatalog(cat.Services)
	return cat.Services
}

func sortCatalog(s []catalogService) {
	for i := range s {
		for j := i + 1; j < len(s); j++ {
			if s[j].Service.Name < s[i].Service.Name {
				s[i], s[j] = s[j], s[i]
			}
		}
	}
}

// logBuffer collects what a logger writes.
func logBuffer() (*slog.Logger, *bytes.Buffer) {
	var b bytes.Buffer
	return slog.New(slog.NewTextHandler(&b, nil)), &b
}

// journalTo appends changes to a store at path and waits for each.
func journalTo(t *testing.T, st *catalogStore, m model, recs ...journalRecord) {
	t.Helper()
	for _, r := range recs {
		seq, err := st.append(r)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.wait(seq); err != nil {
			t.Fatal(err)
		}
		if r.Policies != nil {
			continue // the services stay as they are
		}
		if r.Put != nil {
			m[r.Put.Service.Name] = *r.Put
		} else {
			delete(m, r.Delete)
		}
	}
}

func put(cs catalogService) journalRecord { return journalRecord{Put: &cs} }
func del(name string) journalRecord       { return journalRecord{Delete: name} }

func mustLoad(t *testing.T, path string) (catalogFile, *bytes.Buffer) {
	t.Helper()
	log, buf := logBuffer()
	cat, _, _, err := loadCatalog(path, log)
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	return cat, buf
}

func checkCatalog(t *testing.T, what string, got catalogFile, want model) {
	t.Helper()
	w := want.services()
	if !reflect.DeepEqual(got.Services, w) && !(len(got.Services) == 0 && len(w) == 0) {
		var names []string
		for _, cs := range got.Services {
			names = append(names, fmt.Sprintf("%s@%d", cs.Service.Name, cs.Revision))
		}
		var wn []string
		for _, cs := range w {
			wn = append(wn, fmt.Sprintf("%s@%d", cs.Service.Name, cs.Revision))
		}
		t.Errorf("%s: catalog %v, want %v", what, names, wn)
	}
}

// TestCatalogJournalReplay: a snapshot plus journal records restore
// exactly the acknowledged changes, also from a catalog file written
// before the journal existed.
func TestCatalogJournalReplay(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "catalog.json")
	// A catalog of the previous format: no journal_seq, no journal.
	old := catalogFile{Version: 1, Services: []catalogService{jsvc(0, 1), jsvc(1, 1)}}
	legacy, _ := json.MarshalIndent(old, "", "  ")
	if bytes.Contains(legacy, []byte("journal_seq")) {
		t.Fatal("a catalog without journal records has no journal_seq")
	}
	if err := os.WriteFile(path, legacy, 0o600); err != nil {
		t.Fatal(err)
	}
	m := model{"svc-00000": jsvc(0, 1), "svc-00001": jsvc(1, 1)}
	cat, _ := mustLoad(t, path)
	checkCatalog(t, "legacy catalog", cat, m)

	st := openStore(path, slog.Default(), cat.Seq, 1)
	journalTo(t, st, m, put(jsvc(2, 1)), put(jsvc(0, 2)), del("svc-00001"), put(jsvc(3, 1)))
	cat, _ = mustLoad(t, path)
	checkCatalog(t, "snapshot + journal", cat, m)
	if cat.Seq != 4 {
		t.Errorf("seq %d, want 4", cat.Seq)
	}
	st.close()
}

// TestCatalogJournalPolicies: a policies record replaces the identity
// policy state (the latest wins) next to the services' records, and a
// compaction keeps it in the snapshot; a record of two kinds is damage.
func TestCatalogJournalPolicies(t *testing.T) {
	path := filepath.Join(t.TempDir(), "catalog.json")
	m := model{}
	st := openStore(path, slog.Default(), 0, 1)
	pols := func(ids ...Identity) *catalogPolicies {
		return &catalogPolicies{
			IPCache:  IPCache{Entries: []IPCacheEntry{{Prefix: netip.MustParsePrefix("10.0.0.0/8"), Identity: 1001}}},
			Policies: []Policy{{Service: "svc-00000", DefaultAction: PolicyDeny, AllowIdentities: ids}},
			IDs:      map[string]uint32{"svc-00000": 3},
		}
	}
	journalTo(t, st, m, put(jsvc(0, 1)), journalRecord{Policies: pols(1001)}, put(jsvc(1, 1)), journalRecord{Policies: pols(1001, 1002)})
	cat, _ := mustLoad(t, path)
	checkCatalog(t, "services beside policies", cat, m)
	if !reflect.DeepEqual(cat.Policies, pols(1001, 1002)) {
		t.Errorf("policies %+v, want the latest record's", cat.Policies)
	}
	// Compacted into the snapshot: the same.
	snap := cat
	snap.Seq = 4
	if _, err := writeSnapshot(path, snap); err != nil {
		t.Fatal(err)
	}
	st.close()
	for _, f := range must(journalFiles(path)) {
		os.Remove(f.path)
	}
	cat, _ = mustLoad(t, path)
	if !reflect.DeepEqual(cat.Policies, pols(1001, 1002)) {
		t.Errorf("policies from the snapshot %+v", cat.Policies)
	}
	// One record, two changes: never written, so damage.
	two := journalRecord{Seq: 1, Delete: "x", Policies: pols()}
	b, err := appendRecord(nil, two)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok := decodeRecord(b); ok {
		t.Error("a record with a delete and policies decoded")
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestCatalogJournalTornTail: a crash in the middle of writing a record
// leaves a torn tail (cut short, zeros, garbage); it is dropped with a
// warning and the acknowledged changes before it are restored exactly.
func TestCatalogJournalTornTail(t *testing.T) {
	for _, tc := range []struct {
		name string
		tear func(rec []byte) []byte // what of the last record reached the disk
	}{
		{"header cut short", func(r []byte) []byte { return r[:7] }},
		{"payload cut short", func(r []byte) []byte { return r[:len(r)-5] }},
		{"payload zeroed", func(r []byte) []byte {
			z := bytes.Clone(r)
			clear(z[journalHeader+10:])
			return z
		}},
		{"zeros after the length", func(r []byte) []byte { return append(bytes.Clone(r[:8]), make([]byte, 100)...) }},
		{"bit flip", func(r []byte) []byte {
			z := bytes.Clone(r)
			z[len(z)-3] ^= 0x10
			return z
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "catalog.json")
			st := openStore(path, slog.Default(), 0, 1)
			m := model{}
			journalTo(t, st, m, put(jsvc(0, 1)), put(jsvc(1, 1)), put(jsvc(0, 2)))
			st.close()
			// The record that was being written when the node crashed.
			rec, err := appendRecord(nil, journalRecord{Seq: 4, Put: &[]catalogService{jsvc(2, 1)}[0]})
			if err != nil {
				t.Fatal(err)
			}
			jp := journalPath(path, 1)
			f, err := os.OpenFile(jp, os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			f.Write(tc.tear(rec))
			f.Close()

			cat, logs := mustLoad(t, path)
			checkCatalog(t, "after a torn tail", cat, m)
			if !strings.Contains(logs.String(), "torn last record") {
				t.Errorf("no warning about the torn record: %q", logs.String())
			}
		})
	}
}

// TestCatalogJournalCorrupt: damage before acknowledged records, or a
// missing record, fails the load with ErrCatalogCorrupt and says where.
func TestCatalogJournalCorrupt(t *testing.T) {
	write := func(t *testing.T, recs ...journalRecord) (string, []byte) {
		dir := t.TempDir()
		path := filepath.Join(dir, "catalog.json")
		var b []byte
		for _, r := range recs {
			var err error
			if b, err = appendRecord(b, r); err != nil {
				t.Fatal(err)
			}
		}
		return path, b
	}
	a, b, c := jsvc(0, 1), jsvc(1, 1), jsvc(2, 1)
	t.Run("damaged middle record", func(t *testing.T) {
		path, data := write(t, journalRecord{Seq: 1, Put: &a}, journalRecord{Seq: 2, Put: &b}, journalRecord{Seq: 3, Put: &c})
		one, _ := appendRecord(nil, journalRecord{Seq: 1, Put: &a})
		data[len(one)+journalHeader+4] ^= 0xff
		os.WriteFile(journalPath(path, 1), data, 0o600)
		_, _, _, err := loadCatalog(path, slog.Default())
		if !errors.Is(err, ErrCatalogCorrupt) || !strings.Contains(err.Error(), fmt.Sprintf("offset %d", len(one))) {
			t.Errorf("err %v, want ErrCatalogCorrupt at offset %d", err, len(one))
		}
	})
	t.Run("missing record", func(t *testing.T) {
		path, data := write(t, journalRecord{Seq: 1, Put: &a}, journalRecord{Seq: 3, Put: &c})
		os.WriteFile(journalPath(path, 1), data, 0o600)
		if _, _, _, err := loadCatalog(path, slog.Default()); !errors.Is(err, ErrCatalogCorrupt) {
			t.Errorf("err %v, want ErrCatalogCorrupt", err)
		}
	})
	t.Run("damaged end of an older file", func(t *testing.T) {
		path, data := write(t, journalRecord{Seq: 1, Put: &a}, journalRecord{Seq: 2, Put: &b})
		os.WriteFile(journalPath(path, 1), data[:len(data)-4], 0o600)
		_, next := write(t, journalRecord{Seq: 3, Put: &c})
		os.WriteFile(journalPath(path, 2), next, 0o600)
		if _, _, _, err := loadCatalog(path, slog.Default()); !errors.Is(err, ErrCatalogCorrupt) {
			t.Errorf("err %v, want ErrCatalogCorrupt", err)
		}
	})
}

// TestCatalogCompactionCrashPoints: a crash at each step of a compaction
// (snapshot written but not renamed, renamed but the old journal not yet
// removed, done) restores exactly the acknowledged changes, and records
// the snapshot already includes are not applied twice.
func TestCatalogCompactionCrashPoints(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "catalog.json")
	st := openStore(path, slog.Default(), 0, 1)
	m := model{}
	journalTo(t, st, m, put(jsvc(0, 1)), put(jsvc(1, 1)), put(jsvc(2, 1)), del("svc-00001"))

	// Compaction: capture (seq 4) and rotate; later changes go to the
	// next journal file.
	seq, old := st.rotate()
	snap := catalogFile{Version: catalogVersion, Seq: seq, Services: m.services()}
	journalTo(t, st, m, put(jsvc(0, 3)), put(jsvc(1, 2)))

	// Crash 1: the snapshot is not in place yet (a temp file at most).
	os.WriteFile(filepath.Join(dir, ".catalog.json.tmp-123"), []byte(`{"version":1,"journ`), 0o600)
	cat, _ := mustLoad(t, path)
	checkCatalog(t, "crash before the snapshot's rename", cat, m)

	// Crash 2: the snapshot is in place, the old journal still there.
	if _, err := writeSnapshot(path, snap); err != nil {
		t.Fatal(err)
	}
	cat, _ = mustLoad(t, path)
	checkCatalog(t, "crash before the old journal's removal", cat, m)
	if cat.Seq != 6 {
		t.Errorf("seq %d, want 6", cat.Seq)
	}

	// Done: the old journal is removed; the rest is in the new one.
	st.compacted(seq, 100, old)
	if _, err := os.Stat(journalPath(path, 1)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the compacted journal file is still there: %v", err)
	}
	cat, _ = mustLoad(t, path)
	checkCatalog(t, "after the compaction", cat, m)
	st.close()
}

// TestCatalogGroupCommit: concurrent changes are all durable when
// acknowledged, and share writes.
func TestCatalogGroupCommit(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "catalog.json")
	st := openStore(path, slog.Default(), 0, 1)
	var mu sync.Mutex // stands for Dataplane.mu around append
	m := model{}
	var wg sync.WaitGroup
	for c := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				cs := jsvc(c, uint32(i+1))
				mu.Lock()
				seq, err := st.append(put(cs))
				m[cs.Service.Name] = cs
				mu.Unlock()
				if err != nil {
					t.Error(err)
					return
				}
				if err := st.wait(seq); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	cat, _ := mustLoad(t, path)
	checkCatalog(t, "after concurrent changes", cat, m)
	st.close()
}

// TestCatalogJournalWriteError: a failed write fails the change (and
// every later one) until a compaction writes the whole catalog again.
func TestCatalogJournalWriteError(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "catalog.json")
	st := openStore(path, slog.Default(), 0, 1)
	m := model{}
	journalTo(t, st, m, put(jsvc(0, 1)))
	cs := jsvc(1, 1)
	failWrite(t, st, cs)
	m[cs.Service.Name] = cs
	if !st.wantCompaction() {
		t.Fatal("a broken journal asks for no compaction")
	}
	seq, old := st.rotate()
	compactTo(t, st, path, seq, old, m.services())
	journalTo(t, st, m, put(jsvc(2, 1)))
	cat, _ := mustLoad(t, path)
	checkCatalog(t, "after the repair", cat, m)
	st.close()
}

// TestDataplaneCatalogSurvivesCrash: changes from concurrent clients,
// with compactions running meanwhile, are all in the catalog when they
// are acknowledged: a copy of the catalog files taken without Close (what
// kill -9 leaves) restores exactly the acknowledged services with their
// ids, also with a torn record at the end of the journal. After Close the
// catalog file alone holds the catalog.
func TestDataplaneCatalogSurvivesCrash(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "catalog.json")
	open := func(catalog string) *Dataplane {
		t.Helper()
		d, err := Open(context.Background(), Options{
			Loader:      bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierS},
			CatalogPath: catalog,
			GCInterval:  -1,
		})
		if err != nil {
			t.Fatalf("open: %v", err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	d := open(path)
	// Compact every few changes, so that compactions overlap changes.
	defer func(v int64) { compactMinBytes = v }(compactMinBytes)
	compactMinBytes = 4 << 10
	ctx := context.Background()
	var wg sync.WaitGroup
	for c := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 12 {
				n := c*20 + i%6
				var err error
				if i%4 == 3 {
					err = d.DeleteService(ctx, benchName(c*20+(i-1)%6)) // applied just before
				} else {
					_, err = d.ApplyService(ctx, benchService(n, uint32(1+i)))
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	want := d.Services()
	if len(want) == 0 {
		t.Fatal("no services")
	}

	// kill -9: the files as they are, without Close. A compaction the
	// last changes started may still be replacing files in the
	// background; a copy taken meanwhile mixes two states no crash can
	// leave (the node dies at one instant), so let it finish first.
	d.compacting.Wait()
	crash := t.TempDir()
	files, _ := filepath.Glob(path + "*")
	if len(files) < 2 {
		t.Errorf("catalog files %v: want a snapshot and a journal", files)
	}
	var last string
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(crash, filepath.Base(f)), data, 0o600)
		if strings.Contains(f, ".journal.") && f > last {
			last = f
		}
	}
	// The change that was being written when the node died.
	cs := jsvc(99, 1)
	rec, _ := appendRecord(nil, journalRecord{Seq: 1 << 40, Put: &cs})
	if last != "" {
		jf, err := os.OpenFile(filepath.Join(crash, filepath.Base(last)), os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			t.Fatal(err)
		}
		jf.Write(rec[:len(rec)/2])
		jf.Close()
	}
	restored := open(filepath.Join(crash, "catalog.json"))
	compareServices(t, "after a crash", restored.Services(), want)

	// A clean stop leaves the whole catalog in the catalog file.
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if js, _ := filepath.Glob(path + ".journal.*"); len(js) > 0 {
		for _, j := range js {
			if fi, err := os.Stat(j); err == nil && fi.Size() > 0 {
				t.Errorf("after Close, journal %s holds %d bytes", j, fi.Size())
			}
		}
	}
	cat, err := readCatalog(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(cat.Services) != len(want) {
		t.Errorf("after Close the catalog file holds %d services, want %d", len(cat.Services), len(want))
	}
}

func compareServices(t *testing.T, what string, got, want []ServiceStatus) {
	t.Helper()
	strip := func(ss []ServiceStatus) []string {
		var out []string
		for _, s := range ss {
			b, _ := json.Marshal(struct {
				Svc  Service
				Rev  uint64
				At   time.Time
				SIDs []uint32
			}{s.Service, s.Revision, s.AppliedAt, sids(s)})
			out = append(out, string(b))
		}
		return out
	}
	if g, w := strip(got), strip(want); !reflect.DeepEqual(g, w) {
		t.Errorf("%s: services\n%v\nwant\n%v", what, g, w)
	}
}

func sids(s ServiceStatus) []uint32 {
	var out []uint32
	for _, f := range s.Frontends {
		out = append(out, f.ServiceID)
	}
	return out
}

// TestCatalogCompactionKeepsNewerJournal: changes acknowledged after a
// compaction rotated the journal survive it even when a later write fails
// before the snapshot is in place: the compaction removes only the files
// its snapshot covers, never the newer generation that holds them.
func TestCatalogCompactionKeepsNewerJournal(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "catalog.json")
	st := openStore(path, slog.Default(), 0, 1)
	m := model{}
	journalTo(t, st, m, put(jsvc(0, 1)))
	seq, old := st.rotate()
	snap := m.services()
	// Acknowledged into the next generation while the snapshot is written.
	journalTo(t, st, m, put(jsvc(1, 1)))
	journalTo(t, st, m, put(jsvc(2, 1)))
	// Then a write fails: that change is not acknowledged.
	failWrite(t, st, jsvc(3, 1))
	compactTo(t, st, path, seq, old, snap)
	// A crash now: what is on disk must hold every acknowledged change.
	cat, _ := mustLoad(t, path)
	checkCatalog(t, "after the compaction", cat, m)
	st.close()
}

// TestCatalogTornFileBeforeNewerOne: a write that failed half-way leaves
// its journal file with a torn end; the compaction that repairs the
// journal sends later changes to the next file and removes the torn one,
// but a crash can come between the two. The start must accept it: the
// torn record was never acknowledged, and the next file continues the
// sequence.
func TestCatalogTornFileBeforeNewerOne(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "catalog.json")
	st := openStore(path, slog.Default(), 0, 1)
	m := model{}
	journalTo(t, st, m, put(jsvc(0, 1)))
	torn := journalPath(path, 1)
	failWrite(t, st, jsvc(1, 1)) // the write fails...
	f, err := os.OpenFile(torn, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte{0x20, 0, 0, 0, 1, 2, 3}); err != nil { // ...half-way
		t.Fatal(err)
	}
	f.Close()
	saved, err := os.ReadFile(torn)
	if err != nil {
		t.Fatal(err)
	}
	seq, old := st.rotate()
	compactTo(t, st, path, seq, old, m.services())
	journalTo(t, st, m, put(jsvc(2, 1)))
	// The crash came before the torn file was removed.
	if err := os.WriteFile(torn, saved, 0o600); err != nil {
		t.Fatal(err)
	}
	cat, _ := mustLoad(t, path)
	checkCatalog(t, "with the torn file left", cat, m)
	st.close()
}

// failWrite journals cs through a write that fails (the journal file is
// closed under the store) and checks it is not acknowledged.
func failWrite(t *testing.T, st *catalogStore, cs catalogService) {
	t.Helper()
	st.f.Close()
	seq, _ := st.append(put(cs))
	if err := st.wait(seq); err == nil {
		t.Fatal("a failed write was acknowledged")
	}
}

// compactTo completes a compaction that rotated the journal at seq (old
// its file): the snapshot of services written, then the store told.
func compactTo(t *testing.T, st *catalogStore, path string, seq uint64, old *os.File, services []catalogService) {
	t.Helper()
	if _, err := writeSnapshot(path, catalogFile{Version: catalogVersion, Seq: seq, Services: services}); err != nil {
		t.Fatal(err)
	}
	st.compacted(seq, 100, old)
}
