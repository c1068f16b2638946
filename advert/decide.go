package advert

import (
	"net/netip"
	"slices"
)

// Reason says why an entry is withdrawn. The values below are the ones
// [Decide] produces; adapters should treat any non-empty reason as
// "withdrawn" and show it, not branch on it.
type Reason string

// Withdrawal reasons, in the order Decide checks them.
const (
	// ReasonAdvertiseFalse: the service's node intent has advertise=false.
	ReasonAdvertiseFalse Reason = "advertise=false"
	// ReasonServiceDisabled: the service is in the catalog but disabled
	// (its frontends are closed).
	ReasonServiceDisabled Reason = "service disabled"
	// ReasonNotNorthSouth: the service is exposed east-west only, so the
	// north-south interfaces do not serve the VIP. Validation of intent
	// normally prevents advertise=true here; Decide checks it anyway
	// rather than attract traffic it would drop.
	ReasonNotNorthSouth Reason = "not exposed north-south"
	// ReasonNoReadyBackend: no backend for this VIP is Ready after health
	// checks.
	ReasonNoReadyBackend Reason = "no ready backend"
	// ReasonSNATNotAdvertised: an SNAT address the node holds, while the
	// node leaves its routing to others (advertise_snat=false).
	ReasonSNATNotAdvertised Reason = "advertise_snat=false"
	// ReasonGroupJoining: the node is an edge of a group that has not
	// loaded the other edges' flows since it started; it attracts no
	// traffic until it has (the entries are otherwise advertised).
	ReasonGroupJoining Reason = "joining the group"
)

// Exposure values, as in the service intent. An empty exposure means the
// intent's default, east-west.
const (
	ExposureEastWest   = "east-west"
	ExposureNorthSouth = "north-south"
	ExposureBoth       = "both"
)

// Input is what [Decide] needs to know about one VIP of one service.
// The zero value of every field is the safe one: it withdraws.
type Input struct {
	VIP     netip.Addr
	Service string
	// Exposure is the service's exposure; empty means east-west.
	Exposure string
	// Ports are copied into the entry for information.
	Ports []Port
	// Enabled is the service's enabled flag with its default applied.
	Enabled bool
	// Advertise is the advertise flag of the service's node intent.
	Advertise bool
	// ReadyBackends counts the backends that can take new flows for this
	// VIP: of its address family, Ready in intent (not draining, not
	// disabled) and not marked unhealthy by health checks.
	ReadyBackends int
}

// Decide returns the advertisement entry for one VIP of one service. The
// rules, checked in this order, with the first that applies giving the
// reason:
//
//  1. Advertise is false → withdrawn, [ReasonAdvertiseFalse].
//  2. Enabled is false → withdrawn, [ReasonServiceDisabled].
//  3. Exposure is neither north-south nor both → withdrawn,
//     [ReasonNotNorthSouth].
//  4. ReadyBackends < 1 → withdrawn, [ReasonNoReadyBackend].
//  5. Otherwise advertised, with no reason.
//
// Decide does not validate the VIP or the service name; Publish does.
func Decide(in Input) Entry {
	e := Entry{
		VIP:      in.VIP,
		Service:  in.Service,
		Exposure: in.Exposure,
		Ports:    slices.Clone(in.Ports),
	}
	switch {
	case !in.Advertise:
		e.Reason = ReasonAdvertiseFalse
	case !in.Enabled:
		e.Reason = ReasonServiceDisabled
	case in.Exposure != ExposureNorthSouth && in.Exposure != ExposureBoth:
		e.Reason = ReasonNotNorthSouth
	case in.ReadyBackends < 1:
		e.Reason = ReasonNoReadyBackend
	default:
		e.Advertised = true
	}
	return e
}

// DecideSNAT returns the entry of an SNAT address the node wants routed
// to it: its own (KindSNAT) or a gone peer's it took over (KindSNATPeer).
// It is advertised when advertise is true (advertise_snat), else
// withdrawn with ReasonSNATNotAdvertised.
func DecideSNAT(addr netip.Addr, kind Kind, advertise bool) Entry {
	e := Entry{VIP: addr, Service: SNATService, Kind: kind, Advertised: advertise}
	if !advertise {
		e.Reason = ReasonSNATNotAdvertised
	}
	return e
}
