package catalog

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"
)

// fakeDataplane stands for the façade: the lock under which changes are
// appended (d.mu) and the state a compaction captures.
type fakeDataplane struct {
	mu sync.Mutex
	m  model
	st *Store
}

// newFake opens a store of the catalog at path (loaded, not started)
// over a fake dataplane holding what the catalog holds.
func newFake(t *testing.T, path string, cfg Config) *fakeDataplane {
	t.Helper()
	f := &fakeDataplane{m: model{}}
	cfg.Path = path
	st, err := New(cfg, Deps{Snapshot: f.snapshot})
	if err != nil {
		t.Fatal(err)
	}
	cat, _, err := st.Load()
	if err != nil {
		t.Fatal(err)
	}
	for _, cs := range cat.Services {
		f.m[cs.Service.Name] = cs
	}
	f.st = st
	t.Cleanup(func() { st.Drop() })
	return f
}

// openStore is a store of the catalog at path over a fake dataplane.
func openStore(t *testing.T, path string) *Store { return newFake(t, path, Config{}).st }

func (f *fakeDataplane) snapshot(cut func()) File {
	f.mu.Lock()
	defer f.mu.Unlock()
	cut()
	return File{Services: f.m.services()}
}

// appendChange makes change r under f.mu, as the façade does, and
// returns its seq without waiting for it.
func (f *fakeDataplane) appendChange(r Record) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	seq, err := f.st.Append(r)
	if err != nil {
		return 0, err
	}
	// The dataplane changed, saved or not.
	if r.Put != nil {
		f.m[r.Put.Service.Name] = *r.Put
	} else if r.Delete != "" {
		delete(f.m, r.Delete)
	}
	return seq, nil
}

// change makes change r and waits until it is durable.
func (f *fakeDataplane) change(r Record) error {
	seq, err := f.appendChange(r)
	if err != nil {
		return err
	}
	return f.st.Wait(seq)
}

// TestCompactionWhileAppending: a compaction captures the state and cuts
// the journal under the dataplane's lock, then writes the snapshot
// without it: changes are appended and acknowledged meanwhile, go to the
// next journal file, and survive the compaction (and a crash at any
// point of it) in order; the journal files the snapshot covers go.
func TestCompactionWhileAppending(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "catalog.json")
	f := newFake(t, path, Config{CompactMinBytes: 1})
	if err := f.change(put(jsvc(0, 1))); err != nil { // in journal file 1
		t.Fatal(err)
	}
	writing, release := make(chan struct{}), make(chan struct{})
	writeHook = func() {
		writeHook = nil // this compaction's alone
		close(writing)
		<-release
	}
	var once sync.Once
	letGo := func() { once.Do(func() { close(release) }) }
	t.Cleanup(func() { letGo(); writeHook = nil }) // before the store's Drop
	f.st.Start()                                   // the journal is larger than the snapshot: a compaction starts
	select {
	case <-writing:
	case <-time.After(10 * time.Second):
		t.Fatal("no compaction started")
	}
	// The compaction is about to write: the dataplane's lock is free.
	if !f.mu.TryLock() {
		t.Fatal("the compaction holds the dataplane's lock while it writes the snapshot")
	}
	f.mu.Unlock()
	// Changes go on meanwhile, acknowledged into the next journal file.
	for _, r := range []Record{put(jsvc(1, 1)), put(jsvc(0, 2)), del("svc-00001"), put(jsvc(2, 1))} {
		if err := f.change(r); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(journalPath(path, 2)); err != nil {
		t.Errorf("the changes during the compaction are not in the next journal file: %v", err)
	}
	// A crash now (the snapshot not in place yet) loses nothing.
	cat, _ := mustLoad(t, path)
	checkCatalog(t, "during the compaction", cat, f.m)
	letGo()
	f.st.WaitCompaction()

	snap, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Seq != 1 || len(snap.Services) != 1 {
		t.Errorf("snapshot: journal_seq %d with %d services, want the state at the cut: 1 with 1", snap.Seq, len(snap.Services))
	}
	files, _ := JournalFiles(path)
	if !slices.Equal(files, []string{journalPath(path, 2)}) {
		t.Errorf("journal files %v, want only the generation after the cut", files)
	}
	cat, _ = mustLoad(t, path)
	checkCatalog(t, "after the compaction", cat, f.m)
	if cat.Seq != 5 {
		t.Errorf("seq %d, want 5", cat.Seq)
	}
}

