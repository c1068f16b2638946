package advert

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeClock returns a new time, one second later, on every call.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(time.Second)
	return c.t
}

func newTestPublisher(t *testing.T, path string) *Publisher {
	t.Helper()
	p, err := NewPublisher(Options{Path: path, Node: "node-a", Now: newFakeClock().Now})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// manyEntries returns n entries whose decisions depend on flip, so two
// calls with different flip differ in every entry; the file is large
// enough (tens of KiB) that an in-place write would be seen half done.
func manyEntries(n int, flip bool) []Entry {
	out := make([]Entry, 0, n)
	for i := range n {
		vip := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		ready := 0
		if (i%2 == 0) != flip {
			ready = 1
		}
		out = append(out, Decide(Input{
			VIP: vip, Service: fmt.Sprintf("service-%04d", i), Exposure: ExposureNorthSouth,
			Ports:   []Port{{Port: 443, Protocol: "tcp"}, {Port: 80, Protocol: "tcp"}},
			Enabled: true, Advertise: true, ReadyBackends: ready,
		}))
	}
	return out
}

func TestPublishContentChange(t *testing.T) {
	a := goldenEntries()
	b := goldenEntries()
	b[0].Advertised, b[0].Reason = false, ReasonNoReadyBackend
	type step struct {
		entries     []Entry
		wantChanged bool
		wantGen     uint64
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"first publish writes", []step{{a, true, 1}}},
		{"same content twice writes once", []step{{a, true, 1}, {a, false, 1}}},
		{"changed content bumps generation", []step{{a, true, 1}, {b, true, 2}}},
		{"back and forth", []step{{a, true, 1}, {b, true, 2}, {b, false, 2}, {a, true, 3}}},
		{"empty list is content too", []step{{nil, true, 1}, {[]Entry{}, false, 1}, {a, true, 2}, {nil, true, 3}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "adv.json")
			p := newTestPublisher(t, path)
			var prev Snapshot
			for i, st := range tt.steps {
				before, _ := os.Stat(path)
				s, changed, err := p.Publish(st.entries)
				if err != nil {
					t.Fatalf("step %d: %v", i, err)
				}
				if changed != st.wantChanged || s.Generation != st.wantGen {
					t.Fatalf("step %d: changed %v generation %d, want %v %d", i, changed, s.Generation, st.wantChanged, st.wantGen)
				}
				after, err := os.Stat(path)
				if err != nil {
					t.Fatal(err)
				}
				if changed {
					if i > 0 && !s.Timestamp.After(prev.Timestamp) {
						t.Fatalf("step %d: timestamp %v not after %v", i, s.Timestamp, prev.Timestamp)
					}
					if before != nil && os.SameFile(before, after) {
						t.Fatalf("step %d: file not replaced", i)
					}
				} else {
					if !s.Timestamp.Equal(prev.Timestamp) {
						t.Fatalf("step %d: timestamp moved without a change", i)
					}
					if !os.SameFile(before, after) || !before.ModTime().Equal(after.ModTime()) {
						t.Fatalf("step %d: file rewritten without a change", i)
					}
				}
				onDisk, err := Read(path)
				if err != nil {
					t.Fatalf("step %d: %v", i, err)
				}
				cur, ok := p.Current()
				if !ok || !reflect.DeepEqual(onDisk, s) || !reflect.DeepEqual(cur, s) {
					t.Fatalf("step %d: file %+v, Current %+v, Publish returned %+v", i, onDisk, cur, s)
				}
				prev = s
			}
		})
	}
}

