package bpf

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
)

// NHControl is the layout of fluxvm_nh_ctl's one value (lib/nh.h): the
// XDP next-hop cache's generation and switch.
type NHControl struct {
	Gen     uint32
	Enabled uint32
}

// nhControl is what this process last wrote into fluxvm_nh_ctl.
type nhControl struct {
	mu  sync.Mutex
	val NHControl
}

// XDPRouteCacheStatus is the state of the XDP next-hop cache.
type XDPRouteCacheStatus struct {
	// Enabled: the XDP program may reuse a route it looked up toward a
	// backend (lib/nh.h says when). Off, it asks the FIB for every packet.
	Enabled bool
	// Generation counts the invalidations: every answer learned in an
	// earlier generation is ignored.
	Generation uint32
}

// SetXDPRouteCache turns the north-south XDP program's next-hop cache on
// or off, and invalidates what it holds either way. A new program starts
// with it off: turn it on only while something calls InvalidateXDPRoutes
// on every change of the node's routes, rules, neighbours, links and
// nexthops (fluxvm.Dataplane does, with netlink), and only where a route
// to a backend does not depend on the packet's source (no policy routing
// rules, no multipath routes): the cache keys the route by backend and
// ingress interface. Cached answers also expire after about a second.
func (d *Datapath) SetXDPRouteCache(on bool) error {
	return d.writeNH(func(v *NHControl) {
		v.Enabled = 0
		if on {
			v.Enabled = 1
		}
	})
}

// InvalidateXDPRoutes makes the XDP program forget every route it cached:
// the next packet toward each backend asks the FIB again. Call it after
// every change of the node's routing (see SetXDPRouteCache); the loader
// calls it when it removes an interface XDP may send on.
func (d *Datapath) InvalidateXDPRoutes() error {
	return d.writeNH(func(*NHControl) {})
}

// XDPRouteCache reports the cache's state as this process last set it.
func (d *Datapath) XDPRouteCache() XDPRouteCacheStatus {
	d.nh.mu.Lock()
	defer d.nh.mu.Unlock()
	return XDPRouteCacheStatus{Enabled: d.nh.val.Enabled != 0, Generation: d.nh.val.Gen}
}

// writeNH applies change to the control word, moves the generation on and
// writes it.
func (d *Datapath) writeNH(change func(*NHControl)) error {
	if d.xcoll == nil {
		return ErrClosed
	}
	m := d.xcoll.Maps["fluxvm_nh_ctl"]
	if m == nil {
		return errors.New("bpf: xdp route cache: the XDP object has no fluxvm_nh_ctl")
	}
	d.nh.mu.Lock()
	defer d.nh.mu.Unlock()
	v := d.nh.val
	change(&v)
	v.Gen++
	if err := m.Update(uint32(0), v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("bpf: xdp route cache: %w", err)
	}
	d.nh.val = v
	return nil
}
