package fluxvm

import (
	"log/slog"
	"net/netip"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
)

// Options configure a Dataplane. They are the one source of truth for a
// node's settings: the daemon's TOML Config only decodes into them
// (OptionsFrom), and the rules of every setting are written once, here
// (Validate; Config.Validate applies the same rules, naming the TOML
// keys, and adds only what a file must state).
//
// Every zero value means something, said on each field: "the default"
// (the value WithDefaults fills in), or "off" for the features a node
// opts into. Options{} is a working node with everything optional off:
// east-west Maglev at the loader's default tier, no interfaces yet, and
// the catalog kept in memory only, so that an embedder that keeps its
// own catalog writes nothing to disk. The daemon's configuration differs
// there: DefaultConfig's catalog_path is DefaultCatalogPath, which
// OptionsFrom carries into CatalogPath, as it does advertisements_path.
//
// The fields of one feature are grouped in a sub-struct (NorthSouth,
// EDT, Pressure, SocketLB, HA) named as the configuration names them:
// Options.EDT.ManageFQ is edt_manage_fq, Options.HA.JournalMaxOps
// ha_journal_max_ops, Options.ConntrackGCInterval conntrack_gc_interval.
// The flat fields of earlier releases (EDTEnabled, GCInterval,
// Interfaces, ...) still work for one release: Open carries each into
// its new place when that is zero, and refuses the two set to different
// values (ErrConflict). docs/upgrading.md lists them.
type Options struct {
	// Loader configures the BPF loader (pin root, tier, object dir,
	// attach mode, flow-hash seed: see bpf.Options, whose zero values are
	// its defaults).
	Loader bpf.Options
	// CatalogPath is catalog_path, where the node-local catalog is kept
	// (a snapshot and its journal); empty keeps it in memory only.
	CatalogPath string
	// AdvertisementsPath is advertisements_path, the file the VIP
	// advertisement snapshot is published to (atomically; see package
	// advert and docs/advertisements.md). Empty keeps the
	// advertisements in memory only: Advertisements() and GET
	// /v1/network/services/advertisements still report them, with a
	// generation of their own, but no file is written, so no routing
	// adapter on the node can follow them.
	AdvertisementsPath string
	// NodeName is node_name, the node field of the advertisement
	// snapshot; empty: none.
	NodeName string
	// VMEdgeInterfaces are vm_edge_interfaces, the VM-edge interfaces
	// attached when the dataplane opens (NorthSouth.Interfaces are
	// attached too); nil: none, attach them with AddInterface.
	VMEdgeInterfaces []VMEdgeInterface
	// NorthSouth is the node's north-south edge: its uplinks, attached at
	// Open, and the SNAT addresses and port range written to the
	// datapath. The zero value: no north-south edge. Validation of
	// north-south services depends on it.
	NorthSouth NorthSouth
	// ConntrackGCInterval is conntrack_gc_interval, the conntrack GC
	// period: 0 means DefaultConntrackGCInterval, and a negative value
	// turns the timer off (GC then runs on demand only). The timer's
	// period adapts around it (an eighth of it, at least
	// MinConntrackGCInterval, up to twice it), and its next GC is due one
	// period after the last GC began, whoever ran it: the timer, GC, a
	// pressure round, or an earlier process on the same pins
	// (bpf.GCMark), so restarts do not postpone it.
	ConntrackGCInterval time.Duration
	// Timeouts are the conntrack timeouts (tcp_syn_timeout, ...); the
	// zero value means conntrack.DefaultTimeouts, any other must set
	// every one (conntrack.Timeouts.Validate).
	Timeouts conntrack.Timeouts
	// MaglevSeed is maglev_seed, the seed of the Maglev tables
	// (maglev.Config.Seed); 0 is a seed like any other. It must be the
	// same on every node that should compute the same tables (an HA
	// pair), as must Loader.HashSeed. Open rebuilds every table with it,
	// so a change takes effect at Open and moves only new flows:
	// established ones keep their backends through conntrack. Both seeds
	// are in Status.Seeds.
	MaglevSeed uint64
	// FlowSampleRate is flow_sample_rate: 0 records no flows (off); N
	// gives 1 in N new flows a FluxScope record (Flows), and client
	// packets dropped are recorded within the datapath's node-wide budget
	// (64 at once, refilled at 64 a second, shared by every CPU). At most
	// MaxFlowSampleRate. Open writes it to the datapath's meta map every
	// time, so a restart, a generation reload or a tier change (which
	// recreate the maps) keeps it, and a change takes effect at the next
	// Open.
	FlowSampleRate uint32
	// HealthCheckConcurrency is health_check_concurrency: how many health
	// checks (TCP connects, see Service.HealthCheck) run at once across
	// all services; 0 means health.DefaultConcurrency (32), at most
	// MaxHealthCheckConcurrency.
	HealthCheckConcurrency int
	// EDT is egress pacing (edt_*); the zero value: off.
	EDT EDTOptions
	// Pressure is the map pressure controller (pressure_*); the zero
	// value: on, with the default thresholds and period.
	Pressure PressureOptions
	// SocketLB is socket load balancing (cgroup_connect, cgroup_path);
	// the zero value: off.
	SocketLB SocketLBOptions
	// HA configures flow-state replication to a standby edge (ha_*); the
	// zero value leaves it off.
	HA HAOptions
	// InNamespace, when set, runs interface operations (attach, detach,
	// lookups by name) inside the node's network namespace. nil: the
	// calling thread's namespace.
	InNamespace func(func() error) error
	// Logger receives operational messages; nil: slog.Default().
	Logger *slog.Logger
	// TracerProvider, when set, receives a span for each piece of the
	// dataplane's control-plane work: ApplyService, DeleteService, the
	// catalog's restore at Open, every GC round (timer or on demand) and
	// ReconcileHealth (the Span* and Attr* constants name them and what
	// they carry). A span is a child of the span in the caller's context,
	// so the REST API's request span (api.Options.TracerProvider) holds
	// the apply it asked for. nil: no spans (a no-op provider). The
	// dataplane never shuts the provider down: its owner does, after
	// Close.
	TracerProvider trace.TracerProvider

	// Deprecated: use EDT.Enabled.
	EDTEnabled bool
	// Deprecated: use EDT.Horizon.
	EDTHorizon time.Duration
	// Deprecated: use EDT.ManageFQ.
	EDTManageFQ bool
	// Deprecated: use EDT.Interfaces.
	EDTInterfaces []string
	// Deprecated: use EDT.HorizonFallback.
	EDTHorizonFallback bool
	// Deprecated: use Pressure.SoftPercent.
	PressureSoftPercent int
	// Deprecated: use Pressure.HardPercent.
	PressureHardPercent int
	// Deprecated: use Pressure.Interval.
	PressureInterval time.Duration
	// Deprecated: use SocketLB.CgroupConnect.
	CgroupConnect bool
	// Deprecated: use SocketLB.CgroupPath.
	CgroupPath string
	// Deprecated: use ConntrackGCInterval.
	GCInterval time.Duration
	// Deprecated: use VMEdgeInterfaces.
	Interfaces []VMEdgeInterface
	// Deprecated: use HealthCheckConcurrency.
	HealthConcurrency int

	// Tests: sockDestroy replaces the datapath's DestroyStaleUDPSockets
	// in the destroy worker, and sockDestroyEvery its period (0:
	// DefaultSocketDestroyInterval; negative: no timer).
	sockDestroy      func() (int, error)
	sockDestroyEvery time.Duration
}

