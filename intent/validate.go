package intent

import (
	"fmt"
	"math"
	"net/netip"
	"slices"
	"strings"
)

// Categories that this file adds to those of errors.go. Each is a
// refinement of ErrInvalid or ErrLimit, so errors.Is(err, ErrInvalid)
// holds for a malformed or prerequisite error and errors.Is(err,
// ErrLimit) for an oversize input: a caller that knows only the broad
// categories still classifies them right.
var (
	// ErrMalformed: the input is not JSON (or TOML) of the expected shape:
	// a syntax error, a value of the wrong type, an unknown or repeated
	// field, trailing data. It wraps ErrInvalid.
	ErrMalformed = fmt.Errorf("malformed input: %w", ErrInvalid)
	// ErrPrerequisite: a feature is requested without what it depends on,
	// e.g. max_egress_mbps without edt_enabled in the node configuration.
	// It wraps ErrInvalid.
	ErrPrerequisite = fmt.Errorf("missing prerequisite: %w", ErrInvalid)
	// ErrTooLarge: the input exceeds its size limit (MaxRequestBytes). It
	// wraps ErrLimit; an HTTP API answers it with 413.
	ErrTooLarge = fmt.Errorf("input too large: %w", ErrLimit)
	// ErrReservedName: a service is named with a word the REST API
	// reserves as a path segment under /v1/network/services/ (see
	// ReservedNames). It wraps ErrInvalid; the field is "name".
	ErrReservedName = fmt.Errorf("reserved name: %w", ErrInvalid)
)

// Every error that decoding and validation return about the content of a
// request, a catalog or a configuration is (or joins) a *ValidationError
// (errors.go) whose Field is the path of the field as the input spells it:
// "name", "backends[2].weight", "health_check.kind" for a service,
// "services[3].ports[0]" within a catalog,
// "sandbox.dataplane.service.snat_address" for the configuration; empty
// when the error concerns the input as a whole. Its Kind is the category.
// verr makes one.
func verr(kind error, field, format string, args ...any) *ValidationError {
	return &ValidationError{Field: field, Reason: fmt.Sprintf(format, args...), Kind: kind}
}

// withinField returns a copy of e whose field is prefixed with a parent
// path.
func withinField(e *ValidationError, parent string) *ValidationError {
	c := *e
	switch {
	case parent == "":
	case c.Field == "":
		c.Field = parent
	case strings.HasPrefix(c.Field, "["):
		c.Field = parent + c.Field
	default:
		c.Field = parent + "." + c.Field
	}
	return &c
}

// Bounds of a service.
const (
	// MaxNameLen is the longest service name. A name is 1 to MaxNameLen
	// characters of a-z, 0-9 and '-', starting with a letter, so that it
	// is usable in a URL path, a file name and a metric label as it is.
	MaxNameLen = 63
	// MaxVIPs is the number of VIPs of a service: at most one per family.
	MaxVIPs = 2
	// MaxPortsPerService bounds Service.Ports. Every port is served on
	// every VIP, and each (VIP, port) is one datapath service with its own
	// Maglev table, so ports multiply the datapath's cost.
	MaxPortsPerService = 64
	// MaxBackendsPerService bounds Service.Backends (both families
	// together, disabled backends included).
	MaxBackendsPerService = 1024
	// MaxWeight is the largest backend weight. Weights are relative; the
	// bound keeps the Maglev fill well within its arithmetic and catches
	// units mistakes.
	MaxWeight = 65535
	// MaxDrainUntilUnixMs is the latest drain deadline: the datapath keeps
	// deadlines in nanoseconds in 64 bits, which end in April 2262.
	MaxDrainUntilUnixMs = math.MaxInt64 / 1_000_000
	// MinEgressMbps and MaxEgressMbpsLimit bound max_egress_mbps when it
	// is set (0 leaves the service unpaced): 1 Mbit/s to 100 Gbit/s, the
	// rates the datapath's EDT arithmetic holds (bpf.MinEDTRate,
	// bpf.MaxEDTRate).
	MinEgressMbps      = 1
	MaxEgressMbpsLimit = 100_000
)

