package fluxvm

import (
	"net/netip"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/duration"
)

// ConfigTable is the TOML table that holds the node's Service Fabric
// configuration. Keys in errors are spelled in full below it
// ("sandbox.dataplane.service.snat_address"). The reference daemon adds
// its own sub-table to it (api: listen address, TLS, tokens), which it
// decodes and validates itself (see DecodeConfigTable).
const ConfigTable = "sandbox.dataplane.service"

// Defaults of the configuration (see DefaultConfig).
const (
	DefaultCatalogPath         = "/var/lib/fluxvm/service-catalog.json"
	DefaultConntrackGCInterval = 30 * time.Second
	// DefaultSNATPortMin and DefaultSNATPortMax are the default SNAT port
	// range: above Linux's default ephemeral range (32768..60999,
	// net.ipv4.ip_local_port_range), so that north-south SNAT mappings
	// and the node's own outgoing connections do not compete for ports.
	DefaultSNATPortMin = 61000
	DefaultSNATPortMax = 65535
	// DefaultEDTHorizon is the default edt_horizon: how far ahead of now
	// a paced service may schedule its packets (see Config.EDTHorizon).
	// Without fq it is the policer's burst, which TCP at line rate over a
	// short round trip needs large to recover from drops without
	// timeouts (a 50 Mbit/s cap measured 6-12 Mbit/s at 20 ms, 47 at
	// 200 ms, 50 at 250 ms: docs/benchmarks.md); with fq it bounds the
	// queueing delay.
	DefaultEDTHorizon = 250 * time.Millisecond
)

// Bounds of the configuration.
const (
	// MinPressureInterval and MaxPressureInterval bound pressure_interval.
	MinPressureInterval = 100 * time.Millisecond
	MaxPressureInterval = time.Hour
	// MinConntrackGCInterval and MaxConntrackGCInterval bound
	// conntrack_gc_interval.
	MinConntrackGCInterval = time.Second
	// DefaultHAInterval, MinHAInterval and MaxHAInterval: ha_interval.
	DefaultHAInterval = time.Second
	MinHAInterval     = 100 * time.Millisecond
	MaxHAInterval     = time.Minute
	// MaxHAJournalOps bounds ha_journal_max_ops (128 bytes and more an
	// op: some hundreds of MiB per service at most).
	MaxHAJournalOps        = 1 << 22
	MaxConntrackGCInterval = time.Hour
	// MaxInterfaceNameLen is the kernel's limit on interface names
	// (IFNAMSIZ less the terminating NUL).
	MaxInterfaceNameLen = 15
	// MaxVMIDLen bounds vm_id, which appears in URL paths
	// (/v1/vms/{id}/network/services/stats).
	MaxVMIDLen = 128
	// MaxConfigBytes bounds a configuration file read by LoadConfig.
	MaxConfigBytes = 1 << 20
	// MinSNATPort and MaxSNATPort bound snat_port_min and snat_port_max:
	// the well-known ports below 1024 are never allocated.
	MinSNATPort = 1024
	MaxSNATPort = 65535
	// MaxNodeNameLen bounds node_name (the longest DNS name).
	MaxNodeNameLen = 253
	// MaxHealthCheckConcurrency bounds health_check_concurrency.
	MaxHealthCheckConcurrency = 1024
	// MaxFlowSampleRate bounds flow_sample_rate (1 in 65536 new flows).
	MaxFlowSampleRate = 65536
)

// Duration is a time.Duration written in TOML as a Go duration string
// ("30s", "6h", "1m30s"). A bare number is rejected: it would be
// ambiguous about its unit. (Package fluxvm/internal/duration's, which
// the components' status types use too.)
type Duration = duration.Duration

// VMEdgeInterface is one VM-edge interface (the host side of a VM's tap
// or veth) on which the TC programs are attached, and the VM it belongs
// to (statistics per VM are summed over its interfaces).
type VMEdgeInterface struct {
	// Name is the interface name: 1..15 characters, no '/', ':' or white
	// space, not "." or "..". Unique across the configuration.
	Name string `toml:"name" json:"name"`
	// VMID is the VM's id: 1..128 printable ASCII characters without '/'
	// or white space. Several interfaces may belong to one VM.
	VMID string `toml:"vm_id" json:"vm_id"`
}

