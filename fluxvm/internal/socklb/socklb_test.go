package socklb

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// fakeDP keeps the pinned socket hooks of each cgroup id as bpf.Datapath
// does: AttachCgroup keeps the hooks already pinned and pins the others,
// DetachCgroupID removes a cgroup's pins together.
type fakeDP struct {
	mu        sync.Mutex
	ids       map[string]uint64 // cgroup path -> id
	pins      map[uint64]map[bpf.CgroupHook]bool
	attachErr error
	listErr   error
	detachErr map[uint64]error
	destroyed int // what DestroyStaleUDPSockets reports
	destroys  int // its calls
}

func newFakeDP(pins map[uint64][]bpf.CgroupHook) *fakeDP {
	f := &fakeDP{ids: map[string]uint64{"/cg/a": 10, "/cg/b": 20}, pins: map[uint64]map[bpf.CgroupHook]bool{}, detachErr: map[uint64]error{}}
	for id, hs := range pins {
		f.pins[id] = map[bpf.CgroupHook]bool{}
		for _, h := range hs {
			f.pins[id][h] = true
		}
	}
	return f
}

func (f *fakeDP) AttachCgroup(path string) (bpf.CgroupAttachment, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.attachErr != nil {
		return bpf.CgroupAttachment{}, f.attachErr
	}
	id, ok := f.ids[path]
	if !ok {
		return bpf.CgroupAttachment{}, fmt.Errorf("bpf: attach socket hooks: %s: %w", path, bpf.ErrNotCgroupV2)
	}
	a := bpf.CgroupAttachment{Path: path, ID: id, Reused: true}
	if f.pins[id] == nil {
		f.pins[id] = map[bpf.CgroupHook]bool{}
	}
	for _, h := range bpf.CgroupHooks {
		if !f.pins[id][h] {
			a.Reused = false
			f.pins[id][h] = true
			a.New = append(a.New, h)
		}
		a.Hooks = append(a.Hooks, h)
	}
	return a, nil
}

func (f *fakeDP) CgroupAttachments() ([]bpf.CgroupAttachment, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.listErr != nil {
		return nil, f.listErr
	}
	var out []bpf.CgroupAttachment
	for _, id := range slices.Sorted(maps.Keys(f.pins)) {
		a := bpf.CgroupAttachment{ID: id}
		for _, h := range bpf.CgroupHooks {
			if f.pins[id][h] {
				a.Hooks = append(a.Hooks, h)
			}
		}
		out = append(out, a)
	}
	return out, nil
}

func (f *fakeDP) DetachCgroupID(id uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.detachErr[id]; err != nil {
		return err
	}
	if len(f.pins[id]) == 0 {
		return fmt.Errorf("bpf: detach socket hooks of cgroup %d: %w", id, bpf.ErrNotAttached)
	}
	delete(f.pins, id)
	return nil
}

func (f *fakeDP) DestroyStaleUDPSockets() (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.destroys++
	return f.destroyed, nil
}

// pinned says how many hooks each cgroup id holds.
func (f *fakeDP) pinned() map[uint64]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[uint64]int{}
	for id, hs := range f.pins {
		out[id] = len(hs)
	}
	return out
}

func hookNames(hs []bpf.CgroupHook) []string {
	out := []string{}
	for _, h := range hs {
		out = append(out, string(h))
	}
	return out
}

