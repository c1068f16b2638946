// Package socklb is socket load balancing (cgroup_connect) of a
// dataplane: the attachment of the datapath's socket hooks to one cgroup
// v2 directory, and the worker that terminates connected UDP sockets
// whose backend can no longer serve them.
//
// With Config.Enabled, Attach attaches the socket hooks of the datapath
// (bpf.CgroupHooks: connect4/6, sendmsg4/6, recvmsg4/6, getpeername4/6,
// sock_release) to Config.CgroupPath, with links pinned under the pin
// root: they keep serving while the process is down, and the next start
// finds them and keeps them (a program reload updates them in place, with
// no gap). A process in that cgroup, or below it, that connects or sends
// to a VIP gets its socket addressed to a backend picked by the same rules
// as TC; every failure of the hooks leaves the address as it was, and TC
// serves the packets as it serves any client (fail-open). Attach also
// removes our hooks from every other cgroup; without Enabled it removes
// every one an earlier start left. Hooks it cannot remove are logged and
// reported (Status.StaleCgroups), not an error: they must not stop the
// node from starting.
//
// A connected UDP socket's sends carry no address, so no hook can move it
// off a backend that went away. Start runs a background worker that calls
// the datapath's socket iterator (Datapath.DestroyStaleUDPSockets, Linux
// 6.5+) in the node's network namespace: once at start, after every
// Request (the dataplane asks after changes that can leave a backend
// unable to serve: removed, programmed Unhealthy, or Draining with its
// deadline passed), and every Config.DestroyInterval, for drain deadlines
// that pass with no change. Requests while it runs coalesce into one more
// run. After the kernel refused (bpf.ErrSockDestroyUnsupported) it stops
// trying.
//
// What it needs of the datapath it declares as Datapath (*bpf.Datapath
// implements it), so that its tests run on a fake, without root.
//
// Locks: an LB has its own mutex for the attachment bookkeeping, and the
// worker one for its status; neither is held while calling the datapath
// or while taking the other. The dataplane may hold its own lock while
// calling into an LB (Request from the apply path, Status); an LB never
// calls back into the dataplane.
package socklb

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/cgroup2"
)

// DefaultDestroyInterval is how often, besides after Request, the worker
// terminates connected UDP sockets whose backend can no longer serve
// them: a drain deadline passes with no change of the catalog.
const DefaultDestroyInterval = 5 * time.Second

// Datapath is what socket load balancing needs of the datapath;
// *bpf.Datapath implements it.
type Datapath interface {
	// AttachCgroup attaches the socket hooks to the cgroup v2 directory
	// path, keeping links an earlier start pinned there.
	AttachCgroup(path string) (bpf.CgroupAttachment, error)
	// CgroupAttachments lists the cgroups holding our pinned hooks.
	CgroupAttachments() ([]bpf.CgroupAttachment, error)
	// DetachCgroupID removes our hooks from the cgroup with id
	// (bpf.ErrNotAttached: there were none).
	DetachCgroupID(id uint64) error
	// DestroyStaleUDPSockets terminates the connected UDP sockets whose
	// backend can no longer serve them, and says how many.
	DestroyStaleUDPSockets() (int, error)
}

// Config is what socket load balancing does.
type Config struct {
	// Enabled is cgroup_connect. False: Attach removes the hooks an
	// earlier start left, and Start starts no worker.
	Enabled bool
	// CgroupPath is the cgroup v2 directory the hooks attach to, as
	// CgroupDir resolves it; required (absolute) with Enabled, empty
	// without.
	CgroupPath string
	// DestroyInterval is the worker's period: 0 means
	// DefaultDestroyInterval, a negative one no timer (runs at start and
	// on Request only).
	DestroyInterval time.Duration
}

// Deps are what an LB uses of the rest of the dataplane.
type Deps struct {
	// Datapath is the loaded datapath; required.
	Datapath Datapath
	// InNamespace runs a function in the node's network namespace (the
	// socket iterator walks that namespace's sockets); nil: the calling
	// thread's.
	InNamespace func(func() error) error
	// Destroy replaces InNamespace(Datapath.DestroyStaleUDPSockets) in
	// the worker (tests); nil: that.
	Destroy func() (int, error)
	// Log receives what the LB does; nil: slog.Default().
	Log *slog.Logger
}

