package fluxvm

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/health"
)

// TestOptionsValidate: each rule of Options names the Options field it
// checks, with the error category of the configuration key it stands
// for; the same settings given as a configuration file are refused by
// the same rule, naming the key (one source of truth).
func TestOptionsValidate(t *testing.T) {
	up := NorthSouth{Interfaces: []string{"up0"}}
	for _, tc := range []struct {
		name  string
		opts  Options
		field string // Options' name
		key   string // the configuration's ("" when a file cannot say it)
		kind  error
		toml  string // the file's lines for the same settings
	}{
		{"edt horizon", Options{EDT: EDTOptions{Enabled: true, Horizon: time.Minute}}, "EDT.Horizon", "edt_horizon", ErrInvalid,
			"edt_enabled = true\nedt_horizon = \"1m\""},
		{"manage fq without edt", Options{EDT: EDTOptions{ManageFQ: true, Interfaces: []string{"a"}}}, "EDT.ManageFQ", "edt_manage_fq", ErrPrerequisite,
			"edt_manage_fq = true\nedt_interfaces = [\"a\"]"},
		{"edt interfaces twice", Options{EDT: EDTOptions{Enabled: true, ManageFQ: true, Interfaces: []string{"a", "a"}}}, "EDT.Interfaces[1]", "edt_interfaces[1]", ErrConflict,
			"edt_enabled = true\nedt_manage_fq = true\nedt_interfaces = [\"a\", \"a\"]"},
		{"pressure soft above hard", Options{Pressure: PressureOptions{SoftPercent: 90, HardPercent: 50}}, "Pressure.SoftPercent", "pressure_soft_percent", ErrConflict,
			"pressure_soft_percent = 90\npressure_hard_percent = 50"},
		{"pressure soft above the default hard", Options{Pressure: PressureOptions{SoftPercent: 99}}, "Pressure.SoftPercent", "pressure_soft_percent", ErrConflict,
			"pressure_soft_percent = 99"},
		{"pressure interval", Options{Pressure: PressureOptions{Interval: time.Millisecond}}, "Pressure.Interval", "pressure_interval", ErrInvalid,
			"pressure_interval = \"1ms\""},
		{"cgroup path without connect", Options{SocketLB: SocketLBOptions{CgroupPath: "/sys/fs/cgroup"}}, "SocketLB.CgroupPath", "cgroup_path", ErrInvalid,
			"cgroup_path = \"/sys/fs/cgroup\""},
		{"ha without north-south", Options{HA: HAOptions{Epoch: 1}}, "HA.Epoch", "ha_epoch", ErrPrerequisite, "ha_epoch = 1"},
		{"ha interval", Options{HA: HAOptions{Epoch: 1, Interval: time.Hour}, NorthSouth: up}, "HA.Interval", "ha_interval", ErrInvalid,
			"ha_epoch = 1\nnorth_south_interfaces = [\"up0\"]\nha_interval = \"1h\""},
		{"ha journal", Options{HA: HAOptions{JournalMaxOps: -1}}, "HA.JournalMaxOps", "ha_journal_max_ops", ErrInvalid, "ha_journal_max_ops = -1"},
		{"health concurrency", Options{HealthCheckConcurrency: MaxHealthCheckConcurrency + 1}, "HealthCheckConcurrency", "health_check_concurrency", ErrInvalid,
			"health_check_concurrency = 1025"},
		{"flow sample rate", Options{FlowSampleRate: MaxFlowSampleRate + 1}, "FlowSampleRate", "flow_sample_rate", ErrInvalid, "flow_sample_rate = 65537"},
		{"node name", Options{NodeName: "a b"}, "NodeName", "node_name", ErrInvalid, "node_name = \"a b\""},
		{"snat v6 of v4", Options{NorthSouth: NorthSouth{SNATAddressV6: netip.MustParseAddr("192.0.2.1")}}, "NorthSouth.SNATAddressV6", "snat_address_v6", ErrInvalid,
			"snat_address_v6 = \"192.0.2.1\""},
		{"snat ports", Options{NorthSouth: NorthSouth{SNATPortMin: 2000, SNATPortMax: 1500}}, "NorthSouth.SNATPortMin", "snat_port_min", ErrInvalid,
			"snat_port_min = 2000\nsnat_port_max = 1500"},
		{"xdp egress without xdp", Options{NorthSouth: NorthSouth{XDPEgress: []string{"e0"}}}, "NorthSouth.XDPEgress", "xdp_egress_interfaces", ErrInvalid,
			"xdp_egress_interfaces = [\"e0\"]"},
		{"vm edge name", Options{VMEdgeInterfaces: []VMEdgeInterface{{Name: "a/b", VMID: "vm"}}}, "VMEdgeInterfaces[0].Name", "vm_edge_interfaces[0].name", ErrInvalid,
			"vm_edge_interfaces = [{name = \"a/b\", vm_id = \"vm\"}]"},
		{"vm edge id", Options{VMEdgeInterfaces: []VMEdgeInterface{{Name: "tap0"}}}, "VMEdgeInterfaces[0].VMID", "vm_edge_interfaces[0].vm_id", ErrInvalid,
			"vm_edge_interfaces = [{name = \"tap0\", vm_id = \"\"}]"},
		{"uplink also a vm edge", Options{VMEdgeInterfaces: []VMEdgeInterface{{Name: "tap0", VMID: "vm"}}, NorthSouth: NorthSouth{Interfaces: []string{"tap0"}}},
			"NorthSouth.Interfaces[0]", "north_south_interfaces[0]", ErrConflict,
			"vm_edge_interfaces = [{name = \"tap0\", vm_id = \"vm\"}]\nnorth_south_interfaces = [\"tap0\"]"},
		{"timeouts partly set", Options{Timeouts: conntrack.Timeouts{UDP: time.Minute}}, "Timeouts", "", ErrInvalid, ""},
		{"omitted feature in use", Options{FlowSampleRate: 1, Loader: bpf.Options{OmitFeatures: bpf.FeatureFlowRecords}}, "Loader.OmitFeatures", "", ErrInvalid, ""},
		{"deprecated and new apart", Options{EDT: EDTOptions{Enabled: true, Horizon: time.Second}, EDTHorizon: 2 * time.Second}, "EDT.Horizon", "", ErrConflict, ""},
		{"deprecated invalid", Options{PressureSoftPercent: 101}, "Pressure.SoftPercent", "", ErrInvalid, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.opts.Validate()
			if !hasField(err, tc.field, tc.kind) {
				t.Errorf("Validate() = %v; want %v on %s", err, tc.kind, tc.field)
			}
			if tc.key == "" {
				return
			}
			_, err = ParseConfig([]byte("[" + ConfigTable + "]\n" + tc.toml + "\n"))
			if !hasField(err, configKey(tc.key), tc.kind) {
				t.Errorf("ParseConfig = %v; want %v on %s", err, tc.kind, tc.key)
			}
		})
	}
	// Every zero is valid: Options{} is a working node.
	if err := (Options{}).Validate(); err != nil {
		t.Errorf("Options{}.Validate() = %v", err)
	}
	if err := OptionsFrom(DefaultConfig()).Validate(); err != nil {
		t.Errorf("OptionsFrom(DefaultConfig()).Validate() = %v", err)
	}
}

