//go:build !linux

package fluxvm

// startRouteWatch: without rtnetlink the cache stays off. d.mu held.
func (d *Dataplane) startRouteWatch() {
	d.routes = &routeWatch{fd: -1, status: XDPRouteCacheStatus{Reason: "no route watch on this system"}}
}

func (d *Dataplane) stopRouteWatch() {}