// Health-check defaults and bounds (milliseconds and check counts). A
// field left 0 takes its default; the interval must also be greater than
// the timeout, so that one round ends before the next begins.
const (
	DefaultHealthTimeoutMs          = 1000
	DefaultHealthIntervalMs         = 2000
	DefaultHealthUnhealthyThreshold = 3
	DefaultHealthHealthyThreshold   = 2

	MinHealthTimeoutMs  = 10
	MaxHealthTimeoutMs  = 60_000
	MinHealthIntervalMs = 100
	MaxHealthIntervalMs = 3_600_000
	MaxHealthThreshold  = 100
)

// HealthCheckKindTCP is the only health check the node runs: a TCP
// connect to the backend's address and port.
const HealthCheckKindTCP = "tcp"

// WithDefaults returns h with every field left 0 set to its default
// (DefaultHealth*).
func (h HealthCheck) WithDefaults() HealthCheck {
	if h.TimeoutMs == 0 {
		h.TimeoutMs = DefaultHealthTimeoutMs
	}
	if h.IntervalMs == 0 {
		h.IntervalMs = DefaultHealthIntervalMs
	}
	if h.UnhealthyThreshold == 0 {
		h.UnhealthyThreshold = DefaultHealthUnhealthyThreshold
	}
	if h.HealthyThreshold == 0 {
		h.HealthyThreshold = DefaultHealthHealthyThreshold
	}
	return h
}

// Node is what validation needs to know of the node that is to serve a
// service: the settings a service's features depend on. Package fluxvm
// fills it from its Config (Config.Node); a control plane validating
// intent for a node elsewhere fills it from what it knows of that node.
// The zero Node is a node with no north-south interface, no SNAT address
// and no EDT: east-west services only.
type Node struct {
	// NorthSouth: the node has north-south interfaces (north_south_interfaces
	// in [sandbox.dataplane.service]), which exposure north-south and both
	// need.
	NorthSouth bool
	// SNAT4 and SNAT6 are the node's SNAT addresses (snat_address,
	// snat_address_v6): north-south NAT of a VIP needs one of the VIP's
	// family. The zero Addr is none.
	SNAT4, SNAT6 netip.Addr
	// EDTEnabled: the node has EDT pacing enabled (edt_enabled), which
	// max_egress_mbps needs.
	EDTEnabled bool
}

// SNATAddressFor returns the node's SNAT address of a family (v6 false:
// IPv4), or the zero Addr.
func (n *Node) SNATAddressFor(v6 bool) netip.Addr {
	a := n.SNAT4
	if v6 {
		a = n.SNAT6
	}
	if !a.IsValid() || a.Is4() == v6 || a.Is4In6() {
		return netip.Addr{}
	}
	return a
}

// feature is one row of the unsupported table: a feature of the product
// description that this build does not have. Exactly one of service and
// node is set; it reports whether the input asks for the feature.
type feature struct {
	field   string // JSON field of a service, or TOML key of the service table
	service func(*Service) bool
	node    func(*Node) bool
	reason  string
}

// unsupported lists every feature that is rejected with ErrUnsupported
// because this build does not implement it. The issue that builds a
// feature removes its row (and adds the tests that prove it works).
// The table is empty: every feature of the product description that a
// service or the node configuration can ask for is built (EDT pacing,
// max_egress_mbps and edt_enabled, was the last row).
var unsupported = []feature{}

// CheckNode reports the node settings this build does not have
// (ErrUnsupported), each a *ValidationError whose Field is the key of the
// setting in [sandbox.dataplane.service] ("edt_enabled"), or nil.
func CheckNode(n Node) []*ValidationError {
	var out []*ValidationError
	for _, f := range unsupported {
		if f.node != nil && f.node(&n) {
			out = append(out, verr(ErrUnsupported, f.field, "%s", f.reason))
		}
	}
	return out
}

