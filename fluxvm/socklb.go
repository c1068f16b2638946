package fluxvm

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

// Socket load balancing (cgroup_connect).
//
// With Options.SocketLB.CgroupConnect, Open attaches the socket hooks of the
// datapath (bpf.CgroupHooks: connect4/6, sendmsg4/6, recvmsg4/6,
// getpeername4/6) to one cgroup v2 directory, with links pinned under the
// pin root: they keep serving while the process is down, and the next
// Open finds them and keeps them (a program reload updates them in place,
// with no gap). A process in that cgroup, or below it, that connects or
// sends to a VIP gets its socket addressed to a backend picked by the
// same rules as TC; every failure of the hooks leaves the address as it
// was, and TC serves the packets as it serves any client (fail-open).
// Without CgroupConnect, Open removes our hooks where an earlier start
// left them; Cleanup removes them too.
//
// A connected UDP socket's sends carry no address, so no hook can move it
// off a backend that went away. A background worker runs the datapath's
// socket iterator (bpf.Datapath.DestroyStaleUDPSockets, Linux 6.5+) in the
// node's network namespace: after changes that can leave a backend unable
// to serve (removed, programmed Unhealthy, or Draining with its deadline
// passed) and every DefaultSocketDestroyInterval, for drain deadlines that
// pass with no change. Requests while it runs coalesce into one more run;
// it never holds the dataplane's lock, so applies never wait for it.

// DefaultSocketDestroyInterval is how often, besides after backend
// changes, the socket LB worker terminates connected UDP sockets whose
// backend can no longer serve them: a drain deadline passes with no change
// of the catalog.
const DefaultSocketDestroyInterval = 5 * time.Second

// SocketLBStatus is the state of socket load balancing (cgroup_connect).
type SocketLBStatus struct {
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
	Destroy SocketDestroyStatus `json:"destroy"`
}

// SocketDestroyStatus reports the worker that terminates connected UDP
// sockets of socket load balancing whose backend is removed, Unhealthy or
// past its drain deadline (bpf.Datapath.DestroyStaleUDPSockets).
type SocketDestroyStatus struct {
	// Supported is false once the kernel refused (bpf_sock_destroy needs
	// Linux 6.5): the worker then stops, and such sockets keep their
	// backend until their application connects again. Absent before the
	// first run, and without cgroup_connect.
	Supported *bool `json:"supported,omitempty"`
	// Runs counts the runs since Open; LastRun is the last one's time.
	Runs    uint64    `json:"runs"`
	LastRun time.Time `json:"last_run,omitzero"`
	// LastDestroyed is the sockets the last run terminated; Destroyed
	// sums them since Open.
	LastDestroyed int    `json:"last_destroyed"`
	Destroyed     uint64 `json:"destroyed_total"`
	// LastError is why the last run failed; absent once one succeeds.
	LastError string `json:"last_error,omitempty"`
}

// socketLB is the socket load balancing state of a Dataplane; its fields
// other than destroyer are guarded by Dataplane.mu.
type socketLB struct {
	enabled   bool
	path      string
	id        uint64
	hooks     []string
	reused    bool
	stale     []uint64
	destroyer *sockDestroyer
}

func (s *socketLB) status() SocketLBStatus {
	st := SocketLBStatus{
		Enabled: s.enabled, CgroupPath: s.path, CgroupID: s.id, Hooks: append([]string{}, s.hooks...),
		Reused: s.reused, StaleCgroups: append([]uint64(nil), s.stale...),
	}
	st.Destroy = s.destroyer.status()
	return st
}

// removed records that Cleanup removed the hooks.
func (s *socketLB) removed() {
	s.path, s.id, s.hooks, s.reused, s.stale = "", 0, nil, false, nil
}

// SocketLBCgroup returns the cgroup v2 directory socket load balancing
// attaches to on this host, as Open resolves it: cgroup_path, or the root
// of the cgroup v2 hierarchy found from the mount table; "" when
// cgroup_connect is false. Like Open, it fails with an error wrapping
// cgroup2.ErrNoCgroupV2 on a host without cgroup v2, and one wrapping
// cgroup2.ErrNotCgroupV2 (bpf.ErrNotCgroupV2) when the directory is not a
// cgroup v2 one. It changes nothing (fluxvmd check-config uses it).
func (c *Config) SocketLBCgroup() (string, error) {
	path, err := Options{SocketLB: SocketLBOptions{CgroupConnect: c.CgroupConnect, CgroupPath: c.CgroupPath}}.socketLBCgroup()
	if err != nil {
		return "", fmt.Errorf("fluxvm: config: %w", err)
	}
	return path, nil
}