func TestPublishOrderIndependent(t *testing.T) {
	base := manyEntries(50, false)
	orders := map[string][]Entry{
		"as built": slices.Clone(base),
		"reversed": func() []Entry { e := slices.Clone(base); slices.Reverse(e); return e }(),
		"rotated":  append(slices.Clone(base[17:]), base[:17]...),
		"interleaved": func() []Entry {
			var e []Entry
			for i := 0; i < len(base); i += 2 {
				e = append(e, base[i])
			}
			for i := 1; i < len(base); i += 2 {
				e = append(e, base[i])
			}
			return e
		}(),
	}
	path := filepath.Join(t.TempDir(), "adv.json")
	p := newTestPublisher(t, path)
	var want []byte
	for name, entries := range orders {
		_, changed, err := p.Publish(entries)
		if err != nil {
			t.Fatal(err)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if want == nil {
			want = data
			if !changed {
				t.Fatal("first publish did not write")
			}
			continue
		}
		if changed || string(data) != string(want) {
			t.Fatalf("order %q: changed %v, file differs %v", name, changed, string(data) != string(want))
		}
	}
	s, _ := p.Current()
	if !slices.IsSortedFunc(s.Entries, compareEntries) {
		t.Fatal("entries not in canonical order")
	}
	// A separate publisher given another order writes the same bytes.
	path2 := filepath.Join(t.TempDir(), "adv.json")
	if _, _, err := newTestPublisher(t, path2).Publish(orders["reversed"]); err != nil {
		t.Fatal(err)
	}
	if data, _ := os.ReadFile(path2); string(data) != string(want) {
		t.Fatal("two publishers wrote different bytes for the same content")
	}
}

func TestPublishDoesNotModifyInput(t *testing.T) {
	in := goldenEntries()
	saved := make([]Entry, len(in))
	for i, e := range in {
		e.Ports = slices.Clone(e.Ports)
		saved[i] = e
	}
	p := newTestPublisher(t, filepath.Join(t.TempDir(), "adv.json"))
	if _, _, err := p.Publish(in); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(in, saved) {
		t.Fatal("Publish modified the caller's entries")
	}
	s, _ := p.Current()
	s.Entries[0].Ports[0].Port = 9
	s.Entries[0].Service = "changed"
	if again, _ := p.Current(); again.Entries[0].Service == "changed" || again.Entries[0].Ports[0].Port == 9 {
		t.Fatal("Current shares memory with the publisher")
	}
}

// TestAtomicReplaceUnderConcurrentReader publishes hundreds of large,
// alternating snapshots while another goroutine reads the file in a tight
// loop: every read must be a complete, valid snapshot, and generations
// must never go backwards.
func TestAtomicReplaceUnderConcurrentReader(t *testing.T) {
	const (
		entries    = 400
		iterations = 300
	)
	path := filepath.Join(t.TempDir(), "adv.json")
	p := newTestPublisher(t, path)
	snapA, snapB := manyEntries(entries, false), manyEntries(entries, true)
	if _, _, err := p.Publish(snapA); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(path); st.Size() < 64<<10 {
		t.Fatalf("snapshot is only %d bytes; make it larger so partial writes would show", st.Size())
	}

	var stop atomic.Bool
	var reads, distinct atomic.Int64
	errc := make(chan error, 1)
	go func() {
		defer close(errc)
		var last uint64
		for !stop.Load() {
			data, err := os.ReadFile(path)
			if err != nil {
				errc <- fmt.Errorf("read %d: %v", reads.Load(), err)
				return
			}
			s, err := Decode(data)
			if err != nil {
				errc <- fmt.Errorf("read %d: partial or invalid file (%d bytes): %v", reads.Load(), len(data), err)
				return
			}
			if len(s.Entries) != entries {
				errc <- fmt.Errorf("read %d: %d entries, want %d", reads.Load(), len(s.Entries), entries)
				return
			}
			if s.Generation < last {
				errc <- fmt.Errorf("generation went back from %d to %d", last, s.Generation)
				return
			}
			if s.Generation != last {
				distinct.Add(1)
			}
			last = s.Generation
			reads.Add(1)
		}
	}()
	for i := range iterations {
		next := snapB
		if i%2 == 1 {
			next = snapA
		}
		if _, changed, err := p.Publish(next); err != nil || !changed {
			t.Fatalf("publish %d: changed %v err %v", i, changed, err)
		}
	}
	stop.Store(true)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	s, _ := p.Current()
	if s.Generation != iterations+1 {
		t.Fatalf("generation %d, want %d", s.Generation, iterations+1)
	}
	t.Logf("%d reads saw %d distinct generations of %d", reads.Load(), distinct.Load(), iterations+1)
	if reads.Load() == 0 {
		t.Fatal("reader never read the file")
	}
	left, _ := filepath.Glob(filepath.Join(filepath.Dir(path), ".*tmp-*"))
	if len(left) != 0 {
		t.Fatalf("temporary files left behind: %v", left)
	}
}

func TestConcurrentPublish(t *testing.T) {
	path := filepath.Join(t.TempDir(), "adv.json")
	p := newTestPublisher(t, path)
	const workers, rounds = 8, 40
	var writes atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for r := range rounds {
				_, changed, err := p.Publish(manyEntries(20, (w+r)%2 == 0))
				if err != nil {
					t.Error(err)
					return
				}
				if changed {
					writes.Add(1)
				}
			}
		})
	}
	wg.Wait()
	cur, _ := p.Current()
	if cur.Generation != uint64(writes.Load()) {
		t.Fatalf("generation %d, but %d publishes wrote", cur.Generation, writes.Load())
	}
	onDisk, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(onDisk, cur) {
		t.Fatal("file and Current disagree after concurrent publishes")
	}
}