// TestAttach: the configured cgroup gets every hook (an earlier start's
// kept), every other cgroup loses ours, those that cannot be detached
// are reported stale, and the undo removes only what this start attached
// alone; without Enabled every cgroup loses ours.
func TestAttach(t *testing.T) {
	all := len(bpf.CgroupHooks)
	gone := errors.New("permission denied")
	for _, tc := range []struct {
		name      string
		cfg       Config
		pins      map[uint64][]bpf.CgroupHook // before
		detachErr map[uint64]error
		listErr   error
		attachErr error

		wantErr   bool
		want      Status
		wantPins  map[uint64]int // after Attach
		wantUndo  bool
		afterUndo map[uint64]int
	}{
		{name: "first start", cfg: Config{Enabled: true, CgroupPath: "/cg/a"},
			want:     Status{Enabled: true, CgroupPath: "/cg/a", CgroupID: 10, Hooks: hookNames(bpf.CgroupHooks)},
			wantPins: map[uint64]int{10: all}, wantUndo: true, afterUndo: map[uint64]int{}},
		{name: "restart keeps the pinned hooks", cfg: Config{Enabled: true, CgroupPath: "/cg/a"},
			pins:     map[uint64][]bpf.CgroupHook{10: bpf.CgroupHooks},
			want:     Status{Enabled: true, CgroupPath: "/cg/a", CgroupID: 10, Hooks: hookNames(bpf.CgroupHooks), Reused: true},
			wantPins: map[uint64]int{10: all}},
		{name: "hooks added beside an earlier start's stay at undo", cfg: Config{Enabled: true, CgroupPath: "/cg/a"},
			pins:     map[uint64][]bpf.CgroupHook{10: bpf.CgroupHooks[:2]},
			want:     Status{Enabled: true, CgroupPath: "/cg/a", CgroupID: 10, Hooks: hookNames(bpf.CgroupHooks)},
			wantPins: map[uint64]int{10: all}, wantUndo: true, afterUndo: map[uint64]int{10: all}},
		{name: "moved to another cgroup", cfg: Config{Enabled: true, CgroupPath: "/cg/a"},
			pins:     map[uint64][]bpf.CgroupHook{20: bpf.CgroupHooks},
			want:     Status{Enabled: true, CgroupPath: "/cg/a", CgroupID: 10, Hooks: hookNames(bpf.CgroupHooks)},
			wantPins: map[uint64]int{10: all}, wantUndo: true, afterUndo: map[uint64]int{}},
		{name: "a cgroup that cannot be detached is stale", cfg: Config{Enabled: true, CgroupPath: "/cg/a"},
			pins:      map[uint64][]bpf.CgroupHook{20: bpf.CgroupHooks, 30: bpf.CgroupHooks, 40: {bpf.HookConnect4}},
			detachErr: map[uint64]error{30: gone, 40: fmt.Errorf("cgroup gone: %w", bpf.ErrNotAttached)},
			want: Status{Enabled: true, CgroupPath: "/cg/a", CgroupID: 10, Hooks: hookNames(bpf.CgroupHooks),
				StaleCgroups: []uint64{30}},
			wantPins: map[uint64]int{10: all, 30: all, 40: 1}, wantUndo: true, afterUndo: map[uint64]int{30: all, 40: 1}},
		{name: "listing fails: attached all the same", cfg: Config{Enabled: true, CgroupPath: "/cg/b"},
			pins: map[uint64][]bpf.CgroupHook{10: bpf.CgroupHooks}, listErr: gone,
			want:     Status{Enabled: true, CgroupPath: "/cg/b", CgroupID: 20, Hooks: hookNames(bpf.CgroupHooks)},
			wantPins: map[uint64]int{10: all, 20: all}, wantUndo: true, afterUndo: map[uint64]int{10: all}},
		{name: "attach fails", cfg: Config{Enabled: true, CgroupPath: "/cg/a"}, attachErr: gone,
			pins:    map[uint64][]bpf.CgroupHook{20: bpf.CgroupHooks},
			wantErr: true, want: Status{Enabled: true, Hooks: []string{}}, wantPins: map[uint64]int{20: all}},
		{name: "off removes every cgroup's", cfg: Config{},
			pins:      map[uint64][]bpf.CgroupHook{10: bpf.CgroupHooks, 20: bpf.CgroupHooks, 30: bpf.CgroupHooks},
			detachErr: map[uint64]error{30: gone},
			want:      Status{Hooks: []string{}, StaleCgroups: []uint64{30}}, wantPins: map[uint64]int{30: all}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeDP(tc.pins)
			f.listErr, f.attachErr = tc.listErr, tc.attachErr
			maps.Copy(f.detachErr, tc.detachErr)
			l, err := New(tc.cfg, Deps{Datapath: f, Log: quiet})
			if err != nil {
				t.Fatal(err)
			}
			undo, err := l.Attach()
			if (err != nil) != tc.wantErr {
				t.Fatalf("Attach: %v, want error %v", err, tc.wantErr)
			}
			if err != nil && (!errors.Is(err, gone) || !strings.HasPrefix(err.Error(), "cgroup_connect: ")) {
				t.Errorf("Attach: %v, want cgroup_connect: wrapping the datapath's", err)
			}
			if st := l.Status(); !equalStatus(st, tc.want) {
				t.Errorf("status %+v, want %+v", st, tc.want)
			}
			if got := f.pinned(); !maps.Equal(got, tc.wantPins) {
				t.Errorf("pins %v, want %v", got, tc.wantPins)
			}
			if (undo != nil) != tc.wantUndo {
				t.Fatalf("undo %v, want one: %v", undo != nil, tc.wantUndo)
			}
			if undo == nil {
				return
			}
			if err := undo(); err != nil {
				t.Errorf("undo: %v", err)
			}
			if got := f.pinned(); !maps.Equal(got, tc.afterUndo) {
				t.Errorf("after undo: pins %v, want %v", got, tc.afterUndo)
			}
			l.Removed()
			if st := l.Status(); st.Enabled != tc.cfg.Enabled || st.CgroupID != 0 || st.CgroupPath != "" || len(st.Hooks) != 0 || st.Hooks == nil || st.StaleCgroups != nil {
				t.Errorf("after Removed: status %+v", st)
			}
		})
	}
}

