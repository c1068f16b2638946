package fluxvm

import (
	"net/netip"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
	flowview "github.com/fluxvm/servicefabric/fluxvm/internal/flows"
	"github.com/fluxvm/servicefabric/fluxvm/internal/idpool"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
)

// ServiceStatus is a service as the node has it: the stored intent and
// what it became in the datapath.
type ServiceStatus struct {
	Service   Service          `json:"service"`
	Revision  uint64           `json:"revision"`
	AppliedAt time.Time        `json:"applied_at"`
	Frontends []FrontendStatus `json:"frontends"`
	// EDT is the service's pacing, present when it has max_egress_mbps.
	EDT *ServiceEDTStatus `json:"edt,omitempty"`
}

// ServiceEDTStatus is a paced service's EDT pacing: its cap, as the
// datapath's rate and horizon, and what its frontends sent under it.
type ServiceEDTStatus struct {
	// MaxEgressMbps is the intent's cap, in megabits per second.
	MaxEgressMbps uint32 `json:"max_egress_mbps"`
	// RateBytesPerSec is the rate in the fluxvm_edt entry of each of its
	// frontends (bpf.MbpsToEDTRate): the cap holds per service, its
	// frontends (VIP, port, protocol) sharing one departure clock, and
	// per node (each node paces on its own clock).
	RateBytesPerSec uint64 `json:"rate_bytes_per_sec"`
	// Horizon is the node's edt_horizon, e.g. "250ms".
	Horizon Duration `json:"horizon"`
	// Bytes counts the bytes sent toward the service's clients (its
	// reply_bytes, summed over frontends and CPUs): what pacing let
	// through. The datapath counts a reply only once the horizon admitted
	// it (a north-south reply counted at ingress and dropped at the
	// uplink is taken back; DSR replies of a backend on the node count as
	// they leave).
	Bytes uint64 `json:"bytes"`
	// HorizonDrops counts the packets dropped because their departure
	// lay beyond the horizon (drop reason edt_horizon).
	HorizonDrops uint64 `json:"horizon_drops"`
}

// EDTStatus is the node's EDT pacing (edt_enabled and its keys).
type EDTStatus struct {
	Enabled bool `json:"enabled"`
	// Horizon is edt_horizon, e.g. "250ms".
	Horizon Duration `json:"horizon"`
	// Interfaces are those paced packets may leave by: the VM-edge and
	// north-south interfaces, and edt_interfaces; sorted by name. Listed
	// while edt_enabled, and not after Close.
	Interfaces []EDTInterfaceStatus `json:"interfaces,omitempty"`
}

// EDTInterfaceStatus is how paced packets leave one interface.
type EDTInterfaceStatus = edt.InterfaceStatus

// FrontendStatus is one datapath service: one VIP, port and protocol.
type FrontendStatus struct {
	VIP       netip.AddrPort `json:"vip"`
	Protocol  Protocol       `json:"protocol"`
	ServiceID uint32         `json:"service_id"`
	// Eligible counts the Ready backends in the Maglev table; 0 means
	// new flows are dropped (no_backend).
	Eligible int `json:"eligible_backends"`
	// Backends counts all backends the datapath knows for this frontend,
	// Draining and Unhealthy ones included.
	Backends int `json:"backends"`
	// MaglevSize is the number of slots of the frontend's Maglev table
	// (maglev.SizeFor of its backends, up to the tier's maglev_size); 0
	// while it has no table (no eligible backend).
	MaglevSize uint32 `json:"maglev_size"`
	// GuardOpen is false while the frontend is being reprogrammed or the
	// service is disabled: its packets are dropped.
	GuardOpen bool `json:"guard_open"`
	// RepairPending is true when a change of the service failed and so
	// did putting back what was there (a failed map update): the
	// frontend may hold parts of two intents, so its guard is closed
	// (fail closed) until the service is programmed again, by its next
	// apply (the same intent will do) or health-check round.
	RepairPending bool `json:"repair_pending,omitempty"`
}

