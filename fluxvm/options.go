package fluxvm

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/health"
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
// is xdp_mode (empty means off), XDPEgress xdp_egress_interfaces.
type NorthSouth struct {
	Interfaces                 []string
	SNATAddress, SNATAddressV6 netip.Addr
	SNATPortMin, SNATPortMax   int
	XDPMode                    bpf.XDPMode
	XDPEgress                  []string
}

// Validate checks the SNAT settings and the XDP mode with the
// configuration's rules.
func (ns NorthSouth) Validate() error {
	return Options{NorthSouth: ns}.check(optionsNames, checkNorthSouth)
}

// WithDefaults returns o with its deprecated fields carried into their
// new places (where those are zero) and every zero that means "the
// default" replaced by the default, so that a reader of the result
// finds each setting in force in one field. Open works on it.
func (o Options) WithDefaults() Options {
	o = o.carried()
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.InNamespace == nil {
		o.InNamespace = func(f func() error) error { return f() }
	}
	if o.ConntrackGCInterval == 0 {
		o.ConntrackGCInterval = DefaultConntrackGCInterval
	}
	if o.Timeouts == (conntrack.Timeouts{}) {
		o.Timeouts = conntrack.DefaultTimeouts()
	}
	if o.HealthCheckConcurrency == 0 {
		o.HealthCheckConcurrency = health.DefaultConcurrency
	}
	if o.NorthSouth.SNATPortMin == 0 && o.NorthSouth.SNATPortMax == 0 {
		o.NorthSouth.SNATPortMin, o.NorthSouth.SNATPortMax = DefaultSNATPortMin, DefaultSNATPortMax
	}
	if o.NorthSouth.XDPMode == "" {
		o.NorthSouth.XDPMode = bpf.XDPOff
	}
	if o.EDT.Horizon == 0 {
		o.EDT.Horizon = DefaultEDTHorizon
	}
	if o.Pressure.SoftPercent == 0 {
		o.Pressure.SoftPercent = DefaultPressureSoftPercent
	}
	if o.Pressure.HardPercent == 0 {
		o.Pressure.HardPercent = DefaultPressureHardPercent
	}
	if o.Pressure.Interval == 0 {
		// GC on demand only leaves the controller's timer off too.
		o.Pressure.Interval = DefaultPressureInterval
		if o.ConntrackGCInterval < 0 {
			o.Pressure.Interval = -1
		}
	}
	if o.HA.Interval == 0 {
		o.HA.Interval = DefaultHAInterval
	}
	if o.HA.JournalMaxOps == 0 {
		o.HA.JournalMaxOps = ha.DefaultMaxOps
	}
	return o
}

// carried is o with each deprecated field moved into its new place when
// that is zero, and cleared (Validate has refused the two set apart).
func (o Options) carried() Options {
	carry(&o.EDT.Enabled, &o.EDTEnabled)
	carry(&o.EDT.Horizon, &o.EDTHorizon)
	carry(&o.EDT.ManageFQ, &o.EDTManageFQ)
	carrySlice(&o.EDT.Interfaces, &o.EDTInterfaces)
	carry(&o.EDT.HorizonFallback, &o.EDTHorizonFallback)
	carry(&o.Pressure.SoftPercent, &o.PressureSoftPercent)
	carry(&o.Pressure.HardPercent, &o.PressureHardPercent)
	carry(&o.Pressure.Interval, &o.PressureInterval)
	carry(&o.SocketLB.CgroupConnect, &o.CgroupConnect)
	carry(&o.SocketLB.CgroupPath, &o.CgroupPath)
	carry(&o.ConntrackGCInterval, &o.GCInterval)
	carrySlice(&o.VMEdgeInterfaces, &o.Interfaces)
	carry(&o.HealthCheckConcurrency, &o.HealthConcurrency)
	carry(&o.HA.JournalMaxOps, &o.HA.MaxOps)
	return o
}

func carry[T comparable](to, from *T) {
	var zero T
	if *to == zero {
		*to = *from
	}
	*from = zero
}

func carrySlice[T any](to, from *[]T) {
	if len(*to) == 0 {
		*to = *from
	}
	*from = nil
}

