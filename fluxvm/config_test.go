package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/cgroup2"
)

const exampleConfigPath = "../examples/fluxvmd.toml"

func TestDefaultConfig(t *testing.T) {
	c := DefaultConfig()
	if err := c.Validate(); err != nil {
		t.Fatalf("DefaultConfig is not valid: %v", err)
	}
	if c.Tier() != bpf.TierM {
		t.Errorf("tier %v", c.Tier())
	}
	want := bpf.Options{PinRoot: bpf.DefaultPinRoot, Tier: bpf.TierM, MountBPFFS: true}
	if got := c.LoaderOptions(); got != want {
		t.Errorf("LoaderOptions = %+v, want %+v", got, want)
	}
	if got := c.ConntrackTimeouts(); got != conntrack.DefaultTimeouts() {
		t.Errorf("timeouts %+v, want the datapath's defaults %+v", got, conntrack.DefaultTimeouts())
	}
	if c.CatalogPath != "/var/lib/fluxvm/service-catalog.json" || c.ConntrackGCInterval.Duration != 30*time.Second ||
		c.EDTEnabled || c.EDTHorizon.Duration != 250*time.Millisecond || c.EDTManageFQ || c.EDTInterfaces != nil || c.EDTHorizonFallback {
		t.Errorf("defaults: %+v", c)
	}
	// An empty document, or an empty table, is the defaults.
	for _, doc := range []string{"", "# nothing\n", "[sandbox.dataplane.service]\n"} {
		got, err := ParseConfig([]byte(doc))
		if err != nil {
			t.Fatalf("%q: %v", doc, err)
		}
		if !reflect.DeepEqual(got, c) {
			t.Errorf("%q: got %+v, want the defaults", doc, got)
		}
	}
}