func equalStatus(a, b Status) bool {
	return a.Enabled == b.Enabled && a.CgroupPath == b.CgroupPath && a.CgroupID == b.CgroupID &&
		slices.Equal(a.Hooks, b.Hooks) && (a.Hooks == nil) == (b.Hooks == nil) && a.Reused == b.Reused &&
		slices.Equal(a.StaleCgroups, b.StaleCgroups) && a.Destroy == b.Destroy
}

// TestNew: a cgroup path is required (absolute) with Enabled and refused
// without, a datapath always.
func TestNew(t *testing.T) {
	f := newFakeDP(nil)
	for _, tc := range []struct {
		name string
		cfg  Config
		dp   Datapath
		ok   bool
	}{
		{"off", Config{}, f, true},
		{"on", Config{Enabled: true, CgroupPath: "/cg/a"}, f, true},
		{"on without a path", Config{Enabled: true}, f, false},
		{"on with a relative path", Config{Enabled: true, CgroupPath: "cg/a"}, f, false},
		{"off with a path", Config{CgroupPath: "/cg/a"}, f, false},
		{"no datapath", Config{}, nil, false},
	} {
		l, err := New(tc.cfg, Deps{Datapath: tc.dp})
		if (err == nil) != tc.ok || (l != nil) != tc.ok {
			t.Errorf("%s: New = %v, %v; want ok %v", tc.name, l, err, tc.ok)
		}
	}
}