// deprecatedConflicts reports each deprecated field of o set to a value
// other than that of its new place, when both are set.
func (o Options) deprecatedConflicts(bad badFunc) {
	clash := func(set bool, s setting, old string) {
		if set {
			bad(ErrConflict, s, "set, and so is the deprecated %s, to another value: set %s only", old, optionsNames(s))
		}
	}
	clash(differ(o.EDT.Enabled, o.EDTEnabled), sEDTEnabled, "EDTEnabled")
	clash(differ(o.EDT.Horizon, o.EDTHorizon), sEDTHorizon, "EDTHorizon")
	clash(differ(o.EDT.ManageFQ, o.EDTManageFQ), sEDTManageFQ, "EDTManageFQ")
	clash(differSlice(o.EDT.Interfaces, o.EDTInterfaces), sEDTInterfaces, "EDTInterfaces")
	clash(differ(o.EDT.HorizonFallback, o.EDTHorizonFallback), sEDTHorizonFallback, "EDTHorizonFallback")
	clash(differ(o.Pressure.SoftPercent, o.PressureSoftPercent), sPressureSoft, "PressureSoftPercent")
	clash(differ(o.Pressure.HardPercent, o.PressureHardPercent), sPressureHard, "PressureHardPercent")
	clash(differ(o.Pressure.Interval, o.PressureInterval), sPressureInterval, "PressureInterval")
	clash(differ(o.SocketLB.CgroupConnect, o.CgroupConnect), sCgroupConnect, "CgroupConnect")
	clash(differ(o.SocketLB.CgroupPath, o.CgroupPath), sCgroupPath, "CgroupPath")
	clash(differ(o.ConntrackGCInterval, o.GCInterval), sGCInterval, "GCInterval")
	clash(differSlice(o.VMEdgeInterfaces, o.Interfaces), sVMEdgeInterfaces, "Interfaces")
	clash(differ(o.HealthCheckConcurrency, o.HealthConcurrency), sHealthConcurrency, "HealthConcurrency")
	clash(differ(o.HA.JournalMaxOps, o.HA.MaxOps), sHAJournalMaxOps, "HA.MaxOps")
}

// differ: both set, to different values.
func differ[T comparable](a, b T) bool {
	var zero T
	return a != zero && b != zero && a != b
}

func differSlice[T comparable](a, b []T) bool {
	if len(a) == 0 || len(b) == 0 || len(a) != len(b) {
		return len(a) != 0 && len(b) != 0
	}
	for i := range a {
		if a[i] != b[i] {
			return true
		}
	}
	return false
}

// Validate checks every setting of o with the rules of the
// configuration key it stands for, zeros meaning what each field says,
// and returns nil or all the problems found, joined: each a
// *ValidationError whose Field is the Options field ("EDT.Horizon",
// "NorthSouth.SNATAddress"). It reads no files: whether a cgroup path
// is a cgroup v2 directory, or an interface exists, Open finds out.
func (o Options) Validate() error {
	if err := o.check(optionsNames, checkAll); err != nil {
		return fmt.Errorf("fluxvm: options: %w", err)
	}
	return nil
}

// A setting names one setting both ways: as an Options field and as a
// configuration key, so that one rule reports either (check).
type setting struct{ opt, key string }

