package services

import (
	"iter"
	"maps"
	"net/netip"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
	"github.com/fluxvm/servicefabric/fluxvm/internal/revindex"
	"github.com/fluxvm/servicefabric/intent"
)

// Service is a service as the dataplane programmed it: its intent, the
// revision its frontend entries and guards carry, and its frontends. The
// facade keeps one per service name; Program writes Frontends and reads
// Revision.
type Service struct {
	Intent    intent.Service
	Revision  uint64
	Applied   time.Time
	Frontends []*Frontend
	// Footprint is what it counts in the facade's catalog index.
	Footprint intent.Footprint
	// Seq is the catalog journal record of this intent; 0 when it came
	// from the snapshot at Open, or without a catalog.
	Seq uint64
}

// ServiceIDs are the datapath ids of s's frontends.
func (s *Service) ServiceIDs() []uint32 {
	out := make([]uint32, 0, len(s.Frontends))
	for _, fe := range s.Frontends {
		out = append(out, fe.sid)
	}
	return out
}

// Frontend is one (VIP, port, protocol) of a service as the datapath
// holds it: its service id, the ids of its backends, and what its
// entries say now. The Programmer changes it (with the facade's lock
// held); everyone else reads it through its methods, under that lock.
type Frontend struct {
	key      Key
	sid      uint32
	service  string
	backends map[netip.AddrPort]uint32
	eligible int
	size     uint32 // slots of its Maglev table in place; 0: none
	guard    bool
	flags    uint32 // SvcValue flags (svcFlags, revStoredOf)
	// live: its frontend entry is written, with flags and revision rev;
	// false until its first commit and once removeFrontend deleted it.
	live bool
	rev  uint32
	// repair: a change failed and could not put back what was there, so
	// its guard is closed until the service is programmed again
	// (FailClosed).
	repair bool
	// edt is its fluxvm_edt entry as written (the departure clock aside).
	edt edt.Entry
}

// Key names the frontend.
func (fe *Frontend) Key() Key { return fe.key }

// ID is its datapath service id.
func (fe *Frontend) ID() uint32 { return fe.sid }

// Service is the name of its service.
func (fe *Frontend) Service() string { return fe.service }

// BackendID is the id of backend endpoint ep in fe; 0 when fe does not
// list it.
func (fe *Frontend) BackendID(ep netip.AddrPort) uint32 { return fe.backends[ep] }

// Backends yields its backend endpoints with their ids.
func (fe *Frontend) Backends() iter.Seq2[netip.AddrPort, uint32] { return maps.All(fe.backends) }

// BackendCount is how many backends it lists (Ready or not).
func (fe *Frontend) BackendCount() int { return len(fe.backends) }

// Eligible is how many of its backends hold slots of its table.
func (fe *Frontend) Eligible() int { return fe.eligible }

// TableSize is the slots of its Maglev table in place; 0: none.
func (fe *Frontend) TableSize() uint32 { return fe.size }

// GuardOpen reports whether its guard lets new flows in.
func (fe *Frontend) GuardOpen() bool { return fe.guard }

// Live reports whether its frontend entry is written.
func (fe *Frontend) Live() bool { return fe.live }

// Flags are the SvcValue flags of its entry as written.
func (fe *Frontend) Flags() uint32 { return fe.flags }

// Revision is the revision its entry carries.
func (fe *Frontend) Revision() uint32 { return fe.rev }

// RepairPending reports that a failed change closed it (FailClosed).
func (fe *Frontend) RepairPending() bool { return fe.repair }

// Key names a frontend: its VIP, port and IP protocol.
type Key = revindex.Key

// markerKey names the (VIP, 0, proto) entry that recognises the
// fragments of a VIP's frontends.
type markerKey struct {
	vip   netip.Addr
	proto uint8
}

// Want is one frontend a service wants, with the backends of its family.
type Want struct {
	Key      Key
	Backends []intent.Backend
}

// Wanted lists the frontends of svc with the enabled backends of each
// one's family.
func Wanted(svc *intent.Service) []Want {
	var out []Want
	for _, vip := range svc.VIPs {
		vip = vip.Unmap()
		var bs []intent.Backend
		for _, b := range svc.Backends {
			if b.IsEnabled() && b.Address.Unmap().Is4() == vip.Is4() {
				bs = append(bs, b)
			}
		}
		for _, p := range svc.Ports {
			out = append(out, Want{Key{VIP: vip, Port: p.Port, Proto: p.Protocol.Number()}, bs})
		}
	}
	return out
}

// Flags are the SvcValue flags of every frontend of svc: where it is
// served and how it forwards. A frontend adds SvcFlagRevStored where the
// reverse translation index says so (revStoredOf), and its identity
// policy's flags.
func Flags(svc *intent.Service) uint32 {
	var f uint32
	switch svc.Exposure {
	case intent.ExposureNorthSouth:
		f |= bpf.SvcFlagNorthSouth | bpf.SvcFlagNoEastWest
	case intent.ExposureBoth:
		f |= bpf.SvcFlagNorthSouth
	}
	if svc.Mode == intent.ModeDSR {
		f |= bpf.SvcFlagDSR
	}
	if svc.HostRouting {
		f |= bpf.SvcFlagHostRouting
	}
	if svc.MaxEgressMbps != 0 {
		f |= bpf.SvcFlagPaced
	}
	return f
}

// markerFlags are the flags of the (VIP, 0, proto) entry shared by the
// frontends fes: the datapath reads only where it is served (for
// fragments), so it is north-south if any of them is, and off the VM
// edges only if all of them are.
func markerFlags(fes []*Frontend) uint32 {
	f := uint32(bpf.SvcFlagVIPMarker)
	noEW := len(fes) > 0
	for _, fe := range fes {
		f |= fe.flags & bpf.SvcFlagNorthSouth
		if fe.flags&bpf.SvcFlagNoEastWest == 0 {
			noEW = false
		}
	}
	if noEW {
		f |= bpf.SvcFlagNoEastWest
	}
	return f
}