// Status is the state of socket load balancing (cgroup_connect).
type Status struct {
	// Enabled is cgroup_connect.
	Enabled bool `json:"enabled"`
	// CgroupPath is the cgroup v2 directory the hooks are attached to
	// (cgroup_path, or the root of the hierarchy), and CgroupID its
	// cgroup id; absent when not enabled.
	CgroupPath string `json:"cgroup_path,omitempty"`
	CgroupID   uint64 `json:"cgroup_id,omitempty"`
	// Hooks are the socket hooks attached (connect4, connect6, sendmsg4,
	// sendmsg6, recvmsg4, recvmsg6, getpeername4, getpeername6).
	Hooks []string `json:"hooks"`
	// Reused: the hooks were pinned by an earlier start and kept, running
	// this start's programs.
	Reused bool `json:"reused"`
	// StaleCgroups are the ids of other cgroups that still hold socket
	// hooks of ours which this start could not remove (the log says why).
	// Cleanup removes them.
	StaleCgroups []uint64 `json:"stale_cgroup_ids,omitempty"`
	// Destroy is the worker that terminates connected UDP sockets whose
	// backend can no longer serve them.
	Destroy DestroyStatus `json:"destroy"`
}

// LB is the socket load balancing of one dataplane. A nil *LB is off:
// Request and Close do nothing, Status is the zero Status.
type LB struct {
	cfg Config
	dp  Datapath
	log *slog.Logger
	w   *destroyer // nil without Enabled

	mu     sync.Mutex // guards what follows
	path   string
	id     uint64
	hooks  []string
	reused bool
	stale  []uint64
}

// CgroupDir checks the cgroup v2 directory socket load balancing
// attaches to: path, or, when empty, the root of the cgroup v2 hierarchy
// found from the mount table; it returns it cleaned. A host without
// cgroup v2 fails with an error wrapping cgroup2.ErrNoCgroupV2, a path
// that is not a cgroup v2 directory with one wrapping
// cgroup2.ErrNotCgroupV2. It changes nothing.
func CgroupDir(path string) (string, error) {
	if path == "" {
		root, err := cgroup2.Root()
		if err != nil {
			return "", fmt.Errorf("cgroup_connect: socket load balancing needs a cgroup v2 hierarchy: %w", err)
		}
		path = root
	}
	path = filepath.Clean(path)
	if err := cgroup2.Check(path); err != nil {
		return "", fmt.Errorf("cgroup_connect: the socket hooks attach to a cgroup v2 directory: %w", err)
	}
	return path, nil
}

// New checks cfg and deps and returns the LB; it attaches and starts
// nothing.
func New(cfg Config, deps Deps) (*LB, error) {
	switch {
	case deps.Datapath == nil:
		return nil, errors.New("socklb: no datapath")
	case cfg.Enabled && !filepath.IsAbs(cfg.CgroupPath):
		return nil, fmt.Errorf("socklb: cgroup path %q is not absolute", cfg.CgroupPath)
	case !cfg.Enabled && cfg.CgroupPath != "":
		return nil, fmt.Errorf("socklb: cgroup path %q without socket load balancing", cfg.CgroupPath)
	}
	l := &LB{cfg: cfg, dp: deps.Datapath, log: deps.Log}
	if l.log == nil {
		l.log = slog.Default()
	}
	if !cfg.Enabled {
		return l, nil
	}
	run := deps.Destroy
	if run == nil {
		in := deps.InNamespace
		if in == nil {
			in = func(f func() error) error { return f() }
		}
		run = func() (n int, err error) {
			err = in(func() (err error) {
				n, err = l.dp.DestroyStaleUDPSockets()
				return err
			})
			return n, err
		}
	}
	every := cfg.DestroyInterval
	if every == 0 {
		every = DefaultDestroyInterval
	}
	l.w = newDestroyer(run, every, l.log)
	return l, nil
}