var (
	sNSInterfaces       = setting{"NorthSouth.Interfaces", "north_south_interfaces"}
	sSNATAddress        = setting{"NorthSouth.SNATAddress", "snat_address"}
	sSNATAddressV6      = setting{"NorthSouth.SNATAddressV6", "snat_address_v6"}
	sSNATPortMin        = setting{"NorthSouth.SNATPortMin", "snat_port_min"}
	sSNATPortMax        = setting{"NorthSouth.SNATPortMax", "snat_port_max"}
	sXDPMode            = setting{"NorthSouth.XDPMode", "xdp_mode"}
	sXDPEgress          = setting{"NorthSouth.XDPEgress", "xdp_egress_interfaces"}
	sEDTEnabled         = setting{"EDT.Enabled", "edt_enabled"}
	sEDTHorizon         = setting{"EDT.Horizon", "edt_horizon"}
	sEDTManageFQ        = setting{"EDT.ManageFQ", "edt_manage_fq"}
	sEDTInterfaces      = setting{"EDT.Interfaces", "edt_interfaces"}
	sEDTHorizonFallback = setting{"EDT.HorizonFallback", "edt_horizon_fallback"}
	sPressureSoft       = setting{"Pressure.SoftPercent", "pressure_soft_percent"}
	sPressureHard       = setting{"Pressure.HardPercent", "pressure_hard_percent"}
	sPressureInterval   = setting{"Pressure.Interval", "pressure_interval"}
	sCgroupConnect      = setting{"SocketLB.CgroupConnect", "cgroup_connect"}
	sCgroupPath         = setting{"SocketLB.CgroupPath", "cgroup_path"}
	sGCInterval         = setting{"ConntrackGCInterval", "conntrack_gc_interval"}
	sVMEdgeInterfaces   = setting{"VMEdgeInterfaces", "vm_edge_interfaces"}
	sHealthConcurrency  = setting{"HealthCheckConcurrency", "health_check_concurrency"}
	sFlowSampleRate     = setting{"FlowSampleRate", "flow_sample_rate"}
	sNodeName           = setting{"NodeName", "node_name"}
	sTimeouts           = setting{"Timeouts", "tcp_syn_timeout"}
	sHAEpoch            = setting{"HA.Epoch", "ha_epoch"}
	sHAInterval         = setting{"HA.Interval", "ha_interval"}
	sHAJournalMaxOps    = setting{"HA.JournalMaxOps", "ha_journal_max_ops"}
	sOmitFeatures       = setting{"Loader.OmitFeatures", "loader.omit_features"}
)

// at names element i of a list setting, or a field of it (opt and key:
// the field's name in Options and in the configuration).
func (s setting) at(i int, opt, key string) setting {
	return setting{fmt.Sprintf("%s[%d]%s", s.opt, i, opt), fmt.Sprintf("%s[%d]%s", s.key, i, key)}
}

// optionsNames names a setting as an Options field, configNames as the
// configuration's key below ConfigTable.
func optionsNames(s setting) string { return s.opt }
func configNames(s setting) string  { return s.key }

// badFunc reports a problem with a setting (an index, "[2]", may follow
// it: at).
type badFunc func(category error, s setting, format string, args ...any)

// The groups of rules check runs: the north-south edge alone (what
// NorthSouth.Validate checks), every setting (Validate), or those a
// Config holds (Config.Validate, which checks each conntrack timeout
// key itself and has no deprecated fields nor loader features).
const (
	checkNorthSouth = iota
	checkAll
	checkConfig
)

// check runs the rules of o's settings, naming each setting in errors
// and messages as name does, and returns all the problems found, joined.
// Deprecated fields are checked where they are carried to.
func (o Options) check(name func(setting) string, which int) error {
	var errs []error
	bad := func(category error, s setting, format string, args ...any) {
		field := name(s)
		if name(s) == s.key {
			field = configKey(s.key)
		}
		errs = append(errs, verr(category, field, format, args...))
	}
	if which == checkAll {
		o.deprecatedConflicts(bad)
	}
	c := o.carried()
	c.checkNorthSouth(name, bad)
	if which == checkNorthSouth {
		return errors.Join(errs...)
	}
	c.checkInterfaces(name, bad)
	c.checkEDT(name, bad)
	c.checkHA(name, bad)
	if soft, hard := c.Pressure.SoftPercent, c.Pressure.HardPercent; soft != 0 || hard != 0 {
		if soft == 0 {
			soft = DefaultPressureSoftPercent
		}
		if hard == 0 {
			hard = DefaultPressureHardPercent
		}
		switch {
		case soft < 1 || soft > 100:
			bad(ErrInvalid, sPressureSoft, "%d is outside 1..100 (0: the default, %d)", soft, DefaultPressureSoftPercent)
		case hard < 1 || hard > 100:
			bad(ErrInvalid, sPressureHard, "%d is outside 1..100 (0: the default, %d)", hard, DefaultPressureHardPercent)
		case soft >= hard:
			bad(ErrConflict, sPressureSoft, "%d is not below %s (%d)", soft, name(sPressureHard), hard)
		}
	}
	if d := c.Pressure.Interval; d > 0 && (d < MinPressureInterval || d > MaxPressureInterval) {
		bad(ErrInvalid, sPressureInterval, "%v is outside %v..%v (0: the default, %v; negative: off)", d, MinPressureInterval, MaxPressureInterval, DefaultPressureInterval)
	}
	if n := c.HealthCheckConcurrency; n < 0 || n > MaxHealthCheckConcurrency {
		bad(ErrInvalid, sHealthConcurrency, "%d is outside 0..%d (0: the default, %d)", n, MaxHealthCheckConcurrency, health.DefaultConcurrency)
	}
	if n := c.FlowSampleRate; n > MaxFlowSampleRate {
		bad(ErrInvalid, sFlowSampleRate, "%d is outside 0..%d (0: off, N: 1 in N new flows)", n, MaxFlowSampleRate)
	}
	if why := nodeNameProblem(c.NodeName); why != "" {
		bad(ErrInvalid, sNodeName, "%s", why)
	}
	if which == checkConfig {
		return errors.Join(errs...)
	}
	if c.Timeouts != (conntrack.Timeouts{}) {
		if err := c.Timeouts.Validate(); err != nil {
			bad(ErrInvalid, sTimeouts, "%v", err)
		}
	}
	if clash := c.Loader.OmitFeatures & c.neededFeatures(); clash != 0 {
		bad(ErrInvalid, sOmitFeatures, "omits %s, which the options use (ha_epoch, flow_sample_rate, edt_enabled)", clash)
	}
	return errors.Join(errs...)
}