// TestParseConfigEveryKey sets every key to a value other than its
// default and checks that each lands in its field.
func TestParseConfigEveryKey(t *testing.T) {
	doc := `
[sandbox.dataplane.service]
map_tier = "l"
pin_root = "/sys/fs/bpf/fluxvm/test"
object_dir = "/usr/lib/fluxvm/bpf"
attach_mode = "cls_bpf"
hash_seed = 0x7fffffffffffffff
maglev_seed = 42
catalog_path = "/srv/fluxvm/catalog.json"
advertisements_path = "/run/fluxvm-test/adverts.json"
node_name = "node-a.example"
health_check_concurrency = 8
flow_sample_rate = 100
ha_epoch = 12
ha_interval = "250ms"
ha_journal_max_ops = 2048
ha_group = true
pressure_soft_percent = 70
pressure_hard_percent = 90
pressure_interval = "5s"
conntrack_gc_interval = "1m30s"
tcp_syn_timeout = "2s"
tcp_established_timeout = "168h"
tcp_fin_timeout = "45s"
tcp_rst_timeout = "5s"
udp_timeout = "2m"
vm_edge_interfaces = [{ name = "tap-vm1", vm_id = "vm-1" }, { name = "tap-vm1b", vm_id = "vm-1" }]
north_south_interfaces = ["uplink0", "uplink1"]
xdp_mode = "auto"
xdp_egress_interfaces = ["eth2"]
snat_address = "203.0.113.10"
snat_address_v6 = "2001:db8:10::10"
snat_port_min = 20000
snat_port_max = 29999
advertise_snat = true
cgroup_connect = true
cgroup_path = "/sys/fs/cgroup/unified/fluxvm"
edt_enabled = true
edt_horizon = "50ms"
edt_manage_fq = true
edt_interfaces = ["uplink0", "tap-vm1"]
edt_horizon_fallback = true
`
	c, err := ParseConfig([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	want := Config{
		MapTier:                "l",
		PinRoot:                "/sys/fs/bpf/fluxvm/test",
		ObjectDir:              "/usr/lib/fluxvm/bpf",
		AttachMode:             bpf.AttachClsBPF,
		HashSeed:               1<<63 - 1,
		MaglevSeed:             42,
		CatalogPath:            "/srv/fluxvm/catalog.json",
		AdvertisementsPath:     "/run/fluxvm-test/adverts.json",
		NodeName:               "node-a.example",
		HealthCheckConcurrency: 8,
		FlowSampleRate:         100,
		HAEpoch:                12,
		HAInterval:             Duration{Duration: 250 * time.Millisecond},
		HAJournalMaxOps:        2048,
		HAGroup:                true,
		PressureSoftPercent:    70,
		PressureHardPercent:    90,
		PressureInterval:       Duration{Duration: 5 * time.Second},
		ConntrackGCInterval:    Duration{Duration: 90 * time.Second},
		TCPSynTimeout:          Duration{Duration: 2 * time.Second},
		TCPEstablishedTimeout:  Duration{Duration: 168 * time.Hour},
		TCPFinTimeout:          Duration{Duration: 45 * time.Second},
		TCPRstTimeout:          Duration{Duration: 5 * time.Second},
		UDPTimeout:             Duration{Duration: 2 * time.Minute},
		VMEdgeInterfaces:       []VMEdgeInterface{{"tap-vm1", "vm-1"}, {"tap-vm1b", "vm-1"}},
		NorthSouthInterfaces:   []string{"uplink0", "uplink1"},
		XDPMode:                bpf.XDPAuto,
		XDPEgressInterfaces:    []string{"eth2"},
		SNATAddress:            netip.MustParseAddr("203.0.113.10"),
		SNATAddressV6:          netip.MustParseAddr("2001:db8:10::10"),
		SNATPortMin:            20000,
		SNATPortMax:            29999,
		AdvertiseSNAT:          true,
		CgroupConnect:          true,
		CgroupPath:             "/sys/fs/cgroup/unified/fluxvm",
		EDTEnabled:             true,
		EDTHorizon:             Duration{Duration: 50 * time.Millisecond},
		EDTManageFQ:            true,
		EDTInterfaces:          []string{"uplink0", "tap-vm1"},
		EDTHorizonFallback:     true,
	}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("got  %+v\nwant %+v", c, want)
	}
	// Every field differs from its default, so none was left unset.
	def := reflect.ValueOf(DefaultConfig())
	got := reflect.ValueOf(c)
	for i := range got.NumField() {
		name := got.Type().Field(i).Name
		if reflect.DeepEqual(got.Field(i).Interface(), def.Field(i).Interface()) {
			t.Errorf("%s kept its default", name)
		}
	}
	if c.Tier() != bpf.TierL {
		t.Errorf("tier %v", c.Tier())
	}
	wantOpts := bpf.Options{PinRoot: "/sys/fs/bpf/fluxvm/test", Tier: bpf.TierL, ObjectDir: "/usr/lib/fluxvm/bpf", HashSeed: 1<<63 - 1, AttachMode: bpf.AttachClsBPF, MountBPFFS: true}
	if got := c.LoaderOptions(); got != wantOpts {
		t.Errorf("LoaderOptions = %+v, want %+v", got, wantOpts)
	}
	to := c.ConntrackTimeouts()
	if err := to.Validate(); err != nil {
		t.Fatal(err)
	}
	var m bpf.Meta
	if err := to.ApplyTo(&m); err != nil {
		t.Fatal(err)
	}
	if m.TimeoutTcpSynS != 2 || m.TimeoutTcpEstablishedS != 168*3600 || m.TimeoutTcpFinS != 45 || m.TimeoutTcpRstS != 5 || m.TimeoutUdpS != 120 {
		t.Errorf("meta timeouts %+v", m)
	}
}

func TestParseConfigErrors(t *testing.T) {
	const table = "[sandbox.dataplane.service]\n"
	k := func(s string) string { return "sandbox.dataplane.service." + s }
	tests := []struct {
		name   string
		doc    string
		field  string
		kind   error
		reason string
	}{
		// Syntax, unknown keys, types.
		{name: "syntax", doc: "[sandbox.dataplane.service\n", kind: ErrMalformed, reason: "line 1"},
		{name: "unknown key", doc: table + "map_teir = \"S\"\n", field: k("map_teir"), kind: ErrMalformed, reason: "unknown key (line 2)"},
		{name: "unknown interface key", doc: table + "vm_edge_interfaces = [{ name = \"t\", vm = \"v\" }]\n", field: k("vm"), kind: ErrMalformed},
		{name: "unknown table", doc: "[sandbox.dataplane.network]\nx = 1\n", field: "sandbox.dataplane.network", kind: ErrMalformed, reason: "only the [sandbox.dataplane.service] table"},
		{name: "unknown top-level key", doc: "debug = true\n", field: "debug", kind: ErrMalformed},
		{name: "map_tier not a string", doc: table + "map_tier = 3\n", field: k("map_tier"), kind: ErrMalformed, reason: "wrong type: a TOML integer where a string is wanted"},
		{name: "hash_seed negative", doc: table + "hash_seed = -1\n", field: k("hash_seed"), kind: ErrMalformed},
		{name: "hash_seed a string", doc: table + "hash_seed = \"7\"\n", field: k("hash_seed"), kind: ErrMalformed, reason: "integer"},
		{name: "maglev_seed negative", doc: table + "maglev_seed = -1\n", field: k("maglev_seed"), kind: ErrMalformed},
		{name: "flow_sample_rate negative", doc: table + "flow_sample_rate = -1\n", field: k("flow_sample_rate"), kind: ErrMalformed},
		{name: "maglev_seed a string", doc: table + "maglev_seed = \"7\"\n", field: k("maglev_seed"), kind: ErrMalformed, reason: "integer"},
		{name: "edt_enabled a string", doc: table + "edt_enabled = \"no\"\n", field: k("edt_enabled"), kind: ErrMalformed, reason: "boolean"},
		{name: "interfaces not a list", doc: table + "north_south_interfaces = \"eth0\"\n", field: k("north_south_interfaces"), kind: ErrMalformed},
		{name: "snat_address malformed", doc: table + "snat_address = \"1.2.3\"\n", field: k("snat_address"), kind: ErrMalformed},

		// Durations.
		{name: "duration without unit", doc: table + "udp_timeout = \"60\"\n", field: k("udp_timeout"), kind: ErrMalformed, reason: "not a duration"},
		{name: "duration as integer", doc: table + "udp_timeout = 60\n", field: k("udp_timeout"), kind: ErrMalformed, reason: "not a duration"},
		{name: "duration garbage", doc: table + "conntrack_gc_interval = \"soon\"\n", field: k("conntrack_gc_interval"), kind: ErrMalformed},
		{name: "gc interval too short", doc: table + "conntrack_gc_interval = \"500ms\"\n", field: k("conntrack_gc_interval"), kind: ErrInvalid},
		{name: "gc interval zero", doc: table + "conntrack_gc_interval = \"0s\"\n", field: k("conntrack_gc_interval"), kind: ErrInvalid},
		{name: "gc interval too long", doc: table + "conntrack_gc_interval = \"2h\"\n", field: k("conntrack_gc_interval"), kind: ErrInvalid},
		{name: "timeout not whole seconds", doc: table + "tcp_fin_timeout = \"30.5s\"\n", field: k("tcp_fin_timeout"), kind: ErrInvalid, reason: "whole number of seconds"},
		{name: "timeout too short", doc: table + "tcp_rst_timeout = \"1s\"\n", field: k("tcp_rst_timeout"), kind: ErrInvalid},
		{name: "timeout negative", doc: table + "tcp_syn_timeout = \"-60s\"\n", field: k("tcp_syn_timeout"), kind: ErrInvalid},
		{name: "timeout too long", doc: table + "tcp_established_timeout = \"169h\"\n", field: k("tcp_established_timeout"), kind: ErrInvalid},

		// Datapath keys.
		{name: "map_tier unknown", doc: table + "map_tier = \"XL\"\n", field: k("map_tier"), kind: ErrInvalid},
		{name: "map_tier empty", doc: table + "map_tier = \"\"\n", field: k("map_tier"), kind: ErrInvalid},
		{name: "pin_root relative", doc: table + "pin_root = \"fluxvm\"\n", field: k("pin_root"), kind: ErrInvalid},
		{name: "pin_root the mount", doc: table + "pin_root = \"/sys/fs/bpf/\"\n", field: k("pin_root"), kind: ErrInvalid},
		{name: "object_dir relative", doc: table + "object_dir = \"bpf\"\n", field: k("object_dir"), kind: ErrInvalid},
		{name: "attach_mode unknown", doc: table + "attach_mode = \"xdp\"\n", field: k("attach_mode"), kind: ErrInvalid},
		{name: "xdp_mode unknown", doc: table + "xdp_mode = \"driver\"\n", field: k("xdp_mode"), kind: ErrInvalid, reason: "\"driver\" is not an XDP mode (want \"off\", \"native\", \"generic\" or \"auto\")"},
		{name: "xdp_mode upper case", doc: table + "xdp_mode = \"Native\"\n", field: k("xdp_mode"), kind: ErrInvalid},
		{name: "xdp_egress_interfaces without xdp_mode", doc: table + "xdp_egress_interfaces = [\"eth2\"]\n", field: k("xdp_egress_interfaces"), kind: ErrInvalid},
		{name: "xdp_egress_interfaces bad name", doc: table + "xdp_mode = \"native\"\nxdp_egress_interfaces = [\"a/b\"]\n", field: k("xdp_egress_interfaces"), kind: ErrInvalid},
		{name: "xdp_egress_interfaces twice", doc: table + "xdp_mode = \"native\"\nxdp_egress_interfaces = [\"eth2\", \"eth2\"]\n", field: k("xdp_egress_interfaces"), kind: ErrInvalid},
		{name: "xdp_mode a boolean", doc: table + "xdp_mode = true\n", field: k("xdp_mode"), kind: ErrMalformed, reason: "string"},
		{name: "cgroup_path without cgroup_connect", doc: table + "cgroup_path = \"/sys/fs/cgroup/unified/agents\"\n", field: k("cgroup_path"), kind: ErrInvalid, reason: "set, but cgroup_connect is false: set cgroup_connect = true too, or leave this empty"},
		{name: "cgroup_path relative", doc: table + "cgroup_connect = true\ncgroup_path = \"agents\"\n", field: k("cgroup_path"), kind: ErrInvalid, reason: "\"agents\" is not an absolute path"},
		{name: "cgroup_connect a string", doc: table + "cgroup_connect = \"yes\"\n", field: k("cgroup_connect"), kind: ErrMalformed, reason: "boolean"},
		{name: "cgroup_path an integer", doc: table + "cgroup_connect = true\ncgroup_path = 1\n", field: k("cgroup_path"), kind: ErrMalformed, reason: "string"},
		{name: "catalog_path relative", doc: table + "catalog_path = \"catalog.json\"\n", field: k("catalog_path"), kind: ErrInvalid},
		{name: "catalog_path empty", doc: table + "catalog_path = \"\"\n", field: k("catalog_path"), kind: ErrInvalid},
		{name: "advertisements_path relative", doc: table + "advertisements_path = \"adverts.json\"\n", field: k("advertisements_path"), kind: ErrInvalid, reason: "absolute"},
		{name: "advertisements_path empty", doc: table + "advertisements_path = \"\"\n", field: k("advertisements_path"), kind: ErrInvalid},
		{name: "advertisements_path a directory", doc: table + "advertisements_path = \"/run/fluxvm/\"\n", field: k("advertisements_path"), kind: ErrInvalid, reason: "directory"},
		{name: "advertisements_path root", doc: table + "advertisements_path = \"/\"\n", field: k("advertisements_path"), kind: ErrInvalid},
		{name: "advertisements_path is catalog_path", doc: table + "catalog_path = \"/var/lib/fluxvm/x.json\"\nadvertisements_path = \"/var/lib/fluxvm//x.json\"\n", field: k("advertisements_path"), kind: ErrConflict, reason: "catalog_path"},
		{name: "advertisements_path a number", doc: table + "advertisements_path = 1\n", field: k("advertisements_path"), kind: ErrMalformed},
		{name: "node_name with space", doc: table + "node_name = \"node a\"\n", field: k("node_name"), kind: ErrInvalid},
		{name: "health_check_concurrency negative", doc: table + "health_check_concurrency = -1\n", field: k("health_check_concurrency"), kind: ErrInvalid},
		{name: "health_check_concurrency too large", doc: table + "health_check_concurrency = 1025\n", field: k("health_check_concurrency"), kind: ErrInvalid, reason: "1024"},
		{name: "flow_sample_rate too large", doc: table + "flow_sample_rate = 65537\n", field: k("flow_sample_rate"), kind: ErrInvalid, reason: "0..65536"},
		{name: "ha_epoch without the north-south edge", doc: table + "ha_epoch = 3\n", field: k("ha_epoch"), kind: ErrPrerequisite, reason: "north_south_interfaces"},
		{name: "ha_interval too short", doc: table + "ha_interval = \"10ms\"\n", field: k("ha_interval"), kind: ErrInvalid, reason: "100ms..1m0s"},
		{name: "ha_interval zero", doc: table + "ha_interval = \"0s\"\n", field: k("ha_interval"), kind: ErrInvalid, reason: "100ms..1m0s"},
		{name: "ha_group without ha_epoch", doc: table + "node_name = \"e1\"\nha_group = true\n", field: k("ha_group"), kind: ErrPrerequisite, reason: "ha_epoch"},
		{name: "ha_group without node_name", doc: table + "north_south_interfaces = [\"eth1\"]\nha_epoch = 3\nha_group = true\n", field: k("ha_group"), kind: ErrPrerequisite, reason: "node_name"},
		{name: "ha_journal_max_ops too large", doc: table + "ha_journal_max_ops = 4194305\n", field: k("ha_journal_max_ops"), kind: ErrInvalid, reason: "0..4194304"},
		{name: "pressure_soft_percent zero", doc: table + "pressure_soft_percent = 0\n", field: k("pressure_soft_percent"), kind: ErrInvalid, reason: "1..100"},
		{name: "pressure_hard_percent too large", doc: table + "pressure_hard_percent = 101\n", field: k("pressure_hard_percent"), kind: ErrInvalid, reason: "1..100"},
		{name: "pressure_interval too short", doc: table + "pressure_interval = \"50ms\"\n", field: k("pressure_interval"), kind: ErrInvalid, reason: "100ms..1h"},
		{name: "pressure_interval zero", doc: table + "pressure_interval = \"0s\"\n", field: k("pressure_interval"), kind: ErrInvalid},
		{name: "pressure soft not below hard", doc: table + "pressure_soft_percent = 95\n", field: k("pressure_soft_percent"), kind: ErrConflict, reason: "not below"},
		{name: "ha_journal_max_ops negative", doc: table + "ha_journal_max_ops = -1\n", field: k("ha_journal_max_ops"), kind: ErrInvalid, reason: "0..4194304"},
		{name: "node_name too long", doc: table + fmt.Sprintf("node_name = %q\n", strings.Repeat("n", 254)), field: k("node_name"), kind: ErrInvalid, reason: "253"},

		// Interfaces.
		{name: "edge name too long", doc: table + "vm_edge_interfaces = [{ name = \"tap-0123456789ab\", vm_id = \"v\" }]\n", field: k("vm_edge_interfaces[0].name"), kind: ErrInvalid, reason: "15"},
		{name: "edge name missing", doc: table + "vm_edge_interfaces = [{ vm_id = \"v\" }]\n", field: k("vm_edge_interfaces[0].name"), kind: ErrInvalid},
		{name: "edge name with slash", doc: table + "vm_edge_interfaces = [{ name = \"tap/1\", vm_id = \"v\" }]\n", field: k("vm_edge_interfaces[0].name"), kind: ErrInvalid},
		{name: "edge name with space", doc: table + "vm_edge_interfaces = [{ name = \"tap 1\", vm_id = \"v\" }]\n", field: k("vm_edge_interfaces[0].name"), kind: ErrInvalid},
		{name: "edge name dot", doc: table + "vm_edge_interfaces = [{ name = \".\", vm_id = \"v\" }]\n", field: k("vm_edge_interfaces[0].name"), kind: ErrInvalid},
		{name: "edge names duplicate", doc: table + "vm_edge_interfaces = [{ name = \"tap1\", vm_id = \"a\" }, { name = \"tap1\", vm_id = \"b\" }]\n", field: k("vm_edge_interfaces[1].name"), kind: ErrConflict},
		{name: "edge vm_id missing", doc: table + "[[sandbox.dataplane.service.vm_edge_interfaces]]\nname = \"tap1\"\n", field: k("vm_edge_interfaces[0].vm_id"), kind: ErrInvalid},
		{name: "edge vm_id with slash", doc: table + "vm_edge_interfaces = [{ name = \"tap1\", vm_id = \"a/b\" }]\n", field: k("vm_edge_interfaces[0].vm_id"), kind: ErrInvalid},
		{name: "edge vm_id too long", doc: table + fmt.Sprintf("vm_edge_interfaces = [{ name = \"tap1\", vm_id = %q }]\n", strings.Repeat("v", 129)), field: k("vm_edge_interfaces[0].vm_id"), kind: ErrInvalid},
		{name: "north-south name invalid", doc: table + "north_south_interfaces = [\"\"]\n", field: k("north_south_interfaces[0]"), kind: ErrInvalid},
		{name: "north-south name too long", doc: table + "north_south_interfaces = [\"eth0\", \"uplink-0123456789\"]\n", field: k("north_south_interfaces[1]"), kind: ErrInvalid, reason: "15"},
		{name: "north-south name with colon", doc: table + "north_south_interfaces = [\"eth0:1\"]\n", field: k("north_south_interfaces[0]"), kind: ErrInvalid},
		{name: "north-south names duplicate", doc: table + "north_south_interfaces = [\"eth0\", \"eth0\"]\n", field: k("north_south_interfaces[1]"), kind: ErrConflict},
		{name: "north-south also a VM edge", doc: table + "north_south_interfaces = [\"tap1\"]\nvm_edge_interfaces = [{ name = \"tap1\", vm_id = \"a\" }]\n", field: k("north_south_interfaces[0]"), kind: ErrConflict},

		// SNAT and EDT.
		{name: "snat_address multicast", doc: table + "snat_address = \"224.0.0.1\"\n", field: k("snat_address"), kind: ErrInvalid},
		{name: "snat_address unspecified", doc: table + "snat_address = \"::\"\n", field: k("snat_address"), kind: ErrInvalid},
		{name: "snat_address loopback", doc: table + "snat_address = \"127.0.0.1\"\n", field: k("snat_address"), kind: ErrInvalid},
		{name: "snat_address link-local", doc: table + "snat_address = \"fe80::1\"\n", field: k("snat_address"), kind: ErrInvalid},
		{name: "snat_address with zone", doc: table + "snat_address = \"fd00::1%eth0\"\n", field: k("snat_address"), kind: ErrInvalid},
		{name: "snat_address IPv4-mapped", doc: table + "snat_address = \"::ffff:192.0.2.1\"\n", field: k("snat_address"), kind: ErrInvalid, reason: "IPv4-mapped"},
		{name: "snat_address IPv6 with snat_address_v6", doc: table + "snat_address = \"2001:db8::1\"\nsnat_address_v6 = \"2001:db8::2\"\n", field: k("snat_address"), kind: ErrConflict, reason: "IPv4 SNAT address"},
		{name: "snat_address_v6 IPv4", doc: table + "snat_address_v6 = \"192.0.2.1\"\n", field: k("snat_address_v6"), kind: ErrInvalid, reason: "not an IPv6"},
		{name: "snat_address_v6 IPv4-mapped", doc: table + "snat_address_v6 = \"::ffff:192.0.2.1\"\n", field: k("snat_address_v6"), kind: ErrInvalid},
		{name: "snat_address_v6 multicast", doc: table + "snat_address_v6 = \"ff02::1\"\n", field: k("snat_address_v6"), kind: ErrInvalid},
		{name: "snat_address_v6 malformed", doc: table + "snat_address_v6 = \"2001:db8::x\"\n", field: k("snat_address_v6"), kind: ErrMalformed},
		{name: "snat_port_min below 1024", doc: table + "snat_port_min = 1023\n", field: k("snat_port_min"), kind: ErrInvalid, reason: "1024..65535"},
		{name: "snat_port_min zero", doc: table + "snat_port_min = 0\n", field: k("snat_port_min"), kind: ErrInvalid},
		{name: "snat_port_max above 65535", doc: table + "snat_port_max = 65536\n", field: k("snat_port_max"), kind: ErrInvalid},
		{name: "snat_port_max negative", doc: table + "snat_port_max = -1\n", field: k("snat_port_max"), kind: ErrInvalid},
		{name: "advertise_snat without an address", doc: table + "advertise_snat = true\n", field: k("advertise_snat"), kind: ErrPrerequisite},
		{name: "snat ports reversed", doc: table + "snat_port_min = 62000\nsnat_port_max = 61999\n", field: k("snat_port_min"), kind: ErrInvalid, reason: "above snat_port_max"},
		{name: "snat_port_min below the default max", doc: table + "snat_port_max = 2000\n", field: k("snat_port_min"), kind: ErrInvalid, reason: "above snat_port_max (2000)"},
		{name: "snat_port_min a string", doc: table + "snat_port_min = \"61000\"\n", field: k("snat_port_min"), kind: ErrMalformed, reason: "integer"},
		{name: "edt_horizon below 1ms", doc: table + "edt_horizon = \"999us\"\n", field: k("edt_horizon"), kind: ErrInvalid, reason: "1ms..10s"},
		{name: "edt_horizon zero", doc: table + "edt_horizon = \"0s\"\n", field: k("edt_horizon"), kind: ErrInvalid},
		{name: "edt_horizon above 10s", doc: table + "edt_horizon = \"10.001s\"\n", field: k("edt_horizon"), kind: ErrInvalid},
		{name: "edt_horizon a number", doc: table + "edt_horizon = 20\n", field: k("edt_horizon"), kind: ErrMalformed, reason: "duration"},
		{name: "edt_manage_fq without edt_enabled", doc: table + "edt_manage_fq = true\nedt_interfaces = [\"eth0\"]\n", field: k("edt_manage_fq"), kind: ErrPrerequisite, reason: "edt_enabled"},
		{name: "edt_manage_fq without interfaces", doc: table + "edt_enabled = true\nedt_manage_fq = true\n", field: k("edt_manage_fq"), kind: ErrPrerequisite, reason: "edt_interfaces"},
		{name: "edt_interfaces without edt_manage_fq", doc: table + "edt_enabled = true\nedt_interfaces = [\"eth0\"]\n", field: k("edt_interfaces"), kind: ErrPrerequisite, reason: "edt_manage_fq"},
		{name: "edt_horizon_fallback without edt_manage_fq", doc: table + "edt_enabled = true\nedt_horizon_fallback = true\n", field: k("edt_horizon_fallback"), kind: ErrPrerequisite, reason: "edt_manage_fq"},
		{name: "edt_interfaces name invalid", doc: table + "edt_enabled = true\nedt_manage_fq = true\nedt_interfaces = [\"eth0\", \"a/b\"]\n", field: k("edt_interfaces[1]"), kind: ErrInvalid},
		{name: "edt_interfaces name too long", doc: table + "edt_enabled = true\nedt_manage_fq = true\nedt_interfaces = [\"uplink-0123456789\"]\n", field: k("edt_interfaces[0]"), kind: ErrInvalid, reason: "15"},
		{name: "edt_interfaces duplicate", doc: table + "edt_enabled = true\nedt_manage_fq = true\nedt_interfaces = [\"eth0\", \"eth0\"]\n", field: k("edt_interfaces[1]"), kind: ErrConflict, reason: "edt_interfaces[0]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig([]byte(tt.doc))
			if err == nil {
				t.Fatalf("parsed %+v, want an error", c)
			}
			var ve *ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("error %v (%T) is not a *ValidationError", err, err)
			}
			if ve.Field != tt.field {
				t.Errorf("field %q, want %q (error: %v)", ve.Field, tt.field, err)
			}
			if !errors.Is(err, tt.kind) {
				t.Errorf("error %v is not %v", err, tt.kind)
			}
			if tt.reason != "" && !strings.Contains(ve.Reason, tt.reason) {
				t.Errorf("reason %q does not mention %q", ve.Reason, tt.reason)
			}
			if !strings.HasPrefix(err.Error(), "fluxvm: config: ") {
				t.Errorf("error %q lacks context", err)
			}
		})
	}
}

