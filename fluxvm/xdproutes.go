package fluxvm

import (
	"fmt"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/xdproutes"
)

// The XDP next-hop cache (bpf/lib/nh.h) is kept true by package
// fluxvm/internal/xdproutes: its route watch holds the lease on the cache
// while the node's routing allows it, and empties the cache on every
// routing change it hears over rtnetlink (Linux). The GC empties it too
// when it gives a backend id back for reuse (invalidateXDPRoutes).

// XDPRouteCacheStatus is the state of the XDP next-hop cache.
type XDPRouteCacheStatus = xdproutes.Status

// initRouteWatch makes the route watch (xdp_mode off: it only records
// why the cache is off); Open starts it (d.routes.Start, which needs no
// d.mu) once nothing can fail. d not yet shared.
func (d *Dataplane) initRouteWatch() error {
	w, err := xdproutes.New(xdproutes.Config{XDPOff: d.xdpMode() == bpf.XDPOff},
		xdproutes.Deps{Datapath: d.dp, InNamespace: d.opts.InNamespace, Log: d.log})
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	d.routes = w
	return nil
}

// invalidateXDPRoutes empties the XDP route cache when one may be in use:
// a backend id was given back for reuse. d.mu held or not (the watch's
// lock comes after it).
func (d *Dataplane) invalidateXDPRoutes() { d.routes.Invalidate() }