// TestStoreWaitSemantics: a change is durable (on disk, as a restart
// reads it) only once Wait returned nil for it; a failed write fails its
// change and the later ones until a compaction repairs the journal, which
// Settle starts; Close compacts, Drop does not.
func TestStoreWaitSemantics(t *testing.T) {
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, f *fakeDataplane, path string)
	}{
		{"durable once waited", func(t *testing.T, f *fakeDataplane, path string) {
			seq, err := f.appendChange(put(jsvc(0, 1)))
			if err != nil {
				t.Fatal(err)
			}
			if cat, _ := mustLoad(t, path); len(cat.Services) != 0 {
				t.Error("a change reached the disk before anyone waited for it")
			}
			if st := f.st.Status(); st.Seq != seq || st.Durable >= seq {
				t.Errorf("status %+v before the wait", st)
			}
			if err := f.st.Wait(seq); err != nil {
				t.Fatal(err)
			}
			cat, _ := mustLoad(t, path)
			checkCatalog(t, "after the wait", cat, f.m)
			if err := f.st.Wait(0); err != nil {
				t.Errorf("Wait(0): %v", err)
			}
		}},
		{"a failed write fails later changes", func(t *testing.T, f *fakeDataplane, path string) {
			if err := f.change(put(jsvc(0, 1))); err != nil {
				t.Fatal(err)
			}
			failWrite(t, f.st, jsvc(1, 1))
			if err := f.change(put(jsvc(2, 1))); err == nil {
				t.Error("a change after a failed write was acknowledged")
			}
		}},
		{"catch-up and settle repair with a compaction", func(t *testing.T, f *fakeDataplane, path string) {
			seq := unsaved(t, f)
			if err := f.st.Settle(f.st.CatchUp(seq)); err != nil {
				t.Fatalf("settle: %v", err)
			}
			settled(t, f, path, seq)
		}},
		{"settle alone repairs with a compaction", func(t *testing.T, f *fakeDataplane, path string) {
			seq := unsaved(t, f)
			if err := f.st.Settle(seq); err != nil {
				t.Fatalf("settle: %v", err)
			}
			settled(t, f, path, seq)
		}},
		{"close compacts", func(t *testing.T, f *fakeDataplane, path string) {
			for i := range 3 {
				if err := f.change(put(jsvc(i, 1))); err != nil {
					t.Fatal(err)
				}
			}
			if err := f.st.Close(); err != nil {
				t.Fatal(err)
			}
			snap, err := ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			checkCatalog(t, "the snapshot alone after Close", snap, f.m)
			if files, _ := JournalFiles(path); len(files) != 0 {
				t.Errorf("journal files after Close: %v", files)
			}
			if _, err := f.st.Append(put(jsvc(4, 1))); !errors.Is(err, ErrClosed) {
				t.Errorf("append after Close: %v, want ErrClosed", err)
			}
			if err := f.st.Close(); err != nil {
				t.Errorf("second Close: %v", err)
			}
		}},
		{"drop does not compact", func(t *testing.T, f *fakeDataplane, path string) {
			if err := f.change(put(jsvc(0, 1))); err != nil {
				t.Fatal(err)
			}
			if err := f.st.Drop(); err != nil {
				t.Fatal(err)
			}
			if snap, _ := ReadFile(path); len(snap.Services) != 0 {
				t.Error("Drop wrote a snapshot")
			}
			cat, _ := mustLoad(t, path)
			checkCatalog(t, "the journal after Drop", cat, f.m)
			if _, err := f.st.Append(put(jsvc(4, 1))); !errors.Is(err, ErrClosed) {
				t.Errorf("append after Drop: %v, want ErrClosed", err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "catalog.json")
			tc.run(t, newFake(t, path, Config{CompactMinBytes: 1 << 30}), path)
		})
	}
}

// unsaved makes a change whose write fails, in a started store, and
// returns its seq.
func unsaved(t *testing.T, f *fakeDataplane) uint64 {
	t.Helper()
	f.st.Start()
	if err := f.change(put(jsvc(0, 1))); err != nil {
		t.Fatal(err)
	}
	if err := f.st.FailNextWrite(); err != nil {
		t.Fatal(err)
	}
	seq, err := f.appendChange(put(jsvc(1, 1)))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.st.Wait(seq); err == nil {
		t.Fatal("a failed write was acknowledged")
	}
	return seq
}

// settled checks that the change seq is durable, on disk, and the
// journal works again.
func settled(t *testing.T, f *fakeDataplane, path string, seq uint64) {
	t.Helper()
	if f.st.CatchUp(seq) != 0 {
		t.Error("CatchUp after Settle: not durable")
	}
	cat, _ := mustLoad(t, path)
	checkCatalog(t, "after settle", cat, f.m)
	if err := f.change(put(jsvc(2, 1))); err != nil {
		t.Errorf("a change after the repair: %v", err)
	}
}

// TestStoreConfig: New rejects what it cannot work with.
func TestStoreConfig(t *testing.T) {
	snap := func(cut func()) File { cut(); return File{} }
	for _, tc := range []struct {
		name string
		cfg  Config
		deps Deps
	}{
		{"no path", Config{}, Deps{Snapshot: snap}},
		{"no snapshot", Config{Path: "/x"}, Deps{}},
		{"negative compaction size", Config{Path: "/x", CompactMinBytes: -1}, Deps{Snapshot: snap}},
	} {
		if _, err := New(tc.cfg, tc.deps); err == nil {
			t.Errorf("%s: New accepted it", tc.name)
		}
	}
}
