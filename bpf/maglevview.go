package bpf

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"

	"github.com/cilium/ebpf"
)

// Frontend names a service frontend as the datapath keys it: its VIP,
// port and IP protocol (fluxvm_svc4/6).
type Frontend struct {
	VIP   netip.Addr
	Port  uint16
	Proto uint8
}

// String is "10.96.0.1:80/tcp" ("[fd00::1]:80/udp", ".../proto-N" for
// another protocol).
func (f Frontend) String() string {
	p := "proto-" + strconv.Itoa(int(f.Proto))
	switch f.Proto {
	case 6:
		p = "tcp"
	case 17:
		p = "udp"
	}
	return netip.AddrPortFrom(f.VIP, f.Port).String() + "/" + p
}

// MaglevBackends reads every frontend's Maglev table as backend
// addresses: for each frontend of fluxvm_svc4/6 (VIP markers left out),
// the backend endpoint each slot of its table names, in slot order. A
// frontend without a table (no eligible backend) maps to an empty slice.
//
// Backend and service ids are node-local: two edges given the same
// catalog in another order number them otherwise, so comparing edges
// means comparing what this returns, not MaglevTable. A slot naming a
// backend id that fluxvm_backends does not hold (or holds unused) fails
// the call: the table and the backends were read while a reprogramming
// changed them, or the maps are inconsistent; read again.
func (v *View) MaglevBackends() (map[Frontend][]netip.AddrPort, error) {
	if v.all == nil {
		return nil, ErrClosed
	}
	fes, err := v.frontends()
	if err != nil {
		return nil, err
	}
	backends := map[uint32]netip.AddrPort{}
	out := make(map[Frontend][]netip.AddrPort, len(fes))
	for fe, sid := range fes {
		ids, err := v.MaglevTable(sid)
		if err != nil {
			return nil, err
		}
		slots := make([]netip.AddrPort, len(ids))
		for i, id := range ids {
			ap, ok := backends[id]
			if !ok {
				if ap, err = v.backend(id); err != nil {
					return nil, fmt.Errorf("bpf: view: %s (service %d) slot %d: %w", fe, sid, i, err)
				}
				backends[id] = ap
			}
			slots[i] = ap
		}
		out[fe] = slots
	}
	return out, nil
}

// frontends lists the frontends of fluxvm_svc4/6 with their datapath
// service ids, VIP markers left out.
func (v *View) frontends() (map[Frontend]uint32, error) {
	out := map[Frontend]uint32{}
	var val SvcValue
	var k4 SvcKey4
	it := v.maps.FluxvmSvc4.Iterate()
	for it.Next(&k4, &val) {
		if val.Flags&SvcFlagVIPMarker == 0 {
			out[Frontend{VIP: Addr([4]uint32{k4.Vip}, FamilyIPv4), Port: Port(k4.Port), Proto: k4.Proto}] = val.ServiceId
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("bpf: view: frontends: %w", err)
	}
	var k6 SvcKey6
	it = v.maps.FluxvmSvc6.Iterate()
	for it.Next(&k6, &val) {
		if val.Flags&SvcFlagVIPMarker == 0 {
			out[Frontend{VIP: Addr(k6.Vip, FamilyIPv6), Port: Port(k6.Port), Proto: k6.Proto}] = val.ServiceId
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("bpf: view: frontends: %w", err)
	}
	return out, nil
}

// backend is the endpoint of backend id.
func (v *View) backend(id uint32) (netip.AddrPort, error) {
	var b Backend
	if err := v.maps.FluxvmBackends.Lookup(id, &b); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			err = fmt.Errorf("backend %d not in the backends map", id)
		}
		return netip.AddrPort{}, err
	}
	if b.State == uint8(BackendUnused) || (b.Family != FamilyIPv4 && b.Family != FamilyIPv6) {
		return netip.AddrPort{}, fmt.Errorf("backend %d unused (state %s, family %d)", id, BackendState(b.State), b.Family)
	}
	return netip.AddrPortFrom(Addr(b.Addr, b.Family), Port(b.Port)), nil
}