// Status describes the node's dataplane.
type Status struct {
	SchemaVersion uint32            `json:"schema_version"`
	Generation    uint32            `json:"program_generation"`
	Tier          string            `json:"map_tier"`
	PinRoot       string            `json:"pin_root"`
	Capacities    Capacities        `json:"capacities"`
	Load          LoadStatus        `json:"load"`
	Interfaces    []InterfaceStatus `json:"interfaces"`
	// Seeds are the flow-hash and Maglev seeds in use: nodes that must
	// pick the same backend for the same flow (an HA pair) show the same.
	Seeds    SeedStatus `json:"seeds"`
	Services int        `json:"services"`
	// SNAT is the north-south source NAT the datapath applies.
	SNAT SNATStatus `json:"snat"`
	// XDPRouteCache is the north-south XDP program's route cache: on or
	// off and why, and how often the node's routing changes emptied it.
	XDPRouteCache XDPRouteCacheStatus `json:"xdp_route_cache"`
	// FrontendIndex is what the IPv4 frontend index (fluxvm_fe4) holds:
	// its slots, the IPv4 frontends, the slots that answer for their one
	// frontend, and the slots (and frontends) shared by several, whose
	// packets the datapath looks up in fluxvm_svc4 (a hash-map call) as
	// every IPv6 frontend's (docs/architecture.md, "Forward path").
	FrontendIndex bpf.FrontendIndexStats `json:"frontend_index"`
	// Programmed is what the services' programming holds in the
	// datapath: frontends (and those pending repair), the service and
	// backend id pools (free, in quarantine until a GC), the backend
	// endpoints of the reverse translation index and those past its
	// slots.
	Programmed ProgrammedStatus `json:"programmed"`
	LastGC     *GCResult        `json:"last_gc,omitempty"`
	// SocketLB is socket load balancing (cgroup_connect): the cgroup and
	// hooks attached, and the worker that terminates connected UDP
	// sockets of gone backends.
	SocketLB SocketLBStatus `json:"socket_lb"`
	// Advertisements is the state of the VIP advertisement snapshot
	// (path, generation, last publish error).
	Advertisements AdvertisementStatus `json:"advertisements"`
	// Memory is the kernel memory of the datapath's maps, the Maglev
	// tables included; absent after Close.
	Memory *MemoryStatus `json:"memory,omitempty"`
	// EDT is EDT pacing: enabled, the horizon, and per interface whether
	// fq holds paced packets or the horizon polices them.
	EDT EDTStatus `json:"edt"`
	// HA is flow-state replication: the lease, the mutation queue, the
	// journals this edge serves and the cursors of what it applied.
	HA HAStatus `json:"ha"`
	// Pressure is the fill of the datapath's hash maps and the map
	// pressure controller's last round (fluxvm/internal/pressure); absent after Close.
	Pressure *PressureStatus `json:"pressure,omitempty"`
	// MapSizes are the maps sized by need: each one's size, the tier's
	// capacity it grows to, and why it has its size (sizing.go); absent
	// after Close.
	MapSizes *MapSizesStatus `json:"map_sizes,omitempty"`
}

// MemoryStatus is the kernel memory of the datapath's maps, in bytes
// (bpf.Datapath.MapMemory): for each map the kernel's own figure, the
// memlock of its fdinfo (what `bpftool map show` prints, and what the map
// charges to the memory cgroup of the process that created it), read at
// the call, not an estimate.
type MemoryStatus struct {
	// Maps holds each map of the loaded object by name. fluxvm_maglev is
	// the outer array alone; the tables it points to are MaglevInner.
	Maps map[string]uint64 `json:"maps,omitempty"`
	// MaglevInner sums the Maglev tables: one inner map per frontend
	// that has an eligible backend.
	MaglevInner InnerMapsMemory `json:"maglev_inner_maps"`
	// Total is the sum of Maps and MaglevInner.Bytes.
	Total uint64 `json:"total_bytes"`
	// Error says why the figures could not be read; they are then zero.
	Error string `json:"error,omitempty"`
}

// InnerMapsMemory sums the Maglev tables (inner maps of fluxvm_maglev).
type InnerMapsMemory struct {
	Count        int    `json:"count"`
	Bytes        uint64 `json:"bytes"`
	LargestBytes uint64 `json:"largest_bytes"`
}

// SeedStatus reports the two seeds that decide a new flow's backend,
// both configuration (hash_seed, maglev_seed; default 0).
type SeedStatus struct {
	// FlowHash seeds the datapath's hash of a new flow's 5-tuple, which
	// picks its Maglev slot (bpf.Options.HashSeed).
	FlowHash uint64 `json:"hash_seed"`
	// Maglev seeds the Maglev tables: which slots each backend holds
	// (Options.MaglevSeed).
	Maglev uint64 `json:"maglev_seed"`
}

// SNATStatus is the datapath's SNAT configuration (fluxvm_snat): the
// source address of north-south NAT flows per family (absent when the
// node has none: new north-south NAT flows of that family would drop as
// snat_failed, and validation rejects services that need one) and the
// port range allocated from.
type SNATStatus struct {
	Address4 netip.Addr `json:"address_v4,omitzero"`
	Address6 netip.Addr `json:"address_v6,omitzero"`
	PortMin  uint16     `json:"port_min"`
	PortMax  uint16     `json:"port_max"`
	// Peers are the SNAT addresses of the other edges of the node's
	// group whose flows it continues (SetSNATPeers), sorted; Announced
	// those of them it took over and wants routed to it.
	Peers     []netip.Addr `json:"peers,omitempty"`
	Announced []netip.Addr `json:"announced,omitempty"`
}