func TestRestartContinuesGeneration(t *testing.T) {
	path := filepath.Join(t.TempDir(), "adv.json")
	a, b := manyEntries(10, false), manyEntries(10, true)
	first := newTestPublisher(t, path)
	for _, e := range [][]Entry{a, b, a} {
		if _, _, err := first.Publish(e); err != nil {
			t.Fatal(err)
		}
	}
	before, _ := first.Current()
	fiBefore, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}

	// Restart with unchanged content: nothing is written.
	second := newTestPublisher(t, path)
	if err := second.LoadError(); err != nil {
		t.Fatalf("LoadError = %v", err)
	}
	if cur, ok := second.Current(); !ok || !reflect.DeepEqual(cur, before) {
		t.Fatalf("Current after restart = %+v, %v; want %+v", cur, ok, before)
	}
	reversed := slices.Clone(a)
	slices.Reverse(reversed)
	s, changed, err := second.Publish(reversed)
	if err != nil {
		t.Fatal(err)
	}
	if changed || s.Generation != before.Generation {
		t.Fatalf("after restart, same content: changed %v generation %d, want false %d", changed, s.Generation, before.Generation)
	}
	fiAfter, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(fiBefore, fiAfter) || !fiBefore.ModTime().Equal(fiAfter.ModTime()) {
		t.Fatal("unchanged content was rewritten after restart")
	}

	// Changed content continues the generation.
	s, changed, err = second.Publish(b)
	if err != nil || !changed || s.Generation != before.Generation+1 {
		t.Fatalf("after restart, new content: changed %v generation %d err %v, want true %d", changed, s.Generation, err, before.Generation+1)
	}

	// A node name change is a content change.
	third, err := NewPublisher(Options{Path: path, Node: "node-b", Now: newFakeClock().Now})
	if err != nil {
		t.Fatal(err)
	}
	s, changed, err = third.Publish(b)
	if err != nil || !changed || s.Generation != before.Generation+2 || s.Node != "node-b" {
		t.Fatalf("node rename: changed %v generation %d node %q err %v", changed, s.Generation, s.Node, err)
	}
}