// Config is the node's Service Fabric configuration: the
// [sandbox.dataplane.service] table of the TOML configuration file (see
// examples/fluxvmd.toml). Start from DefaultConfig (or ParseConfig /
// LoadConfig, which apply the defaults first); the zero Config is not
// valid. Validate checks every key.
type Config struct {
	// MapTier selects the map capacities: "S", "M" or "L" (either case).
	// Default "M". Changing it reloads the pins with new maps.
	MapTier string `toml:"map_tier"`
	// PinRoot is the bpffs directory the datapath owns. Default
	// bpf.DefaultPinRoot (/sys/fs/bpf/fluxvm/service). Absolute, and a
	// directory of its own (not a bpffs mount point itself).
	PinRoot string `toml:"pin_root"`
	// ObjectDir, when set, loads the BPF objects from this directory
	// (e.g. /usr/lib/fluxvm/bpf) instead of the ones embedded in the
	// binary. Absolute. Default empty (embedded).
	ObjectDir string `toml:"object_dir"`
	// AttachMode forces how the TC programs are attached: "tcx" or
	// "cls_bpf"; empty (the default) picks TCX where the kernel has it.
	AttachMode bpf.AttachMode `toml:"attach_mode"`
	// HashSeed seeds the datapath's flow hash, which picks the Maglev
	// slot of a new flow (bpf.Options.HashSeed). Every start writes it to
	// the pins; a change moves only new flows (conntrack keeps the
	// established ones on their backends). Default 0, a seed like any
	// other. Nodes that must pick the same backend for the same flow (an
	// HA pair) need the same hash_seed and maglev_seed; the status
	// reports both. TOML integers are signed, so 0..2^63-1.
	HashSeed uint64 `toml:"hash_seed"`
	// MaglevSeed seeds the Maglev tables (Options.MaglevSeed,
	// maglev.Config.Seed): which slots each backend holds. Every start
	// rebuilds the tables with it; a change moves only new flows, like
	// hash_seed. Default 0; 0..2^63-1.
	MaglevSeed uint64 `toml:"maglev_seed"`
	// CatalogPath is the node-local copy of the service catalog, restored
	// after a restart. Absolute. Default DefaultCatalogPath.
	CatalogPath string `toml:"catalog_path"`
	// AdvertisementsPath is where the VIP advertisement snapshot is
	// published for routing adapters (FRR, BIRD; see
	// docs/advertisements.md). Absolute, a file name of its own (not
	// catalog_path). Default advert.DefaultPath
	// (/run/fluxvm/service-advertisements.json).
	AdvertisementsPath string `toml:"advertisements_path"`
	// NodeName is written as the "node" field of the advertisement
	// snapshot, so that adapters collecting snapshots of several nodes
	// can tell them apart. Optional (default empty: no node field); at
	// most MaxNodeNameLen printable ASCII characters without white space.
	NodeName string `toml:"node_name"`
	// HealthCheckConcurrency bounds how many health-check connects the
	// node runs at once, over all services: 1..MaxHealthCheckConcurrency,
	// 0 (the default) means health.DefaultConcurrency (32).
	HealthCheckConcurrency int `toml:"health_check_concurrency"`
	// FlowSampleRate is FluxScope's sampling (package flows): N gives
	// 1 in N new flows a flow record in fluxvm_sflows (1: every flow),
	// and drops of client packets are recorded within the node's budget
	// (64 records at once, refilled at 64 a second, one bucket shared by
	// all CPUs; drops past it are counted, not recorded); 0 (the
	// default) writes no records at all. 0..MaxFlowSampleRate.
	// Every start writes it to the datapath (see docs/operations.md,
	// "FluxScope flows").
	FlowSampleRate uint32 `toml:"flow_sample_rate"`
	// HAEpoch is ha_epoch: the lease epoch the control plane gave this
	// edge for flow-state replication (package ha, docs/operations.md "HA
	// state transfer"). Nonzero turns replication on: the datapath queues
	// every flow it learns, per-service journals serve deltas (the
	// conntrack delta, delta import and ack routes answer), snapshots
	// carry the lease and the journal's checkpoint, and imports are
	// fenced by the lease; it needs north_south_interfaces. Snapshots
	// alone (conntrack export and import: a planned move of a service's
	// flows) need only north_south_interfaces. A newer lease given at run time
	// (Dataplane.UpdateLease) is kept next to the catalog and wins over
	// an older ha_epoch at the next start. 0 (the default): off.
	HAEpoch uint64 `toml:"ha_epoch"`
	// HAInterval is ha_interval: how often the journals seal what the
	// queue brought into a batch a standby can pull, which bounds what a
	// failover can lose. Default 1s, range 100ms..1m.
	HAInterval Duration `toml:"ha_interval"`
	// HAJournalMaxOps is ha_journal_max_ops: the history each service's
	// journal keeps for standbys that have not acked (ha.JournalOptions);
	// a standby further behind resyncs from a snapshot. 0: the default
	// (ha.DefaultMaxOps), at most MaxHAJournalOps.
	HAJournalMaxOps int `toml:"ha_journal_max_ops"`
	// HAGroup is ha_group: the edge is one of a group of edges behind an
	// ECMP router, all active, each holding a lease of its own and
	// following every other edge's journals (a cursor per service and
	// source edge, named by node_name), so that any edge continues any
	// edge's flow (docs/operations.md, "Edges of a group"). Needs ha_epoch
	// and node_name. Default false: an active/standby pair.
	HAGroup bool `toml:"ha_group"`
	// PressureSoftPercent and PressureHardPercent are the map pressure
	// controller's thresholds (pressure_soft_percent,
	// pressure_hard_percent): the fill, in percent, of a flow map
	// (conntrack, reverse NAT) at which it makes room (a GC now, then the
	// flows closest to their end first) and at which the level reads
	// hard. Defaults 80 and 95; 1..100, soft below hard.
	PressureSoftPercent int `toml:"pressure_soft_percent"`
	PressureHardPercent int `toml:"pressure_hard_percent"`
	// PressureInterval is how often the controller reads the maps' fill
	// (pressure_interval; insert failures are read twenty times as
	// often). Default 2s, range MinPressureInterval..MaxPressureInterval.
	PressureInterval Duration `toml:"pressure_interval"`
	// ConntrackGCInterval is how often userspace garbage-collects
	// conntrack and reverse-NAT entries (Options.ConntrackGCInterval: the period
	// adapts around it and counts from the last GC, also across
	// restarts). Default 30s, range 1s..1h.
	ConntrackGCInterval Duration `toml:"conntrack_gc_interval"`
	// Conntrack idle timeouts by protocol state, whole seconds in
	// conntrack.MinTimeout..conntrack.MaxTimeout (2s..168h). Defaults are
	// the datapath's built-in ones (bpf.DefaultTimeout*): 60s, 6h, 30s,
	// 10s and 60s.
	TCPSynTimeout         Duration `toml:"tcp_syn_timeout"`
	TCPEstablishedTimeout Duration `toml:"tcp_established_timeout"`
	TCPFinTimeout         Duration `toml:"tcp_fin_timeout"`
	TCPRstTimeout         Duration `toml:"tcp_rst_timeout"`
	UDPTimeout            Duration `toml:"udp_timeout"`
	// VMEdgeInterfaces are the VM-edge interfaces to attach to.
	VMEdgeInterfaces []VMEdgeInterface `toml:"vm_edge_interfaces"`
	// NorthSouthInterfaces are the node's north-south interfaces (its
	// uplinks toward clients outside the node). Each gets the
	// north-south programs on TC ingress (ns_in) and egress (ns_out).
	// Valid, unique interface names, none also a VM edge. Services with
	// exposure north-south or both need at least one. Default none.
	NorthSouthInterfaces []string `toml:"north_south_interfaces"`
	// XDPMode puts the north-south XDP program on every north-south
	// interface in front of the TC hooks: "off" (the default), "native"
	// (in the driver), "generic" (any driver, after the skb is built) or
	// "auto" (native, and generic where the driver refuses native).
	// Packets XDP cannot finish pass to TC untouched (see
	// docs/operations.md). An XDP program of another product on an
	// interface is never replaced: attaching fails, naming it. "off"
	// removes FluxVM's own XDP program where an earlier start attached it.
	XDPMode bpf.XDPMode `toml:"xdp_mode"`
	// XDPEgressInterfaces are interfaces, besides the north-south ones
	// (which take XDP frames once the XDP program is on them), that the
	// XDP program may send translated packets to: each must take XDP
	// frames (a physical NIC whose driver implements XDP transmit, or a
	// veth whose peer runs an XDP program). A route out of any other
	// interface leaves the packet to TC (xdp_pass_egress), since a device
	// that refuses XDP frames drops them silently. Valid, unique interface
	// names; only with xdp_mode other than off. Default none.
	XDPEgressInterfaces []string `toml:"xdp_egress_interfaces"`
	// SNATAddress is the source address of north-south NAT, so that
	// backend replies return through this node: IPv4 or IPv6. With
	// SNATAddressV6 set it must be the IPv4 one. Optional (north-south
	// NAT of a VIP needs an SNAT address of the VIP's family); a unicast
	// address without a zone, not loopback or link-local. Backends must
	// route it back to this node; prefer an address the node does not use
	// for its own connections (see docs/operations.md).
	SNATAddress netip.Addr `toml:"snat_address"`
	// SNATAddressV6 is the IPv6 SNAT address of a node that SNATs both
	// families (snat_address then holds the IPv4 one). Optional; IPv6
	// only, with the rules of snat_address.
	SNATAddressV6 netip.Addr `toml:"snat_address_v6"`
	// AdvertiseSNAT lists the node's SNAT addresses in the advertisement
	// snapshot as advertised (kind "snat"), beside the VIPs, so that the
	// routing adapters announce them and backends' replies find the node
	// through the same BGP sessions; and the SNAT addresses of gone edges
	// of its group that it took over (SetSNATPeers, kind "snat-peer").
	// Default false: the entries are listed withdrawn
	// ("advertise_snat=false"), and the SNAT addresses are routed by other
	// means. Needs snat_address or snat_address_v6.
	AdvertiseSNAT bool `toml:"advertise_snat"`
	// SNATPortMin and SNATPortMax are the source ports north-south SNAT
	// allocates from, inclusive. Defaults DefaultSNATPortMin (61000) and
	// DefaultSNATPortMax (65535), outside Linux's default ephemeral range
	// 32768..60999; each MinSNATPort..MaxSNATPort (1024..65535), min <=
	// max. A new flow tries up to bpf.SNATTries ports of the range (its
	// own source port first when it lies in the range) and drops
	// (snat_failed) when all are held by other mappings to its backend.
	SNATPortMin int `toml:"snat_port_min"`
	SNATPortMax int `toml:"snat_port_max"`
	// CgroupConnect is the master switch of socket load balancing: the
	// cgroup socket hooks (connect4/6, sendmsg4/6, recvmsg4/6,
	// getpeername4/6) on the cgroup v2 directory CgroupPath, so that
	// processes of the node in that cgroup (and below it) reach VIPs with
	// their sockets connected straight to a backend, with no per-packet
	// NAT (see docs/operations.md, "Socket load balancing"). Default
	// false. True needs cgroup v2: a host with cgroup v1 only is refused
	// at start. False removes FluxVM's own socket hooks where an earlier
	// start attached them.
	CgroupConnect bool `toml:"cgroup_connect"`
	// CgroupPath is the cgroup v2 directory the socket hooks attach to,
	// which serves every process in it and below it. Empty (the default)
	// means the root of the node's cgroup v2 hierarchy, found from the
	// mount table (e.g. /sys/fs/cgroup, or /sys/fs/cgroup/unified on a
	// hybrid host): every process of the node. Absolute; only with
	// cgroup_connect. A path that is not a cgroup v2 directory is refused
	// at start.
	CgroupPath string `toml:"cgroup_path"`
	// EDTEnabled enables per-service EDT pacing: a service's
	// max_egress_mbps is refused without it (ErrPrerequisite). The
	// datapath stamps each paced reply with its departure time
	// (skb->tstamp, fluxvm_edt); an fq qdisc on the interface it leaves
	// by holds it until then, and without fq the horizon polices the
	// rate instead (see docs/operations.md, "EDT pacing"). Default false.
	EDTEnabled bool `toml:"edt_enabled"`
	// EDTHorizon is how far ahead of now a paced service's departures
	// may lie: with fq, the longest a packet waits in the qdisc; without
	// it, the burst a service may send above its rate. A packet beyond it
	// is dropped (drop reason edt_horizon). Default DefaultEDTHorizon
	// (250ms), range bpf.MinEDTHorizon..bpf.MaxEDTHorizon (1ms..10s).
	EDTHorizon Duration `toml:"edt_horizon"`
	// EDTManageFQ makes FluxVM install the fq qdisc as the root qdisc of
	// each of EDTInterfaces at start, where the root is the kernel's
	// default (a multi-queue device's default mq: fq under each of its
	// classes, one per TX queue). It stays at stop, like the rest of the
	// datapath, and the next start adopts it; a start that no longer
	// lists the interface (or without edt_manage_fq) deletes it, and so
	// does cleanup, so that the kernel restores its default. A root qdisc
	// an operator configured is never replaced (start fails, naming it).
	// Needs edt_enabled and edt_interfaces. Default false.
	EDTManageFQ bool `toml:"edt_manage_fq"`
	// EDTInterfaces are the interfaces whose root qdisc edt_manage_fq
	// manages: valid, unique interface names, usually the north-south
	// uplinks and VM edges paced replies leave by. Only with
	// edt_manage_fq. Default none.
	EDTInterfaces []string `toml:"edt_interfaces"`
	// EDTHorizonFallback keeps the node starting when fq cannot be
	// installed because the kernel has no sch_fq (CONFIG_NET_SCH_FQ):
	// the interface runs in horizon-policing mode, and the status says
	// why. Without it such a start fails (ErrNoFQ). Only with
	// edt_manage_fq. Default false.
	EDTHorizonFallback bool `toml:"edt_horizon_fallback"`
}

