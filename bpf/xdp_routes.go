package bpf

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cilium/ebpf"
)

// NHControl is the layout of fluxvm_nh_ctl's one value (lib/nh.h): the
// XDP next-hop cache's generation and lease (the datapath clock >> 20,
// about milliseconds, until which the cache may be used; 0: off).
type NHControl struct {
	Gen   uint32
	Until uint32
}

// nhControl is what this process last wrote into fluxvm_nh_ctl.
type nhControl struct {
	mu  sync.Mutex
	val NHControl
}

// XDPRouteCacheStatus is the state of the XDP next-hop cache.
type XDPRouteCacheStatus struct {
	// Enabled: the XDP program may reuse a route it looked up toward a
	// backend (lib/nh.h says when) until the lease ends. Off, it asks the
	// FIB for every packet.
	Enabled bool
	// Generation counts the invalidations: every answer learned in an
	// earlier generation is ignored.
	Generation uint32
}

// SetXDPRouteCache lets the north-south XDP program reuse its route
// lookups toward backends for lease from now, or turns the cache off
// (lease 0). Turning it on or off forgets what the cache holds; renewing
// a lease that has not ended does not. A new program starts with it off. Hold a lease only while
// something calls InvalidateXDPRoutes on every change of the node's
// routes, rules, neighbours, links, addresses and nexthops
// (fluxvm.Dataplane does, with rtnetlink), and only where a route to a
// backend depends on its address and the ingress interface alone: no
// policy rules or routes that select by source or TOS, no multipath
// routes. A holder that stops (closed, killed) stops renewing, and the
// cache turns itself off when the lease ends. Cached answers also expire
// after about a second.
func (d *Datapath) SetXDPRouteCache(lease time.Duration) error {
	if lease < 0 {
		return fmt.Errorf("bpf: xdp route cache: lease %v", lease)
	}
	ns, err := monotonicCoarse()
	if err != nil {
		return fmt.Errorf("bpf: xdp route cache: %w", err)
	}
	now := uint32(ns >> 20) // the program's unit: about a millisecond
	var until uint32
	if lease > 0 {
		if until = uint32((ns + uint64(lease)) >> 20); until == 0 {
			until = 1
		}
	}
	return d.writeNH(func(v *NHControl) bool {
		renew := until != 0 && v.Until != 0 && int32(v.Until-now) > 0
		v.Until = until
		return !renew
	})
}

// InvalidateXDPRoutes makes the XDP program forget every route it cached:
// the next packet toward each backend asks the FIB again. Call it after
// every change of the node's routing (see SetXDPRouteCache); the loader
// calls it when it removes an interface from those XDP may send on.
func (d *Datapath) InvalidateXDPRoutes() error {
	return d.writeNH(func(*NHControl) bool { return true })
}

// XDPRouteCache reports the cache's state as this process last set it.
func (d *Datapath) XDPRouteCache() XDPRouteCacheStatus {
	d.nh.mu.Lock()
	defer d.nh.mu.Unlock()
	on := false
	if d.nh.val.Until != 0 {
		if now, err := monotonicCoarse(); err == nil {
			on = int32(d.nh.val.Until-uint32(now>>20)) > 0
		}
	}
	return XDPRouteCacheStatus{Enabled: on, Generation: d.nh.val.Gen}
}

// writeNH applies change to the control word, moves the generation on
// when change says so, and writes the word (one 64-bit value: the program
// reads it in one load).
func (d *Datapath) writeNH(change func(*NHControl) (bump bool)) error {
	d.live.RLock()
	defer d.live.RUnlock()
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
	if change(&v) {
		v.Gen++
	}
	if err := m.Update(uint32(0), v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("bpf: xdp route cache: %w", err)
	}
	d.nh.val = v
	return nil
}
