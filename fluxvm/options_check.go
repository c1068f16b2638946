package fluxvm

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/health"
)

// The rules of every setting, written once (see Options).

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
	sAdvertiseSNAT      = setting{"NorthSouth.AdvertiseSNAT", "advertise_snat"}
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
	sHAGroup            = setting{"HA.Group", "ha_group"}
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
	if ns.AdvertiseSNAT && !ns.SNATAddress.IsValid() && !ns.SNATAddressV6.IsValid() {
		bad(ErrPrerequisite, sAdvertiseSNAT, "set, but the node has no SNAT address to advertise: set %s", name(sSNATAddress))
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
	if o.HA.Group && o.HA.Epoch == 0 {
		bad(ErrPrerequisite, sHAGroup, "a group replicates flows: set %s", name(sHAEpoch))
	}
	if o.HA.Group && o.NodeName == "" {
		bad(ErrPrerequisite, sHAGroup, "the edges of a group tell their data apart by node name: set %s", name(sNodeName))
	}
}

// settings is o's north-south settings as a Config, for the helpers
// written on Config that Open uses too (SNATConfig, Node).
