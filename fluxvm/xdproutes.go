package fluxvm

// The XDP next-hop cache (bpf/lib/nh.h) is the control plane's to keep
// true. The XDP program reuses the FIB's answer toward a backend only
// while this process holds a lease on the cache (renewed every second,
// three seconds long: a process that stops, closed or killed, lets the
// cache turn itself off), and only in the generation the answer was
// learned in. The route watch (Linux: xdproutes_linux.go) moves the
// generation on (bpf.Datapath.InvalidateXDPRoutes) as soon as it hears of
// a change of the node's routing over rtnetlink: links, addresses,
// neighbours, routes, rules, nexthops, forwarding settings, or a lost
// notification. So does the GC when it gives a backend id back for reuse.
// An answer also lives a second at most (for what no notification
// announces, such as a path MTU learned from ICMP).
//
// The cache keys a route by backend and ingress interface, which is the
// FIB's whole question only where the answer depends on nothing else:
// the lease is held only while the node has no policy rule or route that
// selects by source or TOS and no multipath route, and the status says
// why it is not.

import (
	"sync"
	"time"
)

// Lease of the XDP route cache, and how often the watch renews it.
const (
	routeCacheLease = 3 * time.Second
	routeCacheRenew = time.Second
)

// XDPRouteCacheStatus is the state of the XDP next-hop cache.
type XDPRouteCacheStatus struct {
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

// routeWatch is what keeps the XDP next-hop cache true.
type routeWatch struct {
	fd   int
	stop chan struct{}
	done chan struct{}

	// compat: the node's net.ipv4.nexthop_compat_mode, as the last read
	// of its routing found it (the loop's goroutine only).
	compat bool

	mu     sync.Mutex
	status XDPRouteCacheStatus
}

// invalidateXDPRoutes empties the XDP route cache when one may be in use.
// d.mu held or not: the watch and the GC call it.
func (d *Dataplane) invalidateXDPRoutes() {
	w := d.routes
	if w == nil || d.xdpMode() == "off" {
		return
	}
	if err := d.dp.InvalidateXDPRoutes(); err != nil {
		d.log.Warn("fluxvm: XDP route cache: invalidate", "err", err)
		return
	}
	w.mu.Lock()
	w.status.Invalidations++
	w.mu.Unlock()
}

// setRouteCache holds the lease (reason empty) or drops it (reason says
// why), which also empties the cache.
func (d *Dataplane) setRouteCache(w *routeWatch, reason string) {
	lease := routeCacheLease
	if reason != "" {
		lease = 0
	}
	err := d.dp.SetXDPRouteCache(lease)
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		d.log.Warn("fluxvm: XDP route cache", "err", err)
		w.status.Enabled, w.status.Reason = false, err.Error()
		return
	}
	w.status.Enabled, w.status.Reason = reason == "", reason
	w.status.Invalidations++
}

// routeCache reports the XDP next-hop cache's state.
func (w *routeWatch) routeCache() XDPRouteCacheStatus {
	if w == nil {
		return XDPRouteCacheStatus{Reason: "xdp_mode is off"}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.status
}