// DefaultConfig returns the configuration with every default applied. It
// is valid as it is: east-west Maglev on tier M, no interfaces yet, no
// SNAT address, SNAT ports 61000..65535.
func DefaultConfig() Config {
	return Config{
		MapTier:               bpf.DefaultTier.String(),
		XDPMode:               bpf.XDPOff,
		PinRoot:               bpf.DefaultPinRoot,
		CatalogPath:           DefaultCatalogPath,
		AdvertisementsPath:    advert.DefaultPath,
		HAInterval:            Duration{Duration: DefaultHAInterval},
		PressureSoftPercent:   DefaultPressureSoftPercent,
		PressureHardPercent:   DefaultPressureHardPercent,
		PressureInterval:      Duration{Duration: DefaultPressureInterval},
		ConntrackGCInterval:   Duration{Duration: DefaultConntrackGCInterval},
		TCPSynTimeout:         Duration{Duration: time.Duration(bpf.DefaultTimeoutTCPSyn) * time.Second},
		TCPEstablishedTimeout: Duration{Duration: time.Duration(bpf.DefaultTimeoutTCPEstablished) * time.Second},
		TCPFinTimeout:         Duration{Duration: time.Duration(bpf.DefaultTimeoutTCPFin) * time.Second},
		TCPRstTimeout:         Duration{Duration: time.Duration(bpf.DefaultTimeoutTCPRst) * time.Second},
		UDPTimeout:            Duration{Duration: time.Duration(bpf.DefaultTimeoutUDP) * time.Second},
		SNATPortMin:           DefaultSNATPortMin,
		SNATPortMax:           DefaultSNATPortMax,
		EDTHorizon:            Duration{Duration: DefaultEDTHorizon},
	}
}
