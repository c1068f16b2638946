package socklb

import (
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
)

// DestroyStatus reports the worker that terminates connected UDP sockets
// of socket load balancing whose backend is removed, Unhealthy or past
// its drain deadline (Datapath.DestroyStaleUDPSockets).
type DestroyStatus struct {
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

// destroyer runs a destroy function in the background: once at start, on
// request (requests while it runs coalesce into one more run), and every
// interval. After the kernel refused (bpf.ErrSockDestroyUnsupported) it
// stops trying. A nil destroyer does nothing.
type destroyer struct {
	run   func() (int, error)
	every time.Duration // <= 0: no timer
	log   *slog.Logger
	kick  chan struct{} // one pending request at most
	stop  chan struct{}
	done  chan struct{}

	mu      sync.Mutex // guards what follows
	started bool
	stopped bool
	st      DestroyStatus
}

func newDestroyer(run func() (int, error), every time.Duration, log *slog.Logger) *destroyer {
	return &destroyer{run: run, every: every, log: log,
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
}

// start starts the loop, once; not after close.
func (s *destroyer) start() {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started || s.stopped {
		return
	}
	s.started = true
	// The run at start covers what was asked before it.
	select {
	case <-s.kick:
	default:
	}
	go s.loop()
}

// request asks for a run without waiting.
func (s *destroyer) request() {
	if s == nil {
		return
	}
	select {
	case s.kick <- struct{}{}:
	default: // a run is pending already: it will see this change too
	}
}

// close stops the loop and waits for it. Idempotent.
func (s *destroyer) close() {
	if s == nil {
		return
	}
	s.mu.Lock()
	started := s.started
	if !s.stopped {
		s.stopped = true
		close(s.stop)
	}
	s.mu.Unlock()
	if started {
		<-s.done
	}
}

func (s *destroyer) status() DestroyStatus {
	if s == nil {
		return DestroyStatus{}
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

func (s *destroyer) loop() {
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
// stopped or the kernel cannot destroy sockets.
func (s *destroyer) runOnce() bool {
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