func hasField(err error, field string, kind error) bool {
	if !errors.Is(err, kind) {
		return false
	}
	var ve *ValidationError
	for _, e := range flattenErrors(err) {
		if errors.As(e, &ve) && ve.Field == field && errors.Is(e, kind) {
			return true
		}
	}
	return false
}

// flattenErrors lists the leaves of a tree of joined and wrapped errors.
func flattenErrors(err error) []error {
	switch e := err.(type) {
	case nil:
		return nil
	case interface{ Unwrap() []error }:
		var out []error
		for _, c := range e.Unwrap() {
			out = append(out, flattenErrors(c)...)
		}
		return out
	}
	if u := errors.Unwrap(err); u != nil {
		if _, joined := u.(interface{ Unwrap() []error }); joined {
			return flattenErrors(u)
		}
	}
	return []error{err}
}

// TestOptionsWithDefaults: every zero that means "the default" becomes
// the default, what is set stays, and "off" stays off.
func TestOptionsWithDefaults(t *testing.T) {
	o := Options{}.WithDefaults()
	for _, c := range []struct {
		name     string
		got, def any
	}{
		{"ConntrackGCInterval", o.ConntrackGCInterval, DefaultConntrackGCInterval},
		{"Timeouts", o.Timeouts, conntrack.DefaultTimeouts()},
		{"HealthCheckConcurrency", o.HealthCheckConcurrency, health.DefaultConcurrency},
		{"NorthSouth.SNATPortMin", o.NorthSouth.SNATPortMin, DefaultSNATPortMin},
		{"NorthSouth.SNATPortMax", o.NorthSouth.SNATPortMax, DefaultSNATPortMax},
		{"NorthSouth.XDPMode", o.NorthSouth.XDPMode, bpf.XDPOff},
		{"EDT.Horizon", o.EDT.Horizon, DefaultEDTHorizon},
		{"Pressure.SoftPercent", o.Pressure.SoftPercent, DefaultPressureSoftPercent},
		{"Pressure.HardPercent", o.Pressure.HardPercent, DefaultPressureHardPercent},
		{"Pressure.Interval", o.Pressure.Interval, DefaultPressureInterval},
		{"HA.Interval", o.HA.Interval, DefaultHAInterval},
		{"HA.JournalMaxOps", o.HA.JournalMaxOps, ha.DefaultMaxOps},
		// What is off stays off; the catalog stays in memory.
		{"EDT.Enabled", o.EDT.Enabled, false},
		{"SocketLB.CgroupConnect", o.SocketLB.CgroupConnect, false},
		{"HA.Epoch", o.HA.Epoch, ha.Epoch(0)},
		{"FlowSampleRate", o.FlowSampleRate, uint32(0)},
		{"CatalogPath", o.CatalogPath, ""},
		{"AdvertisementsPath", o.AdvertisementsPath, ""},
	} {
		if c.got != c.def {
			t.Errorf("Options{}.WithDefaults().%s = %v, want %v", c.name, c.got, c.def)
		}
	}
	if o.Logger == nil || o.InNamespace == nil {
		t.Error("WithDefaults left Logger or InNamespace nil")
	}
	// GC on demand only turns the pressure timer off too, unless asked.
	if got := (Options{ConntrackGCInterval: -1}).WithDefaults().Pressure.Interval; got >= 0 {
		t.Errorf("GC off: pressure interval %v, want off (negative)", got)
	}
	if got := (Options{ConntrackGCInterval: -1, Pressure: PressureOptions{Interval: time.Second}}).WithDefaults().Pressure.Interval; got != time.Second {
		t.Errorf("GC off, pressure asked: %v, want 1s", got)
	}
	// Set values are kept.
	set := Options{ConntrackGCInterval: time.Minute, EDT: EDTOptions{Horizon: time.Second}, Pressure: PressureOptions{SoftPercent: 10, HardPercent: 20}}.WithDefaults()
	if set.ConntrackGCInterval != time.Minute || set.EDT.Horizon != time.Second || set.Pressure.SoftPercent != 10 || set.Pressure.HardPercent != 20 {
		t.Errorf("set values changed: %+v", set)
	}
}