// prerequisite is a service feature that needs something else, in the
// service or in the node configuration. missing returns why, or "".
type prerequisite struct {
	field   string
	missing func(*Service, *Node) string
}

// prerequisites are checked before the unsupported table, so that a
// request that could never work reports what it lacks, not only that the
// feature is not built. (HA export/import will add: HA requires
// north_south_interfaces.)
var prerequisites = []prerequisite{
	{"max_egress_mbps", func(s *Service, n *Node) string {
		if s.MaxEgressMbps != 0 && !n.EDTEnabled {
			return "requires edt_enabled = true in [sandbox.dataplane.service]"
		}
		return ""
	}},
	{"advertise", func(s *Service, n *Node) string {
		if s.Advertise && !s.IsNorthSouth() {
			return "requires exposure north-south or both (an east-west VIP is never advertised)"
		}
		return ""
	}},
	{"exposure", func(s *Service, n *Node) string {
		if s.IsNorthSouth() && !n.NorthSouth {
			return fmt.Sprintf("%s requires north_south_interfaces in [sandbox.dataplane.service]", s.Exposure)
		}
		return ""
	}},
	{"host_routing", func(s *Service, n *Node) string {
		if s.HostRouting && s.Mode == ModeDSR {
			return "requires mode nat: the FIB fast path forwards translated packets, and DSR forwards by FIB lookup already"
		}
		return ""
	}},
}

// snatPrerequisite checks that north-south NAT has an SNAT address of
// each VIP's family, naming the VIP.
func snatPrerequisite(s *Service, n *Node) *ValidationError {
	if !s.IsNorthSouth() || s.Mode == ModeDSR {
		return nil
	}
	for i, vip := range s.VIPs {
		v6 := !vip.Unmap().Is4()
		if n.SNATAddressFor(v6).IsValid() {
			continue
		}
		key := "an IPv4 snat_address"
		if v6 {
			key = "snat_address_v6 (or an IPv6 snat_address)"
		}
		return verr(ErrPrerequisite, fmt.Sprintf("vips[%d]", i),
			"%s NAT of the %s VIP %s requires %s in [sandbox.dataplane.service], so that backend replies return through this node",
			s.Exposure, familyName[addrFamily(vip.Unmap())], vip, key)
	}
	return nil
}

// checkDSRPorts enforces what routed DSR cannot do: the packet keeps the
// VIP and its destination port, so every backend must listen on the
// frontend port itself.
func checkDSRPorts(s *Service) *ValidationError {
	if s.Mode != ModeDSR {
		return nil
	}
	for i, b := range s.Backends {
		for j, p := range s.Ports {
			if b.Port != p.Port {
				return verr(ErrInvalid, fmt.Sprintf("backends[%d].port", i),
					"%d differs from the frontend port %d (ports[%d]): DSR does not rewrite ports, so with mode dsr every backend port must equal every frontend port", b.Port, p.Port, j)
			}
		}
	}
	return nil
}

