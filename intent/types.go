package intent

import (
	"fmt"
	"net/netip"
	"slices"
	"time"
)

// Service is Fabric's intent for one load-balanced service on this node:
// its VIPs and ports (the frontends) and the backends behind them. JSON
// field names are those of the product description.
//
// One Service becomes one datapath service per (address family, port,
// protocol): an IPv4 VIP is served by the IPv4 backends, an IPv6 VIP by the
// IPv6 backends, each with its own Maglev table.
type Service struct {
	// Name identifies the service in the API and the catalog.
	Name string `json:"name"`
	// Enabled set to false keeps the service in the catalog with its
	// frontends closed (packets to them are dropped, guard closed).
	// Default true.
	Enabled *bool `json:"enabled,omitempty"`
	// Exposure says where clients are: "east-west" (VMs on this node,
	// served on VM edges; the default), "north-south" (outside the node,
	// served on north-south interfaces only) or "both".
	Exposure Exposure `json:"exposure,omitempty"`
	// Mode is "nat" (the default: DNAT, plus SNAT on north-south
	// interfaces) or "dsr" (routed DSR: the packet keeps the VIP and its
	// port, so backend ports must equal the frontend ports).
	Mode Mode `json:"mode,omitempty"`
	// VIPs are the virtual addresses, at most one per address family.
	VIPs []netip.Addr `json:"vips"`
	// Ports are the frontend ports; each is served on every VIP.
	Ports []ServicePort `json:"ports"`
	// Backends receive the traffic; each has its own port.
	Backends []Backend `json:"backends"`
	// HealthCheck asks the node to probe backends (TCP connect).
	HealthCheck *HealthCheck `json:"health_check,omitempty"`
	// MaxEgressMbps paces the service's egress toward its clients (EDT),
	// in megabits per second: 0 leaves it unpaced, otherwise
	// MinEgressMbps..MaxEgressMbpsLimit. Needs edt_enabled. The cap holds
	// per service (its frontends, every VIP, port and protocol, share one
	// departure clock) and per node: each node paces on its own clock.
	MaxEgressMbps uint32 `json:"max_egress_mbps,omitempty"`
	// HostRouting enables the FIB fast path after NAT (a FIB miss falls
	// back to the host stack); needs mode nat.
	HostRouting bool `json:"host_routing,omitempty"`
	// Advertise publishes the VIP for BGP adapters; needs north-south
	// exposure.
	Advertise bool `json:"advertise,omitempty"`
}

// IsEnabled reports Enabled with its default.
func (s *Service) IsEnabled() bool { return s.Enabled == nil || *s.Enabled }

// IsNorthSouth reports whether the service has clients outside the node:
// exposure north-south or both.
func (s *Service) IsNorthSouth() bool {
	return s.Exposure == ExposureNorthSouth || s.Exposure == ExposureBoth
}

// Clone returns a deep copy of s: it shares no slice or pointer with s.
func (s Service) Clone() Service {
	c := s
	c.Enabled = clonePtr(s.Enabled)
	c.VIPs = slices.Clone(s.VIPs)
	c.Ports = slices.Clone(s.Ports)
	if s.Backends != nil {
		c.Backends = make([]Backend, len(s.Backends))
		for i, b := range s.Backends {
			b.Weight = clonePtr(b.Weight)
			b.Enabled = clonePtr(b.Enabled)
			c.Backends[i] = b
		}
	}
	c.HealthCheck = clonePtr(s.HealthCheck)
	return c
}

func clonePtr[T any](p *T) *T {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}

// Exposure is where a service's clients are.
type Exposure string

// Exposures.
const (
	ExposureEastWest   Exposure = "east-west"
	ExposureNorthSouth Exposure = "north-south"
	ExposureBoth       Exposure = "both"
)

// Mode is how packets reach a backend.
type Mode string

// Modes.
const (
	ModeNAT Mode = "nat"
	ModeDSR Mode = "dsr"
)

// Protocol is a transport protocol of a frontend.
type Protocol string

// Protocols.
const (
	TCP Protocol = "tcp"
	UDP Protocol = "udp"
)

// Number returns the IP protocol number (6 or 17), or 0.
func (p Protocol) Number() uint8 {
	switch p {
	case TCP:
		return 6
	case UDP:
		return 17
	}
	return 0
}

// ServicePort is one frontend port.
type ServicePort struct {
	Port     uint16   `json:"port"`
	Protocol Protocol `json:"protocol"`
}

func (p ServicePort) String() string { return fmt.Sprintf("%d/%s", p.Port, p.Protocol) }

// Backend is one endpoint of a service.
type Backend struct {
	Address netip.Addr `json:"address"`
	Port    uint16     `json:"port"`
	// Weight is the backend's share of new flows relative to the others.
	// 0 takes no new flows. Default 1.
	Weight *uint32 `json:"weight,omitempty"`
	// Enabled set to false removes the backend from the service as if it
	// were not listed. Default true.
	Enabled *bool `json:"enabled,omitempty"`
	// State is Fabric's intent: "ready" (the default), "draining" or
	// "unhealthy".
	State BackendState `json:"state,omitempty"`
	// DrainUntilUnixMs ends the draining of a Draining backend: its
	// established flows stay until then (wall clock, ms since the epoch).
	DrainUntilUnixMs int64 `json:"drain_until_unix_ms,omitempty"`
}

// EffectiveWeight reports Weight with its default.
func (b *Backend) EffectiveWeight() uint32 {
	if b.Weight == nil {
		return 1
	}
	return *b.Weight
}

// IsEnabled reports Enabled with its default.
func (b *Backend) IsEnabled() bool { return b.Enabled == nil || *b.Enabled }

// EffectiveState reports State with its default.
func (b *Backend) EffectiveState() BackendState {
	if b.State == "" {
		return BackendReady
	}
	return b.State
}

// DrainUntil is DrainUntilUnixMs as a time.
func (b *Backend) DrainUntil() time.Time { return time.UnixMilli(b.DrainUntilUnixMs) }

// Endpoint is the backend's address and port.
func (b *Backend) Endpoint() netip.AddrPort { return netip.AddrPortFrom(b.Address, b.Port) }

// BackendState is Fabric's intent for a backend.
type BackendState string

// Backend states (see the product description's table).
const (
	BackendReady     BackendState = "ready"     // new flows and established affinity
	BackendDraining  BackendState = "draining"  // established flows only, until the drain deadline
	BackendUnhealthy BackendState = "unhealthy" // nothing; its flows fail over
)

// HealthCheck asks the node to probe a service's backends.
type HealthCheck struct {
	Kind               string `json:"kind"`
	TimeoutMs          uint32 `json:"timeout_ms,omitempty"`
	IntervalMs         uint32 `json:"interval_ms,omitempty"`
	UnhealthyThreshold uint32 `json:"unhealthy_threshold,omitempty"`
	HealthyThreshold   uint32 `json:"healthy_threshold,omitempty"`
}