// EDTOptions are the EDT pacing settings (edt_enabled, edt_horizon,
// edt_manage_fq, edt_interfaces, edt_horizon_fallback). The zero value:
// pacing off, services asking for it refused.
type EDTOptions struct {
	// Enabled allows services to ask for egress pacing
	// (Service.MaxEgressMbps); false refuses them (ErrPrerequisite) and
	// leaves EDT out of the loaded programs.
	Enabled bool
	// Horizon is edt_horizon: 0 means DefaultEDTHorizon, otherwise
	// bpf.MinEDTHorizon..bpf.MaxEDTHorizon.
	Horizon time.Duration
	// ManageFQ, Interfaces and HorizonFallback are edt_manage_fq,
	// edt_interfaces and edt_horizon_fallback: Open installs fq as the
	// root qdisc of each of Interfaces whose root is the kernel's default
	// (on a multi-queue device, under each class of an mq); Close keeps
	// it, with the rest of the datapath, the next Open adopts it or
	// removes it from interfaces no longer listed, and Cleanup deletes it
	// (edtfq.go). ManageFQ needs Enabled and Interfaces; Interfaces and
	// HorizonFallback need ManageFQ. false/nil: fq is not managed.
	ManageFQ        bool
	Interfaces      []string
	HorizonFallback bool
}

// PressureOptions are the map pressure controller's settings
// (pressure_soft_percent, pressure_hard_percent, pressure_interval). The
// zero value runs it with the defaults.
type PressureOptions struct {
	// SoftPercent and HardPercent are the thresholds: 0 takes
	// DefaultPressureSoftPercent and DefaultPressureHardPercent;
	// otherwise 1..100, soft below hard.
	SoftPercent, HardPercent int
	// Interval is how often the controller reads the levels: 0 means
	// DefaultPressureInterval, or off when ConntrackGCInterval is
	// negative; negative: off (ReconcilePressure only).
	Interval time.Duration
}

// SocketLBOptions are socket load balancing's settings (cgroup_connect,
// cgroup_path). The zero value: off.
type SocketLBOptions struct {
	// CgroupConnect turns socket load balancing on: Open attaches the
	// socket hooks to the cgroup v2 directory CgroupPath with links
	// pinned under the pin root, and a background worker terminates
	// connected UDP sockets whose backend can no longer serve them
	// (socklb.go). False removes our socket hooks left by an earlier
	// start. Status.SocketLB reports both.
	CgroupConnect bool
	// CgroupPath is cgroup_path: absolute, only with CgroupConnect;
	// empty: the root of the cgroup v2 hierarchy (every process of the
	// node).
	CgroupPath string
}

// NorthSouth is the node's north-south edge, as Options gives it: the
// uplinks (ns_in and ns_out are attached to each at Open) and the SNAT
// settings north-south NAT needs. The fields mean what the configuration
// keys of the same names mean (north_south_interfaces, snat_address,
// snat_address_v6, snat_port_min, snat_port_max); a port range left 0..0
// takes the defaults (DefaultSNATPortMin..DefaultSNATPortMax). XDPMode
// is xdp_mode (empty means off), XDPEgress xdp_egress_interfaces,
// AdvertiseSNAT advertise_snat.
type NorthSouth struct {
	Interfaces                 []string
	SNATAddress, SNATAddressV6 netip.Addr
	SNATPortMin, SNATPortMax   int
	XDPMode                    bpf.XDPMode
	XDPEgress                  []string
	AdvertiseSNAT              bool
}

// Validate checks the SNAT settings and the XDP mode with the
// configuration's rules.
func (ns NorthSouth) Validate() error {
	return Options{NorthSouth: ns}.check(optionsNames, checkNorthSouth)
}