// ValidateService checks one service against the rules below and against
// the prerequisites in node. It returns nil or the first problem found, as a
// *ValidationError wrapped with the service's name. It has no side
// effects: a rejected service changes nothing anywhere.
//
// Rules, each reported with the field it concerns:
//
//   - name: required, 1..MaxNameLen characters of a-z, 0-9 and '-',
//     starting with a letter; not one of ReservedNames (ErrReservedName,
//     which wraps ErrInvalid).
//   - exposure: "" (east-west), east-west, north-south or both.
//   - mode: "" (nat), nat or dsr.
//   - vips: 1 or 2, at most one per address family; each a valid address
//     without a zone, not IPv4-mapped IPv6, not unspecified, loopback,
//     multicast, link-local or the IPv4 broadcast address.
//   - ports: 1..MaxPortsPerService; port 1..65535 (port 0 is reserved by
//     the datapath for VIP markers); protocol tcp or udp; no (port,
//     protocol) twice (ErrConflict).
//   - backends: 0..MaxBackendsPerService; address valid, without a zone,
//     not IPv4-mapped, unspecified, loopback (a VM's packets to a loopback
//     destination are dropped by the kernel), multicast or broadcast, and
//     of a family the service has a VIP of; port 1..65535; weight
//     0..MaxWeight; state ready, draining or unhealthy ("" = ready);
//     drain_until_unix_ms set only with state draining, and required
//     (> 0, at most MaxDrainUntilUnixMs) there; no (address, port) twice
//     (ErrConflict).
//   - health_check: kind "tcp" (UDP and application health belong in an
//     application-aware control-plane probe; any other kind is ErrInvalid
//     on health_check.kind); timeout_ms 10..60000 ms (default 1000),
//     interval_ms 100..3600000 ms (default 2000) and greater than the
//     timeout (else health_check.interval_ms), unhealthy_threshold and
//     healthy_threshold 1..100 (defaults 3 and 2); 0 takes the default
//     (the DefaultHealth* and Min/MaxHealth* constants).
//   - mode dsr: every backend port equals every frontend port (the
//     datapath does not rewrite ports under DSR), else backends[i].port.
//   - prerequisites (ErrPrerequisite): max_egress_mbps needs edt_enabled;
//     advertise needs exposure north-south or both; north-south exposure
//     (north-south or both) needs north_south_interfaces (field exposure);
//     host_routing needs mode nat; north-south NAT needs an SNAT address
//     of each VIP's family (field vips[i]): an IPv4 VIP an IPv4
//     snat_address, an IPv6 VIP snat_address_v6 or an IPv6 snat_address.
//   - max_egress_mbps: 0 (unpaced) or MinEgressMbps..MaxEgressMbpsLimit
//     (1..100000 Mbit/s).
func ValidateService(s Service, node Node) error {
	if e := validateService(&s, &node, false); e != nil {
		return fmt.Errorf("intent: service %s: %w", quoteName(s.Name), e)
	}
	return nil
}

// quoteName quotes a service name for an error message, shortened if it
// is too long to be one.
func quoteName(name string) string {
	if len(name) > MaxNameLen+8 {
		name = name[:MaxNameLen] + "..."
	}
	return fmt.Sprintf("%q", name)
}

// validateService checks s. legacyName accepts a reserved name (a
// service restored from a catalog written before its name was reserved,
// see ValidateRestoredCatalog); every other rule holds.
func validateService(s *Service, node *Node, legacyName bool) *ValidationError {
	if e := checkName(s.Name); e != nil {
		return e
	}
	if !legacyName && IsReservedName(s.Name) {
		return verr(ErrReservedName, "name", "%q is reserved: the REST API uses (or will use) /v1/network/services/%s for another purpose, so a service of that name could not be read by name; reserved names are %s",
			s.Name, s.Name, strings.Join(ReservedNames(), ", "))
	}
	switch s.Exposure {
	case "", ExposureEastWest, ExposureNorthSouth, ExposureBoth:
	default:
		return verr(ErrInvalid, "exposure", "%q is not an exposure (want east-west, north-south or both)", s.Exposure)
	}
	switch s.Mode {
	case "", ModeNAT, ModeDSR:
	default:
		return verr(ErrInvalid, "mode", "%q is not a mode (want nat or dsr)", s.Mode)
	}
	var fam [2]bool // has a VIP of IPv4, IPv6
	if e := checkVIPs(s.VIPs, &fam); e != nil {
		return e
	}
	if e := checkPorts(s.Ports); e != nil {
		return e
	}
	if e := checkBackends(s.Backends, fam); e != nil {
		return e
	}
	if s.HealthCheck != nil {
		if e := checkHealth(s.HealthCheck); e != nil {
			return e
		}
	}
	if e := checkDSRPorts(s); e != nil {
		return e
	}
	if m := s.MaxEgressMbps; m != 0 && (m < MinEgressMbps || m > MaxEgressMbpsLimit) {
		return verr(ErrInvalid, "max_egress_mbps", "%d is outside %d..%d (megabits per second; 0 leaves the service unpaced)", m, MinEgressMbps, MaxEgressMbpsLimit)
	}
	for _, p := range prerequisites {
		if why := p.missing(s, node); why != "" {
			return verr(ErrPrerequisite, p.field, "%s", why)
		}
	}
	if e := snatPrerequisite(s, node); e != nil {
		return e
	}
	for _, f := range unsupported {
		if f.service != nil && f.service(s) {
			return verr(ErrUnsupported, f.field, "%s", f.reason)
		}
	}
	return nil
}

