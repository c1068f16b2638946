// Package xdproutes keeps the XDP next-hop cache (bpf/lib/nh.h) true: the
// route watch of a dataplane.
//
// The XDP program reuses the FIB's answer toward a backend only while
// this process holds a lease on the cache (renewed every second, three
// seconds long: a process that stops, closed or killed, lets the cache
// turn itself off), and only in the generation the answer was learned
// in. The watch (Linux: watch_linux.go) moves the generation on
// (Datapath.InvalidateXDPRoutes) as soon as it hears of a change of the
// node's routing over rtnetlink: links, addresses, neighbours, routes,
// rules, nexthops, forwarding settings, or a lost notification. The
// dataplane's GC does too (Invalidate) when it gives a backend id back for
// reuse. An answer also lives a second at most (for what no notification
// announces, such as a path MTU learned from ICMP).
//
// The cache keys a route by backend and ingress interface, which is the
// FIB's whole question only where the answer depends on nothing else:
// the lease is held only while the node has no policy rule or route that
// selects by source or TOS and no multipath route, and Status says why
// it is not. Elsewhere than Linux there is no watch: the cache stays off.
//
// What it needs of the datapath it declares as Datapath (*bpf.Datapath
// implements it); the XDP mode in use is Config.XDPOff.
//
// Locks: a Watch has its own mutex, guarding its status only; it is never
// held while calling the datapath. The dataplane may hold its own lock
// while calling into a Watch (Invalidate from the GC, Status); a Watch
// never calls back into the dataplane. Start and Close need no lock of
// the dataplane's.
package xdproutes

import (
	"errors"
	"log/slog"
	"sync"
	"time"
)

// Lease of the XDP route cache, and how often the watch renews it.
const (
	cacheLease = 3 * time.Second
	cacheRenew = time.Second
)

// Datapath is what the route watch needs of the datapath; *bpf.Datapath
// implements it.
type Datapath interface {
	// SetXDPRouteCache holds the lease on the cache for lease from now
	// (0: drops it, turning the cache off); it empties the cache.
	SetXDPRouteCache(lease time.Duration) error
	// InvalidateXDPRoutes empties the cache.
	InvalidateXDPRoutes() error
}

// Config is what the route watch does.
type Config struct {
	// XDPOff is xdp_mode off (or unset): no XDP program reads the cache,
	// so there is no watch and Invalidate does nothing; Status says so.
	// False: an XDP mode is in use (native, generic or auto).
	XDPOff bool
}

// Deps are what a Watch uses of the rest of the dataplane.
type Deps struct {
	// Datapath is the loaded datapath; required.
	Datapath Datapath
	// InNamespace runs a function in the node's network namespace, whose
	// routing the watch follows; nil: the calling thread's.
	InNamespace func(func() error) error
	// Log receives what the watch does; nil: slog.Default().
	Log *slog.Logger
}

// Status is the state of the XDP next-hop cache.
type Status struct {
	// Enabled: XDP reuses its route lookups toward backends.
	Enabled bool `json:"enabled"`
	// Reason says why the cache is off: xdp_mode off, no watch of the
	// node's routing, or a rule or route that makes the answer depend on
	// more than the backend (policy rules or routes selecting by source
	// or TOS, multipath routes).
	Reason string `json:"reason,omitempty"`
	// Invalidations counts the times the cache was emptied since Open:
	// routing changes heard (one per batch of notifications), turning it
	// on or off, backend ids given back for reuse.
	Invalidations uint64 `json:"invalidations"`
}

// reasonXDPOff is Status.Reason with xdp_mode off.
const reasonXDPOff = "xdp_mode is off"

var errNoDatapath = errors.New("xdproutes: no datapath")

// events is where a watch hears of changes of the node's routing: a
// NETLINK_ROUTE socket (watch_linux.go), or a fake in tests.
type events interface {
	// recv reads one datagram of notifications into buf: with wait, for
	// a short while at most (an error matching EAGAIN when nothing came),
	// so that a stop is heard; without, only what is queued.
	recv(buf []byte, wait bool) (int, error)
	close() error
}