// Attach attaches the socket hooks to the configured cgroup (Enabled) and
// removes ours from any other cgroup, or, without Enabled, removes every
// one an earlier start left. It returns the undo of what it attached
// itself (nil when nothing), for a start that fails later.
func (l *LB) Attach() (undo func() error, err error) {
	if !l.cfg.Enabled {
		l.detachOthers(0)
		return nil, nil
	}
	path := l.cfg.CgroupPath
	a, err := l.dp.AttachCgroup(path)
	if err != nil {
		return nil, fmt.Errorf("cgroup_connect: %w", err)
	}
	if len(a.New) > 0 {
		undo = func() error {
			if len(a.New) < len(a.Hooks) {
				// Some were an earlier start's: the cgroup keeps all
				// (bpf detaches a cgroup's hooks together).
				l.log.Warn("fluxvm: open failed: the socket hooks it added beside an earlier start's stay attached", "cgroup", path, "hooks", a.New)
				return nil
			}
			if err := l.dp.DetachCgroupID(a.ID); err != nil {
				return fmt.Errorf("cgroup_connect: %w", err)
			}
			return nil
		}
	}
	hooks := make([]string, 0, len(a.Hooks))
	for _, h := range a.Hooks {
		hooks = append(hooks, string(h))
	}
	l.mu.Lock()
	l.path, l.id, l.reused, l.hooks = path, a.ID, a.Reused, hooks
	l.mu.Unlock()
	l.log.Info("fluxvm: socket load balancing attached", "cgroup", path, "cgroup_id", a.ID,
		"hooks", hooks, "kept_from_earlier_start", a.Reused)
	l.detachOthers(a.ID)
	return undo, nil
}

// detachOthers removes our socket hooks from every cgroup but the one
// with id keep (0: from every cgroup). The ids of those it cannot remove
// (the cgroup is gone, or the detach failed) become the stale ones, with a
// warning.
func (l *LB) detachOthers(keep uint64) {
	var stale []uint64
	defer func() {
		l.mu.Lock()
		l.stale = stale
		l.mu.Unlock()
	}()
	as, err := l.dp.CgroupAttachments()
	if err != nil {
		l.log.Warn("fluxvm: cannot list the socket hooks of an earlier start", "err", err)
		return
	}
	for _, a := range as {
		if a.ID == keep {
			continue
		}
		// By id: also the pins of a cgroup that no longer exists.
		if err := l.dp.DetachCgroupID(a.ID); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
			l.log.Warn("fluxvm: socket hooks of an earlier start left in place; cleanup removes them", "cgroup_id", a.ID, "err", err)
			stale = append(stale, a.ID)
			continue
		}
		l.log.Info("fluxvm: socket hooks of an earlier start removed", "cgroup_id", a.ID)
	}
}

// Removed records that the hooks are gone (the dataplane's Cleanup
// removed them with the pin root): Status reports none from then on.
func (l *LB) Removed() {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.path, l.id, l.hooks, l.reused, l.stale = "", 0, nil, false, nil
}

// Start starts the destroy worker (Enabled): it runs once at once
// (backends may have changed while no process ran it), then on Request
// and on its period.
func (l *LB) Start() {
	if l != nil {
		l.w.start()
	}
}

// Request asks the worker for a run, without waiting: a backend was
// removed or can no longer serve. Requests coalesce; without Enabled, or
// before Start, nothing runs.
func (l *LB) Request() {
	if l != nil {
		l.w.request()
	}
}

// Close stops the worker and waits for a run under way. Call it before
// the datapath is closed. Idempotent; the attached hooks stay (they serve
// while the process is down).
func (l *LB) Close() error {
	if l != nil {
		l.w.close()
	}
	return nil
}

// Status reports the attachment and the worker.
func (l *LB) Status() Status {
	if l == nil {
		return Status{}
	}
	l.mu.Lock()
	st := Status{
		Enabled: l.cfg.Enabled, CgroupPath: l.path, CgroupID: l.id, Hooks: append([]string{}, l.hooks...),
		Reused: l.reused, StaleCgroups: append([]uint64(nil), l.stale...),
	}
	l.mu.Unlock()
	st.Destroy = l.w.status()
	return st
}