func (o Options) checkNorthSouth(name func(setting) string, bad badFunc) {
	ns := o.NorthSouth
	if ns.SNATAddress.IsValid() {
		if why := snatAddrProblem(ns.SNATAddress); why != "" {
			bad(ErrInvalid, sSNATAddress, "%s", why)
		} else if ns.SNATAddressV6.IsValid() && ns.SNATAddress.Is6() {
			bad(ErrConflict, sSNATAddress, "%s is IPv6, and so is %s (%s): with %[2]s set, %s is the IPv4 SNAT address",
				ns.SNATAddress, name(sSNATAddressV6), ns.SNATAddressV6, name(sSNATAddress))
		}
	}
	if ns.SNATAddressV6.IsValid() {
		if why := snatAddrProblem(ns.SNATAddressV6); why != "" {
			bad(ErrInvalid, sSNATAddressV6, "%s", why)
		} else if !ns.SNATAddressV6.Is6() {
			bad(ErrInvalid, sSNATAddressV6, "%s is not an IPv6 address; put the IPv4 SNAT address in %s", ns.SNATAddressV6, name(sSNATAddress))
		}
	}
	// A range left 0..0 takes the defaults.
	if ns.SNATPortMin != 0 || ns.SNATPortMax != 0 {
		minOK, maxOK := true, true
		for _, p := range []struct {
			s  setting
			v  int
			ok *bool
		}{{sSNATPortMin, ns.SNATPortMin, &minOK}, {sSNATPortMax, ns.SNATPortMax, &maxOK}} {
			if p.v < MinSNATPort || p.v > MaxSNATPort {
				bad(ErrInvalid, p.s, "%d is outside %d..%d", p.v, MinSNATPort, MaxSNATPort)
				*p.ok = false
			}
		}
		if minOK && maxOK && ns.SNATPortMin > ns.SNATPortMax {
			bad(ErrInvalid, sSNATPortMin, "%d is above %s (%d)", ns.SNATPortMin, name(sSNATPortMax), ns.SNATPortMax)
		}
	}
	switch ns.XDPMode {
	case "", bpf.XDPOff, bpf.XDPNative, bpf.XDPGeneric, bpf.XDPAuto:
	default:
		bad(ErrInvalid, sXDPMode, "%q is not an XDP mode (want %q, %q, %q or %q)", ns.XDPMode, bpf.XDPOff, bpf.XDPNative, bpf.XDPGeneric, bpf.XDPAuto)
	}
	seen := map[string]bool{}
	for _, n := range ns.XDPEgress {
		if why := ifnameProblem(n); why != "" {
			bad(ErrInvalid, sXDPEgress, "%q: %s", n, why)
		} else if seen[n] {
			bad(ErrInvalid, sXDPEgress, "%q is listed twice", n)
		}
		seen[n] = true
	}
	if len(ns.XDPEgress) > 0 && (ns.XDPMode == "" || ns.XDPMode == bpf.XDPOff) {
		bad(ErrInvalid, sXDPEgress, "set, but %s is off: set %[1]s too, or leave this empty", name(sXDPMode))
	}
	// Socket LB's rules go with the north-south ones: NorthSouth.Validate
	// has always checked the settings Open applies to the node's edge.
	o.checkSocketLB(name, bad)
}