// system is how a watch hears of and reads the node's routing, and its
// pace (hostSystem: this system's; tests replace it before Start).
type system struct {
	// idle is Status.Reason before Start (where there is no watch, for
	// good).
	idle string
	// open subscribes to the notifications (in the node's namespace);
	// scan reads the node's rules and routes and says why the cache must
	// be off, or "", and the node's nexthop_compat_mode.
	open func() (events, error)
	scan func() (reason string, compat bool, err error)
	// rescanEvery bounds how often a full read runs while routing
	// churns; renewEvery is how often the lease is renewed.
	rescanEvery, renewEvery time.Duration
}

// Watch keeps the XDP next-hop cache true. A nil *Watch reports the cache
// off for xdp_mode off, and does nothing.
type Watch struct {
	cfg  Config
	dp   Datapath
	inNS func(func() error) error
	log  *slog.Logger
	sys  system // how it hears and reads the routing (watch_linux.go)

	// compat: the node's net.ipv4.nexthop_compat_mode, as the last read
	// of its routing found it (Start, then the loop's goroutine only).
	compat bool

	mu      sync.Mutex // guards what follows
	started bool
	closed  bool
	// ev, stop and done are set when the loop starts, and not changed
	// after: the loop's notifications, and its stop and end.
	ev         events
	stop, done chan struct{}
	status     Status
}

// New checks deps and returns the watch; it watches nothing before
// Start.
func New(cfg Config, deps Deps) (*Watch, error) {
	if deps.Datapath == nil {
		return nil, errNoDatapath
	}
	w := &Watch{cfg: cfg, dp: deps.Datapath, inNS: deps.InNamespace, log: deps.Log, sys: hostSystem()}
	if w.inNS == nil {
		w.inNS = func(f func() error) error { return f() }
	}
	if w.log == nil {
		w.log = slog.Default()
	}
	if cfg.XDPOff {
		w.status.Reason = reasonXDPOff
	} else {
		w.status.Reason = w.sys.idle
	}
	return w, nil
}

// Invalidate empties the XDP route cache when one may be in use: the
// dataplane's GC gave a backend id back for reuse.
func (w *Watch) Invalidate() {
	if w == nil || w.cfg.XDPOff {
		return
	}
	if err := w.dp.InvalidateXDPRoutes(); err != nil {
		w.log.Warn("fluxvm: XDP route cache: invalidate", "err", err)
		return
	}
	w.mu.Lock()
	w.status.Invalidations++
	w.mu.Unlock()
}

// setCache holds the lease (reason empty) or drops it (reason says why),
// which also empties the cache.
func (w *Watch) setCache(reason string) {
	lease := cacheLease
	if reason != "" {
		lease = 0
	}
	err := w.dp.SetXDPRouteCache(lease)
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		w.log.Warn("fluxvm: XDP route cache", "err", err)
		w.status.Enabled, w.status.Reason = false, err.Error()
		return
	}
	w.status.Enabled, w.status.Reason = reason == "", reason
	w.status.Invalidations++
}

// Status reports the XDP next-hop cache's state.
func (w *Watch) Status() Status {
	if w == nil {
		return Status{Reason: reasonXDPOff}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.status
}

// begin marks the watch started; false when it was already, or closed.
func (w *Watch) begin() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started || w.closed {
		return false
	}
	w.started = true
	return true
}

// Close ends the watch, waits for its goroutine and turns the cache off:
// nothing keeps it true any more. Call it before the datapath is closed.
// Idempotent; after Close, Start does nothing.
func (w *Watch) Close() error {
	if w == nil {
		return nil
	}
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	ev, stop, done := w.ev, w.stop, w.done
	w.mu.Unlock()
	if stop == nil {
		return nil
	}
	close(stop)
	<-done
	err := ev.close()
	w.setCache("the dataplane is closed")
	return err
}