// Capacities are the map sizes of the loaded tier.
type Capacities struct {
	Services   uint32 `json:"services"`
	Frontends  uint32 `json:"frontends"`
	Backends   uint32 `json:"backends"`
	MaglevSize uint32 `json:"maglev_size"`
	// Conntrack and NAT are the tier's entries per family of the
	// conntrack and reverse-NAT maps: their ceiling. A map nothing can
	// use is loaded smaller, and grows to it (Status.MapSizes).
	Conntrack uint32 `json:"conntrack"`
	NAT       uint32 `json:"nat"`
	Edges     uint32 `json:"vm_edge_interfaces"`
	// Sockets is the entries of each socket LB map (fluxvm_sock_fwd,
	// fluxvm_sock_rev): sockets whose backend the socket hooks remember.
	Sockets uint32 `json:"sockets"`
}

// LoadStatus says what opening the pin root found and did.
type LoadStatus struct {
	Created            bool   `json:"created"`
	SchemaRebuilt      bool   `json:"schema_rebuilt"`
	PreviousSchema     uint32 `json:"previous_schema,omitempty"`
	Reloaded           bool   `json:"reloaded"`
	PreviousGeneration uint32 `json:"previous_generation,omitempty"`
	TierChanged        bool   `json:"tier_changed"`
	PreviousTier       string `json:"previous_tier,omitempty"`
	// Migrated and NotMigrated total Migrations: lifecycle entries carried
	// into the new maps, and entries that did not fit (evicted or refused).
	Migrated    int `json:"migrated_entries"`
	NotMigrated int `json:"not_migrated_entries"`
	// Migrations details each migrated lifecycle map: entries read,
	// migrated, evicted (the new tier is smaller), refused (with the
	// kernel's error), and caught up (learned by the old programs while
	// the new maps were being written). Entries = Migrated + Evicted +
	// Refused.
	Migrations []bpf.Migration `json:"migrations,omitempty"`
	// HashSeedChanged: the pins held another flow-hash seed,
	// PreviousHashSeed; new flows pick by the configured one
	// (Status.Seeds), established flows keep their backends.
	HashSeedChanged  bool    `json:"hash_seed_changed"`
	PreviousHashSeed *uint64 `json:"previous_hash_seed,omitempty"`
	// Features are the node-level features loaded into the programs
	// (load-time constants, bpf.Features): "ha", "flow_records", "edt";
	// the others are not in the verified programs, and turning one on
	// takes a restart with its setting (docs/operations.md,
	// "Load-time features").
	Features []string `json:"features"`
}

// InterfaceStatus is one VM-edge or north-south interface and how its
// hooks are attached.
type InterfaceStatus struct {
	Name string `json:"name"`
	// Kind is "vm-edge" (hooks from_vm and to_vm) or "north-south" (hooks
	// ns_in and ns_out).
	Kind  string `json:"kind"`
	Index int    `json:"ifindex"`
	// VMID is the VM of a VM-edge interface; absent on a north-south one.
	VMID  string       `json:"vm_id,omitempty"`
	Hooks []HookStatus `json:"hooks"`
	// XDP is the mode the north-south XDP program actually runs in on a
	// north-south interface: "native", "generic" or "off" (xdp_mode off,
	// or not attached); absent on a VM-edge one.
	XDP string `json:"xdp,omitempty"`
	// XDPProblem says why XDP is off on a north-south interface although
	// xdp_mode is auto: an offload that XDP would misread
	// (bpf.ErrXDPOffload), named with the ethtool command that turns it
	// off. Empty otherwise.
	XDPProblem string `json:"xdp_problem,omitempty"`
	Problem    string `json:"problem,omitempty"`
}

// HookStatus is one attached hook.
type HookStatus struct {
	Hook string `json:"hook"` // "from_vm", "to_vm", "ns_in" or "ns_out"
	Mode string `json:"mode"` // "tcx" or "cls_bpf"
}

// Counters are packet and byte totals of the datapath (package
// fluxvm/internal/flows sums them).
// ProgrammedStatus is Status.Programmed (fluxvm/internal/services), and
// IDPoolStats one of its id pools.
type (
	ProgrammedStatus = services.Status
	IDPoolStats      = idpool.Stats
)

type Counters = flowview.Counters

// Stats are the node's datapath statistics.
type Stats struct {
	// Services by name, summed over the service's frontends.
	Services map[string]Counters `json:"services"`
	// Drops by reason (no_backend, guard_closed, fragment, ...,
	// snat_failed, dsr_no_route).
	Drops map[string]uint64 `json:"drops"`
	// Parser holds the datapath's global counters by name: packets by
	// what the parser saw (ipv4, tcp, truncated, ...) and datapath events
	// (see IsEventCounter): nat_stale; host_routed_packets and
	// host_route_fallbacks (host_routing FIB hits redirected, misses left
	// to the host stack); snat_retries (SNAT port candidates found taken);
	// snat_conflicts (SNAT flows whose port another flow took, mapped
	// afresh);
	// dsr_forwarded (packets DSR redirected toward a backend).
	Parser map[string]uint64 `json:"parser"`
	// EDT holds the paced services by name (those with
	// max_egress_mbps), as ServiceStatus.EDT.
	EDT map[string]ServiceEDTStatus `json:"edt,omitempty"`
}

// VMStats are the service statistics of one VM's edge interfaces.
type VMStats = flowview.VMStats