// checkInterfaces checks the names of the interfaces Open attaches: the
// kernel's rules, each interface once, none both a VM edge and a
// north-south uplink.
func (o Options) checkInterfaces(name func(setting) string, bad badFunc) {
	names := make(map[string]string)
	use := func(s setting, n string) {
		if why := ifnameProblem(n); why != "" {
			bad(ErrInvalid, s, "%s", why)
		} else if prev, dup := names[n]; dup {
			bad(ErrConflict, s, "%q is already %s", n, prev)
		} else {
			names[n] = name(s)
		}
	}
	for i, ifc := range o.VMEdgeInterfaces {
		use(sVMEdgeInterfaces.at(i, ".Name", ".name"), ifc.Name)
		if why := vmIDProblem(ifc.VMID); why != "" {
			bad(ErrInvalid, sVMEdgeInterfaces.at(i, ".VMID", ".vm_id"), "%s", why)
		}
	}
	for i, n := range o.NorthSouth.Interfaces {
		use(sNSInterfaces.at(i, "", ""), n)
	}
}

func (o Options) checkSocketLB(name func(setting) string, bad badFunc) {
	if o.SocketLB.CgroupPath == "" {
		return
	}
	if !filepath.IsAbs(o.SocketLB.CgroupPath) {
		bad(ErrInvalid, sCgroupPath, "%q is not an absolute path", o.SocketLB.CgroupPath)
	}
	if !o.SocketLB.CgroupConnect {
		bad(ErrInvalid, sCgroupPath, "set, but %s is false: set %[1]s = true too, or leave this empty", name(sCgroupConnect))
	}
}

func (o Options) checkEDT(name func(setting) string, bad badFunc) {
	e := o.EDT
	if h := e.Horizon; h != 0 && (h < bpf.MinEDTHorizon || h > bpf.MaxEDTHorizon) {
		bad(ErrInvalid, sEDTHorizon, "%v is outside %v..%v", h, bpf.MinEDTHorizon, bpf.MaxEDTHorizon)
	}
	seen := map[string]int{}
	for i, n := range e.Interfaces {
		at := sEDTInterfaces.at(i, "", "")
		if why := ifnameProblem(n); why != "" {
			bad(ErrInvalid, at, "%s", why)
		} else if prev, dup := seen[n]; dup {
			bad(ErrConflict, at, "%q is already %s[%d]", n, name(sEDTInterfaces), prev)
		} else {
			seen[n] = i
		}
	}
	if e.ManageFQ {
		if !e.Enabled {
			bad(ErrPrerequisite, sEDTManageFQ, "requires %s = true", name(sEDTEnabled))
		}
		if len(e.Interfaces) == 0 {
			bad(ErrPrerequisite, sEDTManageFQ, "requires %s: the interfaces whose root qdisc FluxVM may manage", name(sEDTInterfaces))
		}
		return
	}
	if len(e.Interfaces) > 0 {
		bad(ErrPrerequisite, sEDTInterfaces, "set, but %s is false: set %[1]s = true too, or leave this empty", name(sEDTManageFQ))
	}
	if e.HorizonFallback {
		bad(ErrPrerequisite, sEDTHorizonFallback, "set, but %s is false: it only says what to do when fq cannot be installed", name(sEDTManageFQ))
	}
}

