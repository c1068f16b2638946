package fluxvm

import (
	"log/slog"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/health"
)

// Options' defaults, the deprecated fields of one release, and the
// conversion from a configuration.

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

func (o Options) settings() *Config {
	return &Config{
		NorthSouthInterfaces: o.NorthSouth.Interfaces,
		SNATAddress:          o.NorthSouth.SNATAddress,
		SNATAddressV6:        o.NorthSouth.SNATAddressV6,
		SNATPortMin:          o.NorthSouth.SNATPortMin,
		SNATPortMax:          o.NorthSouth.SNATPortMax,
		XDPMode:              o.NorthSouth.XDPMode,
		XDPEgressInterfaces:  o.NorthSouth.XDPEgress,
		AdvertiseSNAT:        o.NorthSouth.AdvertiseSNAT,
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
			XDPMode:       cfg.XDPMode,
			XDPEgress:     append([]string(nil), cfg.XDPEgressInterfaces...),
			AdvertiseSNAT: cfg.AdvertiseSNAT,
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
			Group: cfg.HAGroup,
		},
	}
}