// socketLBCgroup, for options that passed Validate, returns with
// CgroupConnect the cgroup v2 directory to attach to: CgroupPath,
// or the root of the hierarchy. A host without cgroup v2 fails with an
// error wrapping cgroup2.ErrNoCgroupV2, a path that is not a cgroup v2
// directory with one wrapping cgroup2.ErrNotCgroupV2.
func (o Options) socketLBCgroup() (string, error) {
	if !o.SocketLB.CgroupConnect {
		return "", nil
	}
	path := o.SocketLB.CgroupPath
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

// initSocketLB attaches the socket hooks to path (CgroupConnect) and
// removes ours from any other cgroup, or, without CgroupConnect, removes
// every one an earlier start left. Hooks on other cgroups that cannot be
// removed are logged and reported (SocketLBStatus.StaleCgroups), not an
// error: they must not stop the node from starting, nor a cleanup. The
// hooks it attached itself go on undo, for a failed Open.
func (d *Dataplane) initSocketLB(path string, undo *undoStack) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sock.enabled = d.opts.SocketLB.CgroupConnect
	if !d.opts.SocketLB.CgroupConnect {
		d.detachOtherCgroups(0)
		return nil
	}
	a, err := d.dp.AttachCgroup(path)
	if err != nil {
		return fmt.Errorf("fluxvm: open: cgroup_connect: %w", err)
	}
	if len(a.New) > 0 {
		undo.push(func() error {
			if len(a.New) < len(a.Hooks) {
				// Some were an earlier start's: the cgroup keeps all
				// (bpf detaches a cgroup's hooks together).
				d.log.Warn("fluxvm: open failed: the socket hooks it added beside an earlier start's stay attached", "cgroup", path, "hooks", a.New)
				return nil
			}
			if err := d.dp.DetachCgroupID(a.ID); err != nil {
				return fmt.Errorf("cgroup_connect: %w", err)
			}
			return nil
		})
	}
	d.sock.path, d.sock.id, d.sock.reused = path, a.ID, a.Reused
	d.sock.hooks = d.sock.hooks[:0]
	for _, h := range a.Hooks {
		d.sock.hooks = append(d.sock.hooks, string(h))
	}
	d.log.Info("fluxvm: socket load balancing attached", "cgroup", path, "cgroup_id", a.ID,
		"hooks", d.sock.hooks, "kept_from_earlier_start", a.Reused)
	d.detachOtherCgroups(a.ID)
	return nil
}

// detachOtherCgroups removes our socket hooks from every cgroup but the one
// with id keep (0: from every cgroup). The ids of those it cannot remove
// (the cgroup is gone, or the detach failed) go to sock.stale, with a
// warning. d.mu held.
func (d *Dataplane) detachOtherCgroups(keep uint64) {
	d.sock.stale = nil
	as, err := d.dp.CgroupAttachments()
	if err != nil {
		d.log.Warn("fluxvm: cannot list the socket hooks of an earlier start", "err", err)
		return
	}
	for _, a := range as {
		if a.ID == keep {
			continue
		}
		// By id: also the pins of a cgroup that no longer exists.
		if err := d.dp.DetachCgroupID(a.ID); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
			d.log.Warn("fluxvm: socket hooks of an earlier start left in place; cleanup removes them", "cgroup_id", a.ID, "err", err)
			d.sock.stale = append(d.sock.stale, a.ID)
			continue
		}
		d.log.Info("fluxvm: socket hooks of an earlier start removed", "cgroup_id", a.ID)
	}
}