// TestOptionsDeprecatedFields: each flat field of earlier releases still
// configures its setting, carried into the new field (and cleared), and
// the new field wins when both are set alike.
func TestOptionsDeprecatedFields(t *testing.T) {
	vm := []VMEdgeInterface{{Name: "tap0", VMID: "vm"}}
	old := Options{
		EDTEnabled: true, EDTHorizon: time.Second, EDTManageFQ: true, EDTInterfaces: []string{"a"}, EDTHorizonFallback: true,
		PressureSoftPercent: 10, PressureHardPercent: 20, PressureInterval: time.Minute,
		CgroupConnect: true, CgroupPath: "/sys/fs/cgroup/x", GCInterval: time.Hour, Interfaces: vm, HealthConcurrency: 3,
		HA: HAOptions{MaxOps: 77},
	}
	if err := old.Validate(); err != nil {
		t.Fatalf("deprecated fields: %v", err)
	}
	o := old.WithDefaults()
	want := Options{
		EDT:      EDTOptions{Enabled: true, Horizon: time.Second, ManageFQ: true, Interfaces: []string{"a"}, HorizonFallback: true},
		Pressure: PressureOptions{SoftPercent: 10, HardPercent: 20, Interval: time.Minute},
		SocketLB: SocketLBOptions{CgroupConnect: true, CgroupPath: "/sys/fs/cgroup/x"}, ConntrackGCInterval: time.Hour,
		VMEdgeInterfaces: vm, HealthCheckConcurrency: 3,
	}
	if o.EDT.Enabled != want.EDT.Enabled || o.EDT.Horizon != want.EDT.Horizon || o.EDT.ManageFQ != want.EDT.ManageFQ ||
		!slices.Equal(o.EDT.Interfaces, want.EDT.Interfaces) || o.EDT.HorizonFallback != want.EDT.HorizonFallback ||
		o.Pressure != want.Pressure || o.SocketLB != want.SocketLB || o.ConntrackGCInterval != want.ConntrackGCInterval ||
		!slices.Equal(o.VMEdgeInterfaces, want.VMEdgeInterfaces) || o.HealthCheckConcurrency != want.HealthCheckConcurrency ||
		o.HA.JournalMaxOps != 77 {
		t.Errorf("carried: %+v", o)
	}
	if o.EDTEnabled || o.EDTHorizon != 0 || o.EDTManageFQ || o.EDTInterfaces != nil || o.EDTHorizonFallback || o.PressureSoftPercent != 0 ||
		o.PressureHardPercent != 0 || o.PressureInterval != 0 || o.CgroupConnect || o.CgroupPath != "" || o.GCInterval != 0 ||
		o.Interfaces != nil || o.HealthConcurrency != 0 || o.HA.MaxOps != 0 {
		t.Errorf("deprecated fields not cleared: %+v", o)
	}
	both := Options{GCInterval: time.Hour, ConntrackGCInterval: time.Hour}
	if err := both.Validate(); err != nil || both.WithDefaults().ConntrackGCInterval != time.Hour {
		t.Errorf("both alike: %v", err)
	}
	apart := Options{Interfaces: vm, VMEdgeInterfaces: []VMEdgeInterface{{Name: "tap1", VMID: "vm"}}}
	if err := apart.Validate(); !hasField(err, "VMEdgeInterfaces", ErrConflict) || !strings.Contains(err.Error(), "deprecated Interfaces") {
		t.Errorf("both apart: %v", err)
	}
}