func TestExistingFileNotValid(t *testing.T) {
	tests := []struct {
		name    string
		content string
		want    error
	}{
		{"garbage", "not json{", ErrCorrupt},
		{"empty file", "", ErrCorrupt},
		{"truncated", `{"schema_version": 1, "generation": 9, "entr`, ErrCorrupt},
		{"foreign json", `{"routes": ["203.0.113.10/32"]}`, ErrCorrupt},
		{"other schema version", `{"schema_version": 7, "generation": 9, "entries": []}`, ErrSchemaVersion},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "adv.json")
			if err := os.WriteFile(path, []byte(tt.content), 0o600); err != nil {
				t.Fatal(err)
			}
			p := newTestPublisher(t, path)
			if err := p.LoadError(); !errors.Is(err, tt.want) || !strings.HasPrefix(err.Error(), "advert: open "+path+": ") {
				t.Fatalf("LoadError = %v, want %v with path", err, tt.want)
			}
			if _, ok := p.Current(); ok {
				t.Fatal("Current set from an invalid file")
			}
			s, changed, err := p.Publish(nil)
			if err != nil || !changed || s.Generation != 1 {
				t.Fatalf("publish over invalid file: changed %v generation %d err %v", changed, s.Generation, err)
			}
			if _, err := Read(path); err != nil {
				t.Fatalf("file not replaced: %v", err)
			}
			fi, _ := os.Stat(path)
			if fi.Mode().Perm() != FileMode {
				t.Fatalf("mode %v, want %v", fi.Mode().Perm(), FileMode)
			}
		})
	}
}

func TestNewPublisherUnreadable(t *testing.T) {
	// A directory where the file should be cannot be read: an error, not
	// a silent replacement.
	path := filepath.Join(t.TempDir(), "adv.json")
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := NewPublisher(Options{Path: path}); err == nil || !strings.HasPrefix(err.Error(), "advert: open: ") {
		t.Fatalf("NewPublisher err = %v, want advert: open: ...", err)
	}
}

func TestCreatesDirectory(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "fluxvm", "adv.json")
	p := newTestPublisher(t, path)
	if _, err := os.Stat(filepath.Dir(path)); err == nil {
		t.Fatal("NewPublisher created the directory; only Publish should")
	}
	if _, _, err := p.Publish(goldenEntries()); err != nil {
		t.Fatal(err)
	}
	di, err := os.Stat(filepath.Dir(path))
	if err != nil || !di.IsDir() {
		t.Fatalf("directory not created: %v", err)
	}
	if di.Mode().Perm()&^DirMode != 0 {
		t.Fatalf("directory mode %v is wider than %v", di.Mode().Perm(), DirMode)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != FileMode {
		t.Fatalf("file mode %v, want %v", fi.Mode().Perm(), FileMode)
	}
}

func TestPublishWriteFailureKeepsState(t *testing.T) {
	blocker := filepath.Join(t.TempDir(), "sub")
	p := newTestPublisher(t, filepath.Join(blocker, "adv.json"))
	// The directory of the target becomes a regular file: MkdirAll fails.
	if err := os.WriteFile(blocker, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	_, changed, err := p.Publish(goldenEntries())
	if err == nil || changed || !strings.HasPrefix(err.Error(), "advert: publish "+p.Path()+": ") {
		t.Fatalf("Publish = changed %v err %v, want a wrapped error", changed, err)
	}
	if _, ok := p.Current(); ok {
		t.Fatal("Current set after a failed write")
	}
	// Once the path is usable, the same Publisher writes generation 1.
	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	s, changed, err := p.Publish(goldenEntries())
	if err != nil || !changed || s.Generation != 1 {
		t.Fatalf("retry: changed %v generation %d err %v", changed, s.Generation, err)
	}
}

func TestStaleTempFilesRemoved(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "adv.json")
	stale := filepath.Join(dir, ".adv.json.tmp-12345")
	other := filepath.Join(dir, ".other.json.tmp-1")
	for _, f := range []string{stale, other} {
		if err := os.WriteFile(f, []byte("{"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	newTestPublisher(t, path)
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("stale temp file not removed: %v", err)
	}
	if _, err := os.Stat(other); err != nil {
		t.Fatalf("someone else's file removed: %v", err)
	}
}