// worker is an LB with a destroy function the test controls.
func worker(t *testing.T, every time.Duration, run func() (int, error)) *LB {
	t.Helper()
	l, err := New(Config{Enabled: true, CgroupPath: "/cg/a", DestroyInterval: every},
		Deps{Datapath: newFakeDP(nil), Destroy: run, Log: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// TestDestroyCoalesces: the worker runs once at start (a request before
// Start adds nothing to it), then once per request; requests made while
// a run is under way coalesce into one more run; destroyed sockets are
// summed.
func TestDestroyCoalesces(t *testing.T) {
	release := make(chan struct{})
	var runs atomic.Int32
	l := worker(t, -1, func() (int, error) {
		runs.Add(1)
		<-release
		return 2, nil
	})
	t.Cleanup(func() { close(release) }) // before Close: a failure does not hang
	// finish lets the run under way end, and checks that n runs were
	// made and recorded, and no more.
	finish := func(what string, n int32) {
		t.Helper()
		release <- struct{}{}
		testenv.Eventually(t, what+": run recorded", func() bool { return l.Status().Destroy.Runs == uint64(n) })
		time.Sleep(20 * time.Millisecond)
		if got := runs.Load(); got != n {
			t.Fatalf("%s: %d runs, want %d", what, got, n)
		}
	}
	l.Request()
	l.Start()
	testenv.Eventually(t, "the first run", func() bool { return runs.Load() == 1 })
	finish("a request before Start, and Start", 1)
	l.Request()
	testenv.Eventually(t, "the second run", func() bool { return runs.Load() == 2 })
	// The second run is blocked: ten requests meanwhile make one more run.
	for range 10 {
		l.Request()
	}
	release <- struct{}{}
	testenv.Eventually(t, "the third run", func() bool { return runs.Load() == 3 })
	finish("a burst of requests during a run", 3)
	st := l.Status().Destroy
	if st.Destroyed != 6 || st.LastDestroyed != 2 || st.Supported == nil || !*st.Supported || st.LastRun.IsZero() || st.LastError != "" {
		t.Errorf("status %+v", st)
	}
	// One more request, one more run.
	l.Request()
	release <- struct{}{}
	testenv.Eventually(t, "the fourth run to be recorded", func() bool { return l.Status().Destroy.Runs == 4 })
}

// TestDestroyPeriod: with a period the worker runs on its own; with none
// (negative), only at start.
func TestDestroyPeriod(t *testing.T) {
	for _, tc := range []struct {
		every    time.Duration
		min, max int32 // runs in 300 ms
	}{
		{10 * time.Millisecond, 5, 40},
		{-1, 1, 1},
	} {
		var runs atomic.Int32
		l := worker(t, tc.every, func() (int, error) { runs.Add(1); return 0, nil })
		l.Start()
		time.Sleep(300 * time.Millisecond)
		l.Close()
		if n := runs.Load(); n < tc.min || n > tc.max {
			t.Errorf("period %v: %d runs in 300 ms, want %d..%d", tc.every, n, tc.min, tc.max)
		}
		if got := l.Status().Destroy.Runs; got != uint64(runs.Load()) {
			t.Errorf("period %v: status says %d runs, the function ran %d", tc.every, got, runs.Load())
		}
	}
}

// TestDestroyErrors: a failure is reported and retried; on a kernel
// without bpf_sock_destroy the worker reports it once and stops trying.
func TestDestroyErrors(t *testing.T) {
	var runs atomic.Int32
	fail := errors.New("iterator broke")
	l := worker(t, time.Millisecond, func() (int, error) {
		if runs.Add(1) == 1 {
			return 0, fail
		}
		return 0, fmt.Errorf("bpf: destroy stale UDP sockets: %w", bpf.ErrSockDestroyUnsupported)
	})
	l.Start()
	testenv.Eventually(t, "the refusal", func() bool { st := l.Status().Destroy; return st.Supported != nil && !*st.Supported })
	for range 5 {
		l.Request()
		time.Sleep(5 * time.Millisecond)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("%d runs: want the failed one and the refused one, then none", n)
	}
	if st := l.Status().Destroy; st.Runs != 2 || !strings.Contains(st.LastError, bpf.ErrSockDestroyUnsupported.Error()) {
		t.Errorf("status %+v", st)
	}

	// A failure alone: reported, retried, cleared by a success.
	runs.Store(0)
	l = worker(t, -1, func() (int, error) {
		if runs.Add(1) == 1 {
			return 0, fail
		}
		return 1, nil
	})
	l.Start()
	testenv.Eventually(t, "the failed run", func() bool { return l.Status().Destroy.Runs == 1 })
	if st := l.Status().Destroy; st.LastError != fail.Error() || st.Supported != nil {
		t.Errorf("after a failure: status %+v", st)
	}
	l.Request()
	testenv.Eventually(t, "the retry", func() bool { return l.Status().Destroy.Runs == 2 })
	if st := l.Status().Destroy; st.LastError != "" || st.Supported == nil || !*st.Supported || st.Destroyed != 1 {
		t.Errorf("after a success: status %+v", st)
	}
}

// TestDestroyClose: Close waits for a run under way, and then nothing
// runs any more; it is idempotent, and fine before Start and on an LB
// that is off (or nil).
func TestDestroyClose(t *testing.T) {
	release := make(chan struct{})
	var runs atomic.Int32
	l := worker(t, time.Millisecond, func() (int, error) {
		runs.Add(1)
		<-release
		return 0, nil
	})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) }) // before Close: a failure does not hang
	l.Start()
	testenv.Eventually(t, "the first run", func() bool { return runs.Load() == 1 })
	closed := make(chan struct{})
	go func() { l.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while a run was under way")
	case <-time.After(50 * time.Millisecond):
	}
	once.Do(func() { close(release) })
	<-closed
	if st := l.Status().Destroy; st.Runs != 1 {
		t.Errorf("after Close: status %+v, want the run recorded", st)
	}
	l.Request()
	time.Sleep(20 * time.Millisecond)
	if n := runs.Load(); n != 1 {
		t.Errorf("%d runs after Close, want 1", n)
	}
	if err := l.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}

	// Closed before Start: nothing runs, ever.
	l = worker(t, time.Millisecond, func() (int, error) { runs.Add(1); return 0, nil })
	l.Close()
	l.Start()
	time.Sleep(20 * time.Millisecond)
	if n := runs.Load(); n != 1 {
		t.Errorf("closed before Start: %d runs", n-1)
	}

	off, err := New(Config{}, Deps{Datapath: newFakeDP(nil)})
	if err != nil {
		t.Fatal(err)
	}
	var none *LB
	for _, l := range []*LB{off, none} {
		l.Start()
		l.Request()
		if err := l.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if st := l.Status().Destroy; st != (DestroyStatus{}) {
			t.Errorf("status %+v of an LB that is off", st)
		}
	}
}

// TestDestroyDefault: without Deps.Destroy the worker runs the
// datapath's socket iterator, inside InNamespace.
func TestDestroyDefault(t *testing.T) {
	f := newFakeDP(nil)
	f.destroyed = 3
	var inNS atomic.Int32
	l, err := New(Config{Enabled: true, CgroupPath: "/cg/a", DestroyInterval: -1}, Deps{Datapath: f, Log: quiet,
		InNamespace: func(fn func() error) error { inNS.Add(1); return fn() }})
	if err != nil {
		t.Fatal(err)
	}
	l.Start()
	defer l.Close()
	testenv.Eventually(t, "the first run", func() bool { return l.Status().Destroy.Runs == 1 })
	f.mu.Lock()
	calls := f.destroys
	f.mu.Unlock()
	if st := l.Status().Destroy; calls != 1 || inNS.Load() != 1 || st.Destroyed != 3 {
		t.Errorf("%d calls of the iterator, %d in the namespace, status %+v", calls, inNS.Load(), st)
	}
}
