package fluxvm

// The XDP next-hop cache (bpf/lib/nh.h) is the control plane's to keep
// true: the XDP program reuses the FIB's answer toward a backend only in
// the generation it was learned in, and the route watch (Linux:
// xdproutes_linux.go) moves the generation on
// (bpf.Datapath.InvalidateXDPRoutes) after every change of the node's
// routing it hears of over rtnetlink: links, addresses, neighbours,
// routes, rules, nexthops and forwarding settings. A lost notification
// (the socket's buffer overran) invalidates as well, and an answer lives
// a second at most.
//
// The cache keys a route by backend and ingress interface, which is the
// FIB's whole question only where the answer does not depend on the
// packet's source: the cache stays off while the node has policy routing
// rules beyond the kernel's defaults or multipath routes (ECMP, nexthop
// objects), and the status says why.

import "sync"

// XDPRouteCacheStatus is the state of the XDP next-hop cache.
type XDPRouteCacheStatus struct {
	// Enabled: XDP reuses its route lookups toward backends.
	Enabled bool `json:"enabled"`
	// Reason says why the cache is off: xdp_mode off, policy routing
	// rules, multipath routes, or no watch of the node's routes.
	Reason string `json:"reason,omitempty"`
	// Invalidations counts the cache's generations since Open: every
	// change of the node's routing heard moves it on.
	Invalidations uint64 `json:"invalidations"`
}

// routeWatch is what keeps the XDP next-hop cache true.
type routeWatch struct {
	fd   int
	stop chan struct{}
	done chan struct{}

	mu sync.Mutex
	// off, when set, keeps the cache off and says why (no XDP, no watch).
	off string
	// rules: rules beyond the kernel's defaults exist; multipath holds
	// the multipath routes by family, table, destination, TOS and
	// priority.
	rules     bool
	multipath map[string]bool
	status    XDPRouteCacheStatus
}

// applyRouteCache writes the cache's switch as the watch finds it and
// moves its generation on. d.mu held.
func (d *Dataplane) applyRouteCache(w *routeWatch) {
	w.mu.Lock()
	defer w.mu.Unlock()
	reason := w.off
	switch {
	case reason != "":
	case w.rules:
		reason = "policy routing rules beyond the kernel's defaults: a route may depend on the source"
	case len(w.multipath) > 0:
		reason = "multipath routes: a flow's path depends on its addresses"
	}
	if err := d.dp.SetXDPRouteCache(reason == ""); err != nil {
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