func (o Options) checkHA(name func(setting) string, bad badFunc) {
	if o.HA.Epoch != 0 && len(o.NorthSouth.Interfaces) == 0 {
		bad(ErrPrerequisite, sHAEpoch, "flow-state replication needs the north-south edge: set %s", name(sNSInterfaces))
	}
	if d := o.HA.Interval; d != 0 && (d < MinHAInterval || d > MaxHAInterval) {
		bad(ErrInvalid, sHAInterval, "%v is outside %v..%v (0: the default, %v)", d, MinHAInterval, MaxHAInterval, DefaultHAInterval)
	}
	if n := o.HA.JournalMaxOps; n < 0 || n > MaxHAJournalOps {
		bad(ErrInvalid, sHAJournalMaxOps, "%d is outside 0..%d (0: the default, %d)", n, MaxHAJournalOps, ha.DefaultMaxOps)
	}
}

// settings is o's north-south settings as a Config, for the helpers
// written on Config that Open uses too (SNATConfig, Node).
func (o Options) settings() *Config {
	return &Config{
		NorthSouthInterfaces: o.NorthSouth.Interfaces,
		SNATAddress:          o.NorthSouth.SNATAddress,
		SNATAddressV6:        o.NorthSouth.SNATAddressV6,
		SNATPortMin:          o.NorthSouth.SNATPortMin,
		SNATPortMax:          o.NorthSouth.SNATPortMax,
		XDPMode:              o.NorthSouth.XDPMode,
		XDPEgressInterfaces:  o.NorthSouth.XDPEgress,
		EDTEnabled:           o.EDT.Enabled,
		EDTHorizon:           Duration{Duration: o.edtHorizon()},
		EDTManageFQ:          o.EDT.ManageFQ,
		EDTInterfaces:        o.EDT.Interfaces,
		EDTHorizonFallback:   o.EDT.HorizonFallback,
		CgroupConnect:        o.SocketLB.CgroupConnect,
		CgroupPath:           o.SocketLB.CgroupPath,
	}
}

// edtHorizon is EDT.Horizon, or DefaultEDTHorizon when it is 0.
func (o Options) edtHorizon() time.Duration {
	if o.EDT.Horizon == 0 {
		return DefaultEDTHorizon
	}
	return o.EDT.Horizon
}

// OptionsFrom turns a configuration into dataplane options: every key
// into the field of the same name, and nothing else (the caller may
// still set InNamespace, Logger and TracerProvider). The configuration
// should have passed Validate, which applies Options' rules.
func OptionsFrom(cfg Config) Options {
	return Options{
		Loader:             cfg.LoaderOptions(),
		CatalogPath:        cfg.CatalogPath,
		AdvertisementsPath: cfg.AdvertisementsPath,
		NodeName:           cfg.NodeName,
		VMEdgeInterfaces:   append([]VMEdgeInterface(nil), cfg.VMEdgeInterfaces...),
		NorthSouth: NorthSouth{
			Interfaces:  append([]string(nil), cfg.NorthSouthInterfaces...),
			SNATAddress: cfg.SNATAddress, SNATAddressV6: cfg.SNATAddressV6,
			SNATPortMin: cfg.SNATPortMin, SNATPortMax: cfg.SNATPortMax,
			XDPMode:   cfg.XDPMode,
			XDPEgress: append([]string(nil), cfg.XDPEgressInterfaces...),
		},
		ConntrackGCInterval:    cfg.ConntrackGCInterval.Duration,
		Timeouts:               cfg.ConntrackTimeouts(),
		MaglevSeed:             cfg.MaglevSeed,
		FlowSampleRate:         cfg.FlowSampleRate,
		HealthCheckConcurrency: cfg.HealthCheckConcurrency,
		EDT: EDTOptions{
			Enabled: cfg.EDTEnabled, Horizon: cfg.EDTHorizon.Duration, ManageFQ: cfg.EDTManageFQ,
			Interfaces: append([]string(nil), cfg.EDTInterfaces...), HorizonFallback: cfg.EDTHorizonFallback,
		},
		Pressure: PressureOptions{
			SoftPercent: cfg.PressureSoftPercent, HardPercent: cfg.PressureHardPercent, Interval: cfg.PressureInterval.Duration,
		},
		SocketLB: SocketLBOptions{CgroupConnect: cfg.CgroupConnect, CgroupPath: cfg.CgroupPath},
		HA: HAOptions{
			Epoch: ha.Epoch(cfg.HAEpoch), Interval: cfg.HAInterval.Duration, JournalMaxOps: cfg.HAJournalMaxOps,
		},
	}
}