// startSocketDestroy starts the destroy worker when socket LB is on.
func (d *Dataplane) startSocketDestroy() {
	if !d.opts.SocketLB.CgroupConnect {
		return
	}
	run := d.opts.sockDestroy
	if run == nil {
		run = func() (n int, err error) {
			err = d.opts.InNamespace(func() (err error) {
				n, err = d.dp.DestroyStaleUDPSockets()
				return err
			})
			return n, err
		}
	}
	every := d.opts.sockDestroyEvery
	if every == 0 {
		every = DefaultSocketDestroyInterval
	}
	s := newSockDestroyer(run, every, d.log)
	d.mu.Lock()
	d.sock.destroyer = s
	d.mu.Unlock()
	s.start()
}

// stopSocketDestroy stops the destroy worker and waits for a run under
// way. Call it without d.mu, before the datapath is closed.
func (d *Dataplane) stopSocketDestroy() {
	d.mu.Lock()
	s := d.sock.destroyer
	d.mu.Unlock()
	s.close()
}

// staleSockets asks the destroy worker for a run, without waiting: a
// backend was removed or can no longer serve. d.mu held.
func (d *Dataplane) staleSockets() { d.sock.destroyer.request() }

// sockDestroyer runs a destroy function in the background: once at start
// (backends may have changed while no process ran it), on request
// (requests while it runs coalesce into one more run), and every
// interval. After the kernel refused (bpf.ErrSockDestroyUnsupported) it
// stops trying.
type sockDestroyer struct {
	run   func() (int, error)
	every time.Duration
	log   *slog.Logger
	kick  chan struct{} // one pending request at most
	stop  chan struct{}
	done  chan struct{}
	once  sync.Once

	mu sync.Mutex
	st SocketDestroyStatus
}

func newSockDestroyer(run func() (int, error), every time.Duration, log *slog.Logger) *sockDestroyer {
	return &sockDestroyer{run: run, every: every, log: log,
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
}

func (s *sockDestroyer) start() { go s.loop() }

// request asks for a run without waiting. A nil worker ignores it.
func (s *sockDestroyer) request() {
	if s == nil {
		return
	}
	select {
	case s.kick <- struct{}{}:
	default: // a run is pending already: it will see this change too
	}
}

// close stops the worker and waits for it. Idempotent; nil-safe.
func (s *sockDestroyer) close() {
	if s == nil {
		return
	}
	s.once.Do(func() { close(s.stop) })
	<-s.done
}

func (s *sockDestroyer) status() SocketDestroyStatus {
	if s == nil {
		return SocketDestroyStatus{}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.st
	if st.Supported != nil {
		v := *st.Supported
		st.Supported = &v
	}
	return st
}

func (s *sockDestroyer) loop() {
	defer close(s.done)
	var tick <-chan time.Time
	if s.every > 0 {
		t := time.NewTicker(s.every)
		defer t.Stop()
		tick = t.C
	}
	for ok := s.runOnce(); ok; ok = s.runOnce() {
		select {
		case <-s.stop:
			return
		case <-s.kick:
		case <-tick:
		}
	}
	<-s.stop // unsupported: nothing more to do
}

// runOnce runs the destroy function and records the outcome; false when
// the kernel cannot destroy sockets.
func (s *sockDestroyer) runOnce() bool {
	select {
	case <-s.stop:
		return false
	default:
	}
	n, err := s.run()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.st.Runs++
	s.st.LastRun = time.Now().UTC()
	s.st.LastDestroyed = n
	s.st.Destroyed += uint64(max(n, 0))
	yes, no := true, false
	switch {
	case errors.Is(err, bpf.ErrSockDestroyUnsupported):
		s.st.Supported, s.st.LastError = &no, err.Error()
		s.log.Warn("fluxvm: this kernel cannot terminate sockets from BPF (Linux 6.5+): connected UDP sockets of socket load balancing keep a backend that was removed or turned Unhealthy until their application connects again",
			"err", err)
		return false
	case err != nil:
		if s.st.LastError != err.Error() {
			s.log.Warn("fluxvm: terminating connected UDP sockets of gone backends failed; retrying at the next change or tick", "err", err)
		}
		s.st.LastError = err.Error()
	default:
		s.st.Supported, s.st.LastError = &yes, ""
	}
	if n > 0 {
		s.log.Info("fluxvm: terminated connected UDP sockets whose backend can no longer serve them", "sockets", n)
	}
	return true
}