func checkName(name string) *ValidationError {
	const rule = "must be 1 to 63 characters of a-z, 0-9 and '-', starting with a letter"
	if name == "" {
		return verr(ErrInvalid, "name", "required; %s", rule)
	}
	if len(name) > MaxNameLen {
		return verr(ErrInvalid, "name", "%d characters; %s", len(name), rule)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		letter := c >= 'a' && c <= 'z'
		if i == 0 && !letter {
			return verr(ErrInvalid, "name", "%q does not start with a letter; %s", name, rule)
		}
		if !letter && !(c >= '0' && c <= '9') && c != '-' {
			return verr(ErrInvalid, "name", "%q has a character other than a-z, 0-9 and '-'; %s", name, rule)
		}
	}
	return nil
}

// reservedNames are the literal segments under /v1/network/services/ that
// the REST API uses now or will use; a service so named could not be read
// by name, or a later route would hide it.
var reservedNames = map[string]bool{
	"status": true, "stats": true, "health": true, "conntrack": true, "pressure": true,
	"advertisements": true, "flows": true, "telemetry": true, "policies": true,
	"ha": true, "snat": true,
}

// ReservedNames returns, sorted, the words that cannot be service names:
// the fixed path segments under /v1/network/services/ of the REST API,
// those it has (status, stats, health, conntrack, advertisements, flows,
// policies, telemetry, ha, pressure: POST …/pressure/reconcile, snat: POST
// …/snat/peers). Validation
// rejects them with ErrReservedName.
func ReservedNames() []string {
	out := make([]string, 0, len(reservedNames))
	for n := range reservedNames {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// IsReservedName reports whether name is one of ReservedNames.
func IsReservedName(name string) bool { return reservedNames[name] }

var broadcast4 = netip.AddrFrom4([4]byte{255, 255, 255, 255})

// AddrProblem says what is wrong with a as a VIP (vip true) or as a
// backend address, or returns "". The node's SNAT addresses follow the
// rules of a VIP: backends route replies to them across the network.
func AddrProblem(a netip.Addr, vip bool) string { return addrProblem(a, vip) }

func addrProblem(a netip.Addr, vip bool) string {
	switch {
	case !a.IsValid():
		return "not a valid IP address"
	case a.Zone() != "":
		return fmt.Sprintf("%s has a zone; zones are not allowed", a)
	case a.Is4In6():
		return fmt.Sprintf("%s is an IPv4-mapped IPv6 address; write the IPv4 address %s", a, a.Unmap())
	case a.IsUnspecified():
		return fmt.Sprintf("%s is the unspecified address", a)
	case a.IsMulticast():
		return fmt.Sprintf("%s is a multicast address", a)
	case a == broadcast4:
		return fmt.Sprintf("%s is the broadcast address", a)
	case a.IsLoopback():
		return fmt.Sprintf("%s is a loopback address", a)
	case vip && a.IsLinkLocalUnicast():
		return fmt.Sprintf("%s is a link-local address", a)
	}
	return ""
}

func addrFamily(a netip.Addr) int {
	if a.Is4() {
		return 0
	}
	return 1
}

var familyName = [2]string{"IPv4", "IPv6"}

func checkVIPs(vips []netip.Addr, fam *[2]bool) *ValidationError {
	switch {
	case len(vips) == 0:
		return verr(ErrInvalid, "vips", "required: at least one VIP")
	case len(vips) > MaxVIPs:
		return verr(ErrInvalid, "vips", "%d VIPs; a service has at most %d, one per address family", len(vips), MaxVIPs)
	}
	for i, a := range vips {
		field := fmt.Sprintf("vips[%d]", i)
		if why := addrProblem(a, true); why != "" {
			return verr(ErrInvalid, field, "%s", why)
		}
		f := addrFamily(a)
		if fam[f] {
			return verr(ErrInvalid, field, "a second %s VIP; a service has at most one VIP per address family", familyName[f])
		}
		fam[f] = true
	}
	return nil
}

func checkPorts(ports []ServicePort) *ValidationError {
	switch {
	case len(ports) == 0:
		return verr(ErrInvalid, "ports", "required: at least one port")
	case len(ports) > MaxPortsPerService:
		return verr(ErrLimit, "ports", "%d ports; a service has at most %d", len(ports), MaxPortsPerService)
	}
	seen := make(map[ServicePort]int, len(ports))
	for i, p := range ports {
		field := fmt.Sprintf("ports[%d]", i)
		if p.Port == 0 {
			return verr(ErrInvalid, field+".port", "must be 1..65535 (port 0 is reserved by the datapath for VIP markers)")
		}
		switch p.Protocol {
		case TCP, UDP:
		case "":
			return verr(ErrInvalid, field+".protocol", "required: tcp or udp")
		default:
			return verr(ErrInvalid, field+".protocol", "%q is not a protocol (want tcp or udp)", p.Protocol)
		}
		if j, dup := seen[p]; dup {
			return verr(ErrConflict, field, "%s is already ports[%d]", p, j)
		}
		seen[p] = i
	}
	return nil
}

func checkBackends(backends []Backend, fam [2]bool) *ValidationError {
	if len(backends) > MaxBackendsPerService {
		return verr(ErrLimit, "backends", "%d backends; a service has at most %d", len(backends), MaxBackendsPerService)
	}
	seen := make(map[netip.AddrPort]int, len(backends))
	for i := range backends {
		b := &backends[i]
		field := fmt.Sprintf("backends[%d]", i)
		if why := addrProblem(b.Address, false); why != "" {
			return verr(ErrInvalid, field+".address", "%s", why)
		}
		if f := addrFamily(b.Address); !fam[f] {
			return verr(ErrInvalid, field+".address", "%s backend %s, but the service has no %s VIP", familyName[f], b.Address, familyName[f])
		}
		if b.Port == 0 {
			return verr(ErrInvalid, field+".port", "must be 1..65535")
		}
		if b.Weight != nil && *b.Weight > MaxWeight {
			return verr(ErrInvalid, field+".weight", "%d is above the maximum weight %d", *b.Weight, MaxWeight)
		}
		switch b.State {
		case "", BackendReady, BackendDraining, BackendUnhealthy:
		default:
			return verr(ErrInvalid, field+".state", "%q is not a backend state (want ready, draining or unhealthy)", b.State)
		}
		if b.EffectiveState() == BackendDraining {
			switch {
			case b.DrainUntilUnixMs <= 0:
				return verr(ErrInvalid, field+".drain_until_unix_ms",
					"a draining backend needs a drain deadline > 0 (ms since the Unix epoch); without one its established flows would be kept forever")
			case b.DrainUntilUnixMs > MaxDrainUntilUnixMs:
				return verr(ErrInvalid, field+".drain_until_unix_ms", "%d is after the latest deadline %d (year 2262)", b.DrainUntilUnixMs, int64(MaxDrainUntilUnixMs))
			}
		} else if b.DrainUntilUnixMs != 0 {
			return verr(ErrInvalid, field+".drain_until_unix_ms", "set only for a draining backend (state is %s)", b.EffectiveState())
		}
		ep := b.Endpoint()
		if j, dup := seen[ep]; dup {
			return verr(ErrConflict, field, "%s is already backends[%d]", ep, j)
		}
		seen[ep] = i
	}
	return nil
}

func checkHealth(h *HealthCheck) *ValidationError {
	switch h.Kind {
	case HealthCheckKindTCP:
	case "":
		return verr(ErrInvalid, "health_check.kind", `required: "tcp" (a TCP connect to each backend)`)
	default:
		return verr(ErrInvalid, "health_check.kind",
			"%q: the node runs only TCP connect checks (kind \"tcp\"); UDP and application health belong in an application-aware control-plane probe, which reports through backend state", h.Kind)
	}
	e := h.WithDefaults()
	switch {
	case e.TimeoutMs < MinHealthTimeoutMs || e.TimeoutMs > MaxHealthTimeoutMs:
		return verr(ErrInvalid, "health_check.timeout_ms", "%d is outside %d..%d", e.TimeoutMs, MinHealthTimeoutMs, MaxHealthTimeoutMs)
	case e.IntervalMs < MinHealthIntervalMs || e.IntervalMs > MaxHealthIntervalMs:
		return verr(ErrInvalid, "health_check.interval_ms", "%d is outside %d..%d", e.IntervalMs, MinHealthIntervalMs, MaxHealthIntervalMs)
	case e.IntervalMs <= e.TimeoutMs:
		return verr(ErrInvalid, "health_check.interval_ms", "%d must be greater than timeout_ms (%d)", e.IntervalMs, e.TimeoutMs)
	case e.UnhealthyThreshold > MaxHealthThreshold:
		return verr(ErrInvalid, "health_check.unhealthy_threshold", "%d is outside 1..%d", e.UnhealthyThreshold, MaxHealthThreshold)
	case e.HealthyThreshold > MaxHealthThreshold:
		return verr(ErrInvalid, "health_check.healthy_threshold", "%d is outside 1..%d", e.HealthyThreshold, MaxHealthThreshold)
	}
	return nil
}

// Limits bound a whole catalog by the capacities of the datapath's maps.
// Each service becomes one datapath service per (VIP, port, protocol); see
// the fields for what each one uses. Package fluxvm derives them from the
// loaded object (fluxvm.LimitsFor) or from a tier (fluxvm.LimitsForTier).
type Limits struct {
	// Services is the number of datapath services: one per VIP and port of
	// every service. Each takes a service id, a Maglev table and a guard.
	Services int
	// Frontends is the number of frontend entries per address family:
	// one per (VIP, port, protocol) of that family, plus one VIP marker
	// per distinct (VIP, protocol).
	Frontends int
	// Backends is the number of datapath backend entries: every datapath
	// service has one for each enabled backend of its VIP's family.
	Backends int
	// MaglevSize is the number of slots of a Maglev table; a datapath
	// service cannot have more eligible (ready, weighted) backends.
	MaglevSize int
}

type catalogFE struct {
	vip   netip.Addr
	port  uint16
	proto Protocol
}

type catalogMarker struct {
	vip   netip.Addr
	proto Protocol
}

// ValidateCatalog checks a whole catalog, the set of services a node is
// to serve at once: every service passes ValidateService with node
// (errors name it as services[i]); names are unique; no frontend (VIP,
// port, protocol) belongs to two services (ErrConflict); and the catalog
// fits limits (ErrLimit, naming the first service that does not fit):
// datapath services, frontend entries per family (VIP markers included),
// backend entries, and eligible backends per Maglev table. Disabled
// services count: they keep their frontends, closed. Disabled backends do
// not: the datapath does not have them. Like ValidateService it is pure.
func ValidateCatalog(services []Service, node Node, limits Limits) error {
	return ValidateRestoredCatalog(services, node, limits, nil)
}

// ValidateRestoredCatalog is ValidateCatalog accepting the reserved names
// in legacy: services that a catalog restored from disk had before their
// name was reserved (see fluxvm.Dataplane's restore). Every other rule
// holds for them.
func ValidateRestoredCatalog(services []Service, node Node, limits Limits, legacy map[string]bool) error {
	names := make(map[string]int, len(services))
	frontends := make(map[catalogFE]int)
	markers := make(map[catalogMarker]bool)
	var dpServices, backends int
	var feCount [2]int
	for i := range services {
		s := &services[i]
		at := fmt.Sprintf("services[%d]", i)
		fail := func(e *ValidationError) error {
			return fmt.Errorf("intent: catalog: service %s: %w", quoteName(s.Name), withinField(e, at))
		}
		if e := validateService(s, &node, legacy[s.Name]); e != nil {
			return fail(e)
		}
		if j, dup := names[s.Name]; dup {
			return fail(verr(ErrConflict, "name", "%q is already the name of services[%d]", s.Name, j))
		}
		names[s.Name] = i
		for _, vip := range s.VIPs {
			f := addrFamily(vip)
			perFrontend, eligible := backendsOf(s, f)
			if eligible > limits.MaglevSize {
				return fail(verr(ErrLimit, "backends", "%d eligible %s backends; a Maglev table of this tier has %d slots", eligible, familyName[f], limits.MaglevSize))
			}
			for pi, p := range s.Ports {
				k := catalogFE{vip, p.Port, p.Protocol}
				if j, dup := frontends[k]; dup {
					return fail(verr(ErrConflict, fmt.Sprintf("ports[%d]", pi), "frontend %s/%s is already served by service %q (services[%d])",
						netip.AddrPortFrom(vip, p.Port), p.Protocol, services[j].Name, j))
				}
				frontends[k] = i
				dpServices++
				backends += perFrontend
				feCount[f]++
				if m := (catalogMarker{vip, p.Protocol}); !markers[m] {
					markers[m] = true
					feCount[f]++
				}
			}
		}
		if err := limits.exceeded("the catalog up to this service", dpServices, feCount, backends); err != nil {
			return fail(err)
		}
	}
	return nil
}

// exceeded reports the first of the tier's capacities that a catalog
// (what names it, for the message) needing dps datapath services, fes
// IPv4 and IPv6 frontend entries and bes backend entries would exceed.
func (limits Limits) exceeded(what string, dps int, fes [2]int, bes int) *ValidationError {
	switch {
	case dps > limits.Services:
		return verr(ErrLimit, "", "%s needs %d datapath services (one per VIP and port); the map tier has %d", what, dps, limits.Services)
	case fes[0] > limits.Frontends:
		return verr(ErrLimit, "", "%s needs %d IPv4 frontend entries (VIP markers included); the map tier has %d", what, fes[0], limits.Frontends)
	case fes[1] > limits.Frontends:
		return verr(ErrLimit, "", "%s needs %d IPv6 frontend entries (VIP markers included); the map tier has %d", what, fes[1], limits.Frontends)
	case bes > limits.Backends:
		return verr(ErrLimit, "", "%s needs %d datapath backend entries (one per frontend and backend of its family); the map tier has %d", what, bes, limits.Backends)
	}
	return nil
}

// backendsOf counts the enabled backends of s in family f (each frontend of
// that family gets a backend slot for every one) and those eligible for new
// flows (Ready with a weight).
func backendsOf(s *Service, f int) (perFrontend, eligible int) {
	for k := range s.Backends {
		b := &s.Backends[k]
		if !b.IsEnabled() || addrFamily(b.Address) != f {
			continue
		}
		perFrontend++
		if b.EffectiveState() == BackendReady && b.EffectiveWeight() > 0 {
			eligible++
		}
	}
	return perFrontend, eligible
}