func TestParseConfigReportsEveryProblem(t *testing.T) {
	doc := "[sandbox.dataplane.service]\nmap_teir = \"S\"\nfoo = 1\n"
	_, err := ParseConfig([]byte(doc))
	for _, key := range []string{"map_teir", "foo"} {
		if !strings.Contains(fmt.Sprint(err), "sandbox.dataplane.service."+key+": unknown key") {
			t.Errorf("error %v does not name %s", err, key)
		}
	}
	c := DefaultConfig()
	c.MapTier, c.PinRoot, c.SNATPortMin, c.CgroupPath = "Q", "x", 1, "agents"
	err = c.Validate()
	for _, key := range []string{"map_tier", "pin_root", "snat_port_min", "cgroup_path"} {
		if !strings.Contains(fmt.Sprint(err), "sandbox.dataplane.service."+key+":") {
			t.Errorf("error %v does not name %s", err, key)
		}
	}
	// Both problems of cgroup_path: relative, and without cgroup_connect.
	for _, why := range []string{"not an absolute path", "cgroup_connect is false"} {
		if !strings.Contains(fmt.Sprint(err), why) {
			t.Errorf("error %v does not say %q", err, why)
		}
	}
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "fluxvmd.toml")
	if err := os.WriteFile(path, []byte("[sandbox.dataplane.service]\nmap_tier = \"S\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if c.Tier() != bpf.TierS {
		t.Errorf("tier %v", c.Tier())
	}

	_, err = LoadConfig(filepath.Join(dir, "missing.toml"))
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}

	bad := filepath.Join(dir, "bad.toml")
	if err := os.WriteFile(bad, []byte("[sandbox.dataplane.service]\nmap_tier = \"XL\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = LoadConfig(bad)
	var ve *ValidationError
	if !errors.As(err, &ve) || ve.Field != "sandbox.dataplane.service.map_tier" || !strings.Contains(err.Error(), bad) {
		t.Errorf("bad file: %v", err)
	}

	big := filepath.Join(dir, "big.toml")
	if err := os.WriteFile(big, []byte(strings.Repeat("#", MaxConfigBytes+1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(big); !errors.Is(err, ErrTooLarge) {
		t.Errorf("big file: %v", err)
	}
}

func TestConfigTierInvalid(t *testing.T) {
	c := DefaultConfig()
	c.MapTier = "XL"
	if c.Tier() != 0 || c.LoaderOptions().Tier != 0 {
		t.Errorf("invalid tier gave %v", c.Tier())
	}
}

func TestDuration(t *testing.T) {
	var d Duration
	if err := d.UnmarshalText([]byte("1h2m3s")); err != nil || d.Duration != time.Hour+2*time.Minute+3*time.Second {
		t.Fatalf("%v %v", d, err)
	}
	b, err := d.MarshalText()
	if err != nil || string(b) != "1h2m3s" {
		t.Errorf("MarshalText = %q, %v", b, err)
	}
	if err := d.UnmarshalText([]byte("3")); err == nil {
		t.Error("a bare number was accepted")
	}
}

func ExampleParseConfig() {
	cfg, err := ParseConfig([]byte(`
[sandbox.dataplane.service]
map_tier = "S"
vm_edge_interfaces = [{ name = "tap-vm1", vm_id = "vm-1" }]
`))
	if err != nil {
		panic(err)
	}
	fmt.Println(cfg.Tier(), cfg.LoaderOptions().PinRoot, cfg.ConntrackTimeouts().TCPEstablished)

	_, err = ParseConfig([]byte("[sandbox.dataplane.service]\nedt_enabled = true\nedt_horizon = \"20s\"\n"))
	fmt.Println(err)
	// Output:
	// S /sys/fs/bpf/fluxvm/service 6h0m0s
	// fluxvm: config: sandbox.dataplane.service.edt_horizon: 20s is outside 1ms..10s
}

// TestSNATConfig checks which SNAT address serves each family and the
// fluxvm_snat value built from the configuration.
func TestSNATConfig(t *testing.T) {
	ip := netip.MustParseAddr
	v4, v6, v6b := ip("203.0.113.10"), ip("2001:db8:10::10"), ip("2001:db8:20::20")
	tests := []struct {
		name           string
		doc            string
		want4, want6   netip.Addr
		flags          uint32
		portMin, ports int
	}{
		{name: "none", doc: "", flags: 0, portMin: 61000, ports: 4536},
		{name: "IPv4 only", doc: `snat_address = "203.0.113.10"`, want4: v4, flags: bpf.SNATFlagV4, portMin: 61000, ports: 4536},
		{name: "IPv6 in snat_address", doc: `snat_address = "2001:db8:20::20"`, want6: v6b, flags: bpf.SNATFlagV6, portMin: 61000, ports: 4536},
		{name: "IPv6 in snat_address_v6 only", doc: `snat_address_v6 = "2001:db8:10::10"`, want6: v6, flags: bpf.SNATFlagV6, portMin: 61000, ports: 4536},
		{name: "both families", doc: "snat_address = \"203.0.113.10\"\nsnat_address_v6 = \"2001:db8:10::10\"\nsnat_port_min = 1024\nsnat_port_max = 1024",
			want4: v4, want6: v6, flags: bpf.SNATFlagV4 | bpf.SNATFlagV6, portMin: 1024, ports: 1},
		{name: "whole range", doc: "snat_port_min = 1024\nsnat_port_max = 65535", portMin: 1024, ports: 64512},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig([]byte("[sandbox.dataplane.service]\n" + tt.doc + "\n"))
			if err != nil {
				t.Fatal(err)
			}
			if got := c.SNATAddressFor(false); got != tt.want4 {
				t.Errorf("IPv4 SNAT address %v, want %v", got, tt.want4)
			}
			if got := c.SNATAddressFor(true); got != tt.want6 {
				t.Errorf("IPv6 SNAT address %v, want %v", got, tt.want6)
			}
			v := c.SNATConfig()
			if v.Flags != tt.flags || int(v.PortMin) != tt.portMin || int(v.PortMax)-int(v.PortMin)+1 != tt.ports {
				t.Errorf("SNATConfig %+v, want flags %#x ports %d+%d", v, tt.flags, tt.portMin, tt.ports)
			}
			if tt.want4.IsValid() && bpf.Addr([4]uint32{v.Addr4}, bpf.FamilyIPv4) != tt.want4 {
				t.Errorf("Addr4 %#x is not %v", v.Addr4, tt.want4)
			}
			if tt.want6.IsValid() && bpf.Addr(v.Addr6, bpf.FamilyIPv6) != tt.want6 {
				t.Errorf("Addr6 %#x is not %v", v.Addr6, tt.want6)
			}
			if !tt.want4.IsValid() && v.Addr4 != 0 || !tt.want6.IsValid() && v.Addr6 != [4]uint32{} {
				t.Errorf("an address without its flag: %+v", v)
			}
		})
	}
	// A Config not built from DefaultConfig (ports 0..0) takes the default
	// range, and Open's check accepts it; a bad address is still refused.
	var zero Config
	if v := zero.SNATConfig(); v.PortMin != DefaultSNATPortMin || v.PortMax != DefaultSNATPortMax || v.Flags != 0 {
		t.Errorf("zero config: %+v", v)
	}
	// Options name their own fields.
	var ns NorthSouth
	if err := ns.Validate(); err != nil {
		t.Errorf("zero north-south: %v", err)
	}
	ns.SNATAddressV6 = v4
	var ve *ValidationError
	if err := ns.Validate(); !errors.As(err, &ve) || ve.Field != "NorthSouth.SNATAddressV6" {
		t.Errorf("IPv4 SNATAddressV6: %v", err)
	}
	ns = NorthSouth{SNATPortMin: 70000, SNATPortMax: 1}
	if err := ns.Validate(); !errors.As(err, &ve) || ve.Field != "NorthSouth.SNATPortMin" {
		t.Errorf("bad ports: %v", err)
	}
}

// TestLibraryReadsTheDaemonsFile: the example file (which holds the
// daemon's api sub-table) is the library's configuration too, as its
// header says: ParseConfig reads past the daemon's keys, and still refuses
// an unknown key of its own.
func TestLibraryReadsTheDaemonsFile(t *testing.T) {
	c, err := LoadConfig(exampleConfigPath)
	if err != nil {
		t.Fatalf("LoadConfig(%s): %v", exampleConfigPath, err)
	}
	if c.Tier() == 0 {
		t.Errorf("tier of the example: %v", c.Tier())
	}
	doc := "[sandbox.dataplane.service]\nmap_teir = \"S\"\n[sandbox.dataplane.service.api]\nlisten = \"127.0.0.1:1\"\n"
	if _, err := ParseConfig([]byte(doc)); !strings.Contains(fmt.Sprint(err), "map_teir: unknown key") {
		t.Errorf("an unknown key beside the api table: %v", err)
	}
}

// TestXDPModeOptions: xdp_mode reaches the dataplane options, and
// NorthSouth.Validate refuses an unknown mode as the configuration does.
func TestXDPModeOptions(t *testing.T) {
	for _, m := range []bpf.XDPMode{bpf.XDPOff, bpf.XDPNative, bpf.XDPGeneric, bpf.XDPAuto} {
		c, err := ParseConfig([]byte("[sandbox.dataplane.service]\nxdp_mode = \"" + string(m) + "\"\n"))
		if err != nil {
			t.Fatalf("%s: %v", m, err)
		}
		if got := OptionsFrom(c).NorthSouth.XDPMode; got != m {
			t.Errorf("OptionsFrom: xdp mode %q, want %q", got, m)
		}
	}
	if err := (NorthSouth{}).Validate(); err != nil {
		t.Errorf("empty mode: %v", err)
	}
	err := NorthSouth{XDPMode: "fast"}.Validate()
	var ve *ValidationError
	if !errors.Is(err, ErrInvalid) || !errors.As(err, &ve) || ve.Field != "NorthSouth.XDPMode" {
		t.Errorf("NorthSouth{XDPMode: fast}.Validate() = %v, want ErrInvalid on xdp_mode", err)
	}
}

// TestSocketLBOptions: cgroup_connect and cgroup_path reach the dataplane
// options, and Open refuses bad socket LB settings before it loads or
// attaches anything (these cases need no privileges: nothing is loaded).
func TestSocketLBOptions(t *testing.T) {
	c, err := ParseConfig([]byte("[sandbox.dataplane.service]\ncgroup_connect = true\ncgroup_path = \"/sys/fs/cgroup/unified/agents\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	if o := OptionsFrom(c).SocketLB; !o.CgroupConnect || o.CgroupPath != "/sys/fs/cgroup/unified/agents" {
		t.Errorf("OptionsFrom: cgroup_connect %v, cgroup_path %q", o.CgroupConnect, o.CgroupPath)
	}
	if o := OptionsFrom(Config{FlowSampleRate: 7}); o.FlowSampleRate != 7 {
		t.Errorf("OptionsFrom: flow_sample_rate %d, want 7", o.FlowSampleRate)
	}
	if o := OptionsFrom(DefaultConfig()).SocketLB; o.CgroupConnect || o.CgroupPath != "" {
		t.Errorf("defaults: cgroup_connect %v, cgroup_path %q; want off", o.CgroupConnect, o.CgroupPath)
	}
	pins := filepath.Join(t.TempDir(), "never-created")
	for _, tc := range []struct {
		name string
		opts Options
		want error
	}{
		{"cgroup_path without cgroup_connect", Options{CgroupPath: "/sys/fs/cgroup/unified"}, ErrInvalid},
		{"cgroup_path relative", Options{CgroupConnect: true, CgroupPath: "unified"}, ErrInvalid},
		{"not a cgroup v2 directory", Options{CgroupConnect: true, CgroupPath: t.TempDir()}, cgroup2.ErrNotCgroupV2},
	} {
		tc.opts.Loader.PinRoot = pins
		d, err := Open(context.Background(), tc.opts)
		if err == nil {
			d.Cleanup(context.Background())
			t.Errorf("%s: Open succeeded", tc.name)
			continue
		}
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
		if _, serr := os.Stat(pins); !errors.Is(serr, os.ErrNotExist) {
			t.Errorf("%s: Open created the pin root before refusing (%v)", tc.name, serr)
		}
	}
}
