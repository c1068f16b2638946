package fluxvm

import (
	"errors"
	"net/netip"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/ha"
)

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
	c := Options{NorthSouth: ns}.settings()
	return c.checkNorthSouth()
}

// settings is o's node settings as a Config, so that the rules written
// once for the configuration (SNAT addresses, the node for validation)
// serve Options too. Only the north-south, EDT and socket LB fields are
// set.
func (o Options) settings() *Config {
	return &Config{
		NorthSouthInterfaces: o.NorthSouth.Interfaces,
		SNATAddress:          o.NorthSouth.SNATAddress,
		SNATAddressV6:        o.NorthSouth.SNATAddressV6,
		SNATPortMin:          o.NorthSouth.SNATPortMin,
		SNATPortMax:          o.NorthSouth.SNATPortMax,
		XDPMode:              o.NorthSouth.XDPMode,
		XDPEgressInterfaces:  o.NorthSouth.XDPEgress,
		EDTEnabled:           o.EDTEnabled,
		EDTHorizon:           Duration{o.edtHorizon()},
		EDTManageFQ:          o.EDTManageFQ,
		EDTInterfaces:        o.EDTInterfaces,
		EDTHorizonFallback:   o.EDTHorizonFallback,
		CgroupConnect:        o.CgroupConnect,
		CgroupPath:           o.CgroupPath,
	}
}

// checkEDT checks the EDT settings with the configuration's rules
// (edt_horizon, edt_interfaces, edt_manage_fq, edt_horizon_fallback).
func (o Options) checkEDT() error {
	var errs []error
	o.settings().validateEDT(func(category error, k, format string, args ...any) {
		errs = append(errs, verr(category, configKey(k), format, args...))
	})
	return errors.Join(errs...)
}

// edtHorizon is EDTHorizon, or DefaultEDTHorizon when it is 0.
func (o Options) edtHorizon() time.Duration {
	if o.EDTHorizon == 0 {
		return DefaultEDTHorizon
	}
	return o.EDTHorizon
}

// OptionsFrom turns a validated configuration into dataplane options. The
// caller may still set InNamespace and Logger.
func OptionsFrom(cfg Config) Options {
	opts := Options{
		NorthSouth: NorthSouth{
			Interfaces:  append([]string(nil), cfg.NorthSouthInterfaces...),
			SNATAddress: cfg.SNATAddress, SNATAddressV6: cfg.SNATAddressV6,
			SNATPortMin: cfg.SNATPortMin, SNATPortMax: cfg.SNATPortMax,
			XDPMode:   cfg.XDPMode,
			XDPEgress: append([]string(nil), cfg.XDPEgressInterfaces...),
		},
		EDTEnabled:         cfg.EDTEnabled,
		EDTHorizon:         cfg.EDTHorizon.Duration,
		EDTManageFQ:        cfg.EDTManageFQ,
		EDTInterfaces:      append([]string(nil), cfg.EDTInterfaces...),
		EDTHorizonFallback: cfg.EDTHorizonFallback,
		CgroupConnect:      cfg.CgroupConnect,
		CgroupPath:         cfg.CgroupPath,
		Loader:             cfg.LoaderOptions(),
		CatalogPath:        cfg.CatalogPath,
		// Always set by a validated configuration: the daemon publishes
		// the advertisement file.
		AdvertisementsPath:  cfg.AdvertisementsPath,
		NodeName:            cfg.NodeName,
		HealthConcurrency:   cfg.HealthCheckConcurrency,
		GCInterval:          cfg.ConntrackGCInterval.Duration,
		Timeouts:            cfg.ConntrackTimeouts(),
		MaglevSeed:          cfg.MaglevSeed,
		FlowSampleRate:      cfg.FlowSampleRate,
		PressureSoftPercent: cfg.PressureSoftPercent,
		PressureHardPercent: cfg.PressureHardPercent,
		PressureInterval:    cfg.PressureInterval.Duration,
		HA: HAOptions{
			Epoch: ha.Epoch(cfg.HAEpoch), Interval: cfg.HAInterval.Duration, MaxOps: cfg.HAJournalMaxOps,
		},
	}
	opts.Interfaces = append(opts.Interfaces, cfg.VMEdgeInterfaces...)
	return opts
}
