package intent

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

func ptr[T any](v T) *T { return &v }

// tierS are the limits of the map tier S (fluxvm.LimitsForTier(bpf.TierS);
// fluxvm's tests check that the tier still has them).
var tierS = Limits{Services: 255, Frontends: 1024, Backends: 4095, MaglevSize: 16381}

// validService is a dual-stack east-west service that passes validation;
// every row of the tables below is one mutation of it.
func validService() Service {
	ip := netip.MustParseAddr
	return Service{
		Name:  "web",
		VIPs:  []netip.Addr{ip("10.96.0.10"), ip("fd00:96::10")},
		Ports: []ServicePort{{80, TCP}, {443, TCP}},
		Backends: []Backend{
			{Address: ip("10.200.1.2"), Port: 8080, Weight: ptr[uint32](1)},
			{Address: ip("10.200.2.2"), Port: 8080, Weight: ptr[uint32](2)},
			{Address: ip("10.200.3.2"), Port: 8080, State: BackendDraining, DrainUntilUnixMs: 1788850000000},
			{Address: ip("fd00:200:1::2"), Port: 8080},
		},
	}
}

// nsNode is a node with the north-south prerequisites met for both
// families: a north-south interface and an SNAT address of each.
func nsNode() Node {
	return Node{
		NorthSouth: true,
		SNAT4:      netip.MustParseAddr("203.0.113.10"),
		SNAT6:      netip.MustParseAddr("2001:db8:10::10"),
	}
}

// nsNodeWith is nsNode with other SNAT addresses (zero: unset), each put
// in the field of its family, as fluxvm's Config.Node does with
// snat_address and snat_address_v6.
func nsNodeWith(snat, snat6 string) func() Node {
	return func() Node {
		n := nsNode()
		n.SNAT4, n.SNAT6 = netip.Addr{}, netip.Addr{}
		for _, a := range []string{snat, snat6} {
			if a == "" {
				continue
			}
			if addr := netip.MustParseAddr(a); addr.Is4() {
				n.SNAT4 = addr
			} else {
				n.SNAT6 = addr
			}
		}
		return n
	}
}

// dsr makes s a DSR service whose backends listen on its one frontend
// port, as DSR requires.
func dsr(s *Service) {
	s.Mode = ModeDSR
	s.Ports = []ServicePort{{8080, TCP}, {8080, UDP}}
}

func TestValidateService(t *testing.T) {
	ip := netip.MustParseAddr
	tests := []struct {
		name   string
		mutate func(*Service)
		node   func() Node // default Node{}
		field  string      // "" = valid
		kind   error
		reason string // substring of the reason, optional
	}{
		// Valid services.
		{name: "valid dual-stack", mutate: func(s *Service) {}},
		{name: "valid IPv4 only", mutate: func(s *Service) { s.VIPs = s.VIPs[:1]; s.Backends = s.Backends[:3] }},
		{name: "valid IPv6 only", mutate: func(s *Service) { s.VIPs = s.VIPs[1:]; s.Backends = s.Backends[3:] }},
		{name: "valid without backends", mutate: func(s *Service) { s.Backends = nil }},
		{name: "valid explicit east-west nat", mutate: func(s *Service) { s.Exposure = ExposureEastWest; s.Mode = ModeNAT }},
		{name: "valid disabled", mutate: func(s *Service) { s.Enabled = ptr(false) }},
		{name: "valid name of 63", mutate: func(s *Service) { s.Name = "a" + strings.Repeat("b-9", 20) + "zz" }},
		{name: "valid name of one letter", mutate: func(s *Service) { s.Name = "w" }},
		{name: "valid same port tcp and udp", mutate: func(s *Service) { s.Ports = []ServicePort{{53, TCP}, {53, UDP}} }},
		{name: "valid port 65535", mutate: func(s *Service) { s.Ports = []ServicePort{{65535, UDP}} }},
		{name: "valid weight 0", mutate: func(s *Service) { s.Backends[0].Weight = ptr[uint32](0) }},
		{name: "valid weight max", mutate: func(s *Service) { s.Backends[0].Weight = ptr[uint32](MaxWeight) }},
		{name: "valid unhealthy", mutate: func(s *Service) { s.Backends[0].State = BackendUnhealthy }},
		{name: "valid explicit ready", mutate: func(s *Service) { s.Backends[0].State = BackendReady }},
		{name: "valid disabled backend", mutate: func(s *Service) { s.Backends[0].Enabled = ptr(false) }},
		{name: "valid same address other port", mutate: func(s *Service) { s.Backends[1].Address = s.Backends[0].Address; s.Backends[1].Port = 8081 }},
		{name: "valid link-local backend", mutate: func(s *Service) { s.Backends[0].Address = ip("169.254.10.2") }},
		{name: "valid max drain deadline", mutate: func(s *Service) { s.Backends[2].DrainUntilUnixMs = MaxDrainUntilUnixMs }},
		{name: "valid max backends", mutate: func(s *Service) { s.Backends = manyBackends(MaxBackendsPerService) }},
		{name: "valid max ports", mutate: func(s *Service) { s.Ports = manyPorts(MaxPortsPerService) }},

		// name
		{name: "name missing", mutate: func(s *Service) { s.Name = "" }, field: "name", kind: ErrInvalid, reason: "required"},
		{name: "name of 64", mutate: func(s *Service) { s.Name = strings.Repeat("a", 64) }, field: "name", kind: ErrInvalid},
		{name: "name starts with a digit", mutate: func(s *Service) { s.Name = "1web" }, field: "name", kind: ErrInvalid, reason: "start with a letter"},
		{name: "name starts with a hyphen", mutate: func(s *Service) { s.Name = "-web" }, field: "name", kind: ErrInvalid},
		{name: "name upper case", mutate: func(s *Service) { s.Name = "Web" }, field: "name", kind: ErrInvalid},
		{name: "name underscore", mutate: func(s *Service) { s.Name = "web_api" }, field: "name", kind: ErrInvalid},
		{name: "name dot", mutate: func(s *Service) { s.Name = "web.api" }, field: "name", kind: ErrInvalid},
		{name: "name non-ASCII", mutate: func(s *Service) { s.Name = "wéb" }, field: "name", kind: ErrInvalid},

		// exposure and mode
		{name: "exposure unknown", mutate: func(s *Service) { s.Exposure = "outside" }, field: "exposure", kind: ErrInvalid},
		{name: "mode unknown", mutate: func(s *Service) { s.Mode = "tunnel" }, field: "mode", kind: ErrInvalid},

		// vips
		{name: "vips missing", mutate: func(s *Service) { s.VIPs = nil }, field: "vips", kind: ErrInvalid},
		{name: "vips three", mutate: func(s *Service) { s.VIPs = append(s.VIPs, ip("10.96.0.11")) }, field: "vips", kind: ErrInvalid},
		{name: "vips two IPv4", mutate: func(s *Service) { s.VIPs[1] = ip("10.96.0.11") }, field: "vips[1]", kind: ErrInvalid, reason: "one VIP per address family"},
		{name: "vips same twice", mutate: func(s *Service) { s.VIPs[1] = s.VIPs[0] }, field: "vips[1]", kind: ErrInvalid},
		{name: "vip zero", mutate: func(s *Service) { s.VIPs[0] = netip.Addr{} }, field: "vips[0]", kind: ErrInvalid},
		{name: "vip zone", mutate: func(s *Service) { s.VIPs[1] = ip("fd00:96::10%eth0") }, field: "vips[1]", kind: ErrInvalid, reason: "zone"},
		{name: "vip IPv4-mapped", mutate: func(s *Service) { s.VIPs = []netip.Addr{ip("::ffff:10.96.0.10")} }, field: "vips[0]", kind: ErrInvalid, reason: "IPv4-mapped"},
		{name: "vip unspecified IPv4", mutate: func(s *Service) { s.VIPs[0] = ip("0.0.0.0") }, field: "vips[0]", kind: ErrInvalid},
		{name: "vip unspecified IPv6", mutate: func(s *Service) { s.VIPs[1] = ip("::") }, field: "vips[1]", kind: ErrInvalid},
		{name: "vip multicast IPv4", mutate: func(s *Service) { s.VIPs[0] = ip("239.1.1.1") }, field: "vips[0]", kind: ErrInvalid},
		{name: "vip multicast IPv6", mutate: func(s *Service) { s.VIPs[1] = ip("ff02::1") }, field: "vips[1]", kind: ErrInvalid},
		{name: "vip loopback IPv4", mutate: func(s *Service) { s.VIPs[0] = ip("127.0.0.5") }, field: "vips[0]", kind: ErrInvalid},
		{name: "vip loopback IPv6", mutate: func(s *Service) { s.VIPs[1] = ip("::1") }, field: "vips[1]", kind: ErrInvalid},
		{name: "vip link-local IPv4", mutate: func(s *Service) { s.VIPs[0] = ip("169.254.1.1") }, field: "vips[0]", kind: ErrInvalid},
		{name: "vip link-local IPv6", mutate: func(s *Service) { s.VIPs[1] = ip("fe80::1") }, field: "vips[1]", kind: ErrInvalid},
		{name: "vip broadcast", mutate: func(s *Service) { s.VIPs[0] = ip("255.255.255.255") }, field: "vips[0]", kind: ErrInvalid},

		// ports
		{name: "ports missing", mutate: func(s *Service) { s.Ports = nil }, field: "ports", kind: ErrInvalid},
		{name: "ports too many", mutate: func(s *Service) { s.Ports = manyPorts(MaxPortsPerService + 1) }, field: "ports", kind: ErrLimit},
		{name: "port 0", mutate: func(s *Service) { s.Ports[1].Port = 0 }, field: "ports[1].port", kind: ErrInvalid, reason: "VIP markers"},
		{name: "protocol missing", mutate: func(s *Service) { s.Ports[0].Protocol = "" }, field: "ports[0].protocol", kind: ErrInvalid},
		{name: "protocol sctp", mutate: func(s *Service) { s.Ports[0].Protocol = "sctp" }, field: "ports[0].protocol", kind: ErrInvalid},
		{name: "protocol upper case", mutate: func(s *Service) { s.Ports[0].Protocol = "TCP" }, field: "ports[0].protocol", kind: ErrInvalid},
		{name: "port duplicate", mutate: func(s *Service) { s.Ports[1] = s.Ports[0] }, field: "ports[1]", kind: ErrConflict, reason: "ports[0]"},

		// backends
		{name: "backends too many", mutate: func(s *Service) { s.Backends = manyBackends(MaxBackendsPerService + 1) }, field: "backends", kind: ErrLimit},
		{name: "backend address zero", mutate: func(s *Service) { s.Backends[0].Address = netip.Addr{} }, field: "backends[0].address", kind: ErrInvalid},
		{name: "backend address zone", mutate: func(s *Service) { s.Backends[3].Address = ip("fe80::2%tap0") }, field: "backends[3].address", kind: ErrInvalid},
		{name: "backend address IPv4-mapped", mutate: func(s *Service) { s.Backends[0].Address = ip("::ffff:10.200.1.2") }, field: "backends[0].address", kind: ErrInvalid},
		{name: "backend address unspecified", mutate: func(s *Service) { s.Backends[0].Address = ip("0.0.0.0") }, field: "backends[0].address", kind: ErrInvalid},
		{name: "backend address multicast", mutate: func(s *Service) { s.Backends[3].Address = ip("ff05::2") }, field: "backends[3].address", kind: ErrInvalid},
		{name: "backend address loopback", mutate: func(s *Service) { s.Backends[1].Address = ip("127.0.0.1") }, field: "backends[1].address", kind: ErrInvalid, reason: "loopback"},
		{name: "backend address broadcast", mutate: func(s *Service) { s.Backends[1].Address = ip("255.255.255.255") }, field: "backends[1].address", kind: ErrInvalid},
		{name: "backend IPv6 without IPv6 VIP", mutate: func(s *Service) { s.VIPs = s.VIPs[:1] }, field: "backends[3].address", kind: ErrInvalid, reason: "no IPv6 VIP"},
		{name: "backend IPv4 without IPv4 VIP", mutate: func(s *Service) { s.VIPs = s.VIPs[1:] }, field: "backends[0].address", kind: ErrInvalid, reason: "no IPv4 VIP"},
		{name: "backend port 0", mutate: func(s *Service) { s.Backends[1].Port = 0 }, field: "backends[1].port", kind: ErrInvalid},
		{name: "backend weight above max", mutate: func(s *Service) { s.Backends[2].Weight = ptr[uint32](MaxWeight + 1) }, field: "backends[2].weight", kind: ErrInvalid},
		{name: "backend state unknown", mutate: func(s *Service) { s.Backends[0].State = "sleeping" }, field: "backends[0].state", kind: ErrInvalid},
		{name: "backend draining without deadline", mutate: func(s *Service) { s.Backends[2].DrainUntilUnixMs = 0 }, field: "backends[2].drain_until_unix_ms", kind: ErrInvalid, reason: "draining backend needs a drain deadline"},
		{name: "backend draining negative deadline", mutate: func(s *Service) { s.Backends[2].DrainUntilUnixMs = -1 }, field: "backends[2].drain_until_unix_ms", kind: ErrInvalid},
		{name: "backend draining deadline too late", mutate: func(s *Service) { s.Backends[2].DrainUntilUnixMs = MaxDrainUntilUnixMs + 1 }, field: "backends[2].drain_until_unix_ms", kind: ErrInvalid},
		{name: "backend deadline while ready", mutate: func(s *Service) { s.Backends[0].DrainUntilUnixMs = 1788850000000 }, field: "backends[0].drain_until_unix_ms", kind: ErrInvalid, reason: "only for a draining backend"},
		{name: "backend deadline while unhealthy", mutate: func(s *Service) { s.Backends[2].State = BackendUnhealthy }, field: "backends[2].drain_until_unix_ms", kind: ErrInvalid},
		{name: "backend duplicate", mutate: func(s *Service) {
			s.Backends[3].Address, s.Backends[3].Port = s.Backends[1].Address, s.Backends[1].Port
		}, field: "backends[3]", kind: ErrConflict, reason: "backends[1]"},
		{name: "backend duplicate disabled", mutate: func(s *Service) { s.Backends[1] = s.Backends[0]; s.Backends[1].Enabled = ptr(false) }, field: "backends[1]", kind: ErrConflict},

		// health_check: kind tcp only; bounds, defaults, interval > timeout.
		{name: "health kind udp", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "udp"} }, field: "health_check.kind", kind: ErrInvalid, reason: "UDP and application health belong in an application-aware control-plane probe"},
		{name: "health kind http", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "http"} }, field: "health_check.kind", kind: ErrInvalid, reason: "application-aware"},
		{name: "health kind upper case", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "TCP"} }, field: "health_check.kind", kind: ErrInvalid},
		{name: "health kind missing", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{} }, field: "health_check.kind", kind: ErrInvalid, reason: "required"},
		{name: "health tcp with defaults", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp"} }},
		{name: "health tcp of the product description", mutate: func(s *Service) {
			s.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 500, UnhealthyThreshold: 3, HealthyThreshold: 2}
		}},
		{name: "health lowest bounds", mutate: func(s *Service) {
			s.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 10, IntervalMs: 100, UnhealthyThreshold: 1, HealthyThreshold: 1}
		}},
		{name: "health highest bounds", mutate: func(s *Service) {
			s.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 60000, IntervalMs: 3600000, UnhealthyThreshold: 100, HealthyThreshold: 100}
		}},
		{name: "health interval just above timeout", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 500, IntervalMs: 501} }},
		{name: "health timeout too short", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 9} }, field: "health_check.timeout_ms", kind: ErrInvalid, reason: "10..60000"},
		{name: "health timeout too long", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 60001, IntervalMs: 120000} }, field: "health_check.timeout_ms", kind: ErrInvalid},
		{name: "health interval too short", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 50, IntervalMs: 99} }, field: "health_check.interval_ms", kind: ErrInvalid, reason: "100..3600000"},
		{name: "health interval too long", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp", IntervalMs: 3600001} }, field: "health_check.interval_ms", kind: ErrInvalid},
		{name: "health interval not above timeout", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 500, IntervalMs: 500} }, field: "health_check.interval_ms", kind: ErrInvalid, reason: "greater than timeout_ms"},
		{name: "health default interval not above timeout", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 2000} }, field: "health_check.interval_ms", kind: ErrInvalid, reason: "greater than timeout_ms (2000)"},
		{name: "health unhealthy threshold", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp", UnhealthyThreshold: 101} }, field: "health_check.unhealthy_threshold", kind: ErrInvalid, reason: "1..100"},
		{name: "health healthy threshold", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp", HealthyThreshold: 101} }, field: "health_check.healthy_threshold", kind: ErrInvalid, reason: "1..100"},

		// Prerequisites come before the unsupported table.
		{name: "max_egress without edt_enabled", mutate: func(s *Service) { s.MaxEgressMbps = 100 }, field: "max_egress_mbps", kind: ErrPrerequisite, reason: "edt_enabled"},
		{name: "max_egress with edt_enabled", mutate: func(s *Service) { s.MaxEgressMbps = 100 },
			node: func() Node { return Node{EDTEnabled: true} }},
		{name: "max_egress lowest", mutate: func(s *Service) { s.MaxEgressMbps = 1 },
			node: func() Node { return Node{EDTEnabled: true} }},
		{name: "max_egress highest", mutate: func(s *Service) { s.MaxEgressMbps = 100000 },
			node: func() Node { return Node{EDTEnabled: true} }},
		{name: "max_egress too high", mutate: func(s *Service) { s.MaxEgressMbps = 100001 },
			node: func() Node { return Node{EDTEnabled: true} }, field: "max_egress_mbps", kind: ErrInvalid, reason: "1..100000"},
		{name: "max_egress too high without edt_enabled", mutate: func(s *Service) { s.MaxEgressMbps = 1 << 31 }, field: "max_egress_mbps", kind: ErrInvalid, reason: "1..100000"},
		{name: "advertise east-west", mutate: func(s *Service) { s.Advertise = true }, field: "advertise", kind: ErrPrerequisite, reason: "north-south or both"},
		{name: "advertise default exposure", mutate: func(s *Service) { s.Advertise = true; s.Exposure = ExposureEastWest }, field: "advertise", kind: ErrPrerequisite},
		{name: "north-south without interfaces", mutate: func(s *Service) { s.Exposure = ExposureNorthSouth }, field: "exposure", kind: ErrPrerequisite, reason: "north_south_interfaces"},
		{name: "both DSR without interfaces", mutate: func(s *Service) { s.Exposure = ExposureBoth; dsr(s) }, field: "exposure", kind: ErrPrerequisite, reason: "north_south_interfaces"},
		{name: "both NAT without snat_address", mutate: func(s *Service) { s.Exposure = ExposureBoth },
			node: nsNodeWith("", ""), field: "vips[0]", kind: ErrPrerequisite, reason: "IPv4 snat_address"},
		{name: "north-south NAT of IPv6 VIP with IPv4 snat only", mutate: func(s *Service) { s.Exposure = ExposureNorthSouth },
			node: nsNodeWith("203.0.113.10", ""), field: "vips[1]", kind: ErrPrerequisite, reason: "snat_address_v6 (or an IPv6 snat_address)"},
		{name: "north-south NAT of IPv4 VIP with IPv6 snat only", mutate: func(s *Service) { s.Exposure = ExposureNorthSouth },
			node: nsNodeWith("", "2001:db8:10::10"), field: "vips[0]", kind: ErrPrerequisite, reason: "IPv4 snat_address"},
		{name: "north-south NAT IPv6 VIP, IPv6 snat_address", mutate: func(s *Service) {
			s.Exposure = ExposureNorthSouth
			s.VIPs = s.VIPs[1:]
			s.Backends = s.Backends[3:]
		}, node: nsNodeWith("2001:db8:20::20", "")},
		{name: "north-south NAT IPv6 VIP, snat_address_v6", mutate: func(s *Service) {
			s.Exposure = ExposureNorthSouth
			s.VIPs = s.VIPs[1:]
			s.Backends = s.Backends[3:]
		}, node: nsNodeWith("", "2001:db8:10::10")},
		{name: "north-south NAT IPv4 VIP, IPv4 snat_address", mutate: func(s *Service) {
			s.Exposure = ExposureNorthSouth
			s.VIPs = s.VIPs[:1]
			s.Backends = s.Backends[:3]
		}, node: nsNodeWith("203.0.113.10", "")},
		{name: "north-south NAT dual-stack", mutate: func(s *Service) { s.Exposure = ExposureNorthSouth }, node: nsNode},
		{name: "both NAT dual-stack host_routing", mutate: func(s *Service) { s.Exposure = ExposureBoth; s.HostRouting = true }, node: nsNode},
		{name: "north-south DSR needs no snat_address", mutate: func(s *Service) { s.Exposure = ExposureNorthSouth; dsr(s) }, node: nsNodeWith("", "")},
		{name: "advertise both", mutate: func(s *Service) { s.Exposure = ExposureBoth; s.Advertise = true }, node: nsNode},
		{name: "advertise north-south", mutate: func(s *Service) { s.Exposure = ExposureNorthSouth; s.Advertise = true }, node: nsNode},
		{name: "advertise north-south DSR", mutate: func(s *Service) { s.Exposure = ExposureNorthSouth; s.Advertise = true; dsr(s) }, node: nsNode},
		{name: "advertise east-west with interfaces", mutate: func(s *Service) { s.Exposure = ExposureEastWest; s.Advertise = true }, node: nsNode,
			field: "advertise", kind: ErrPrerequisite, reason: "requires exposure north-south or both"},
		{name: "advertise before missing interfaces", mutate: func(s *Service) { s.Advertise = true }, node: nsNodeWith("", ""), field: "advertise", kind: ErrPrerequisite},

		// host_routing and DSR.
		{name: "host_routing east-west nat", mutate: func(s *Service) { s.HostRouting = true }},
		{name: "host_routing explicit nat", mutate: func(s *Service) { s.HostRouting = true; s.Mode = ModeNAT }},
		{name: "host_routing dsr", mutate: func(s *Service) { s.HostRouting = true; dsr(s) }, field: "host_routing", kind: ErrPrerequisite, reason: "mode nat"},
		{name: "dsr east-west", mutate: dsr},
		{name: "dsr both", mutate: func(s *Service) { dsr(s); s.Exposure = ExposureBoth }, node: nsNode},
		{name: "dsr backend port differs", mutate: func(s *Service) { s.Mode = ModeDSR }, field: "backends[0].port", kind: ErrInvalid, reason: "DSR does not rewrite ports"},
		{name: "dsr two frontend ports", mutate: func(s *Service) { dsr(s); s.Ports = append(s.Ports, ServicePort{8443, TCP}) },
			field: "backends[0].port", kind: ErrInvalid, reason: "ports[2]"},
		{name: "dsr one backend differs", mutate: func(s *Service) { dsr(s); s.Backends[2].Port = 9090 }, field: "backends[2].port", kind: ErrInvalid},
		{name: "dsr disabled backend differs", mutate: func(s *Service) { dsr(s); s.Backends[3].Port = 9090; s.Backends[3].Enabled = ptr(false) },
			field: "backends[3].port", kind: ErrInvalid},
		{name: "dsr without backends", mutate: func(s *Service) { s.Mode = ModeDSR; s.Backends = nil }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := validService()
			tt.mutate(&s)
			var node Node
			if tt.node != nil {
				node = tt.node()
			}
			err := ValidateService(s, node)
			checkValidation(t, err, tt.field, tt.kind, tt.reason)
		})
	}
}

// checkValidation asserts that err is nil (field == "") or a
// *ValidationError of that field, kind and reason substring.
func checkValidation(t *testing.T, err error, field string, kind error, reason string) {
	t.Helper()
	if field == "" && kind == nil {
		if err != nil {
			t.Fatalf("want valid, got %v", err)
		}
		return
	}
	if err == nil {
		t.Fatalf("want an error on %q, got nil", field)
	}
	var ve *ValidationError
	if !errors.As(err, &ve) {
		t.Fatalf("error %v (%T) is not a *ValidationError", err, err)
	}
	if ve.Field != field {
		t.Errorf("field %q, want %q (error: %v)", ve.Field, field, err)
	}
	if !errors.Is(err, kind) {
		t.Errorf("error %v is not %v", err, kind)
	}
	if reason != "" && !strings.Contains(ve.Reason, reason) {
		t.Errorf("reason %q does not mention %q", ve.Reason, reason)
	}
	if !strings.Contains(err.Error(), field) {
		t.Errorf("message %q does not name the field %q", err, field)
	}
}

func manyPorts(n int) []ServicePort {
	out := make([]ServicePort, n)
	for i := range out {
		out[i] = ServicePort{Port: uint16(1000 + i), Protocol: TCP}
	}
	return out
}

func manyBackends(n int) []Backend {
	out := make([]Backend, n)
	for i := range out {
		out[i] = Backend{Address: netip.AddrFrom4([4]byte{10, 200, byte(i >> 8), byte(i)}), Port: 8080}
	}
	return out
}

func TestErrorCategories(t *testing.T) {
	for _, c := range []struct {
		err, parent error
	}{{ErrMalformed, ErrInvalid}, {ErrPrerequisite, ErrInvalid}, {ErrTooLarge, ErrLimit}} {
		if !errors.Is(c.err, c.parent) {
			t.Errorf("%v is not %v", c.err, c.parent)
		}
	}
	if errors.Is(ErrPrerequisite, ErrUnsupported) || errors.Is(ErrMalformed, ErrConflict) {
		t.Error("categories overlap")
	}
}

// TestValidateIsPure checks that validation changes nothing: not the
// service it is given (slices are shared with the caller) and not the
// configuration.
func TestValidateIsPure(t *testing.T) {
	for _, mutate := range []func(*Service){
		func(s *Service) {},
		func(s *Service) { s.Backends[2].DrainUntilUnixMs = 0 },
		func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp"} },
		func(s *Service) { s.Exposure = ExposureBoth; s.Advertise = true },
	} {
		s, want := validService(), validService()
		mutate(&s)
		mutate(&want)
		node, wantNode := nsNode(), nsNode()
		_ = ValidateService(s, node)
		_ = ValidateCatalog([]Service{s, s}, node, Limits{})
		if !reflect.DeepEqual(s, want) {
			t.Errorf("validation changed the service:\n got %+v\nwant %+v", s, want)
		}
		if !reflect.DeepEqual(node, wantNode) {
			t.Errorf("validation changed the node")
		}
	}
}

func TestUnsupportedTable(t *testing.T) {
	seen := map[string]bool{}
	for _, f := range unsupported {
		if (f.service == nil) == (f.node == nil) {
			t.Errorf("row %s: exactly one of service and node must be set", f.field)
		}
		if f.reason == "" {
			t.Errorf("row %s: no reason", f.field)
		}
		if seen[f.field] {
			t.Errorf("row %s twice", f.field)
		}
		seen[f.field] = true
	}
	// Nothing in the valid service or the zero node hits a row.
	s, n := validService(), Node{}
	for _, f := range unsupported {
		if (f.service != nil && f.service(&s)) || (f.node != nil && f.node(&n)) {
			t.Errorf("row %s rejects the valid defaults", f.field)
		}
	}
	if errs := CheckNode(Node{EDTEnabled: true}); errs != nil {
		t.Errorf("CheckNode(edt) = %v, want nil (EDT pacing is built)", errs)
	}
	if errs := CheckNode(Node{}); errs != nil {
		t.Errorf("CheckNode(zero) = %v", errs)
	}
}

func TestHealthCheckDefaults(t *testing.T) {
	got := HealthCheck{Kind: "tcp"}.WithDefaults()
	want := HealthCheck{Kind: "tcp", TimeoutMs: 1000, IntervalMs: 2000, UnhealthyThreshold: 3, HealthyThreshold: 2}
	if got != want {
		t.Errorf("WithDefaults = %+v, want %+v", got, want)
	}
	set := HealthCheck{Kind: "tcp", TimeoutMs: 7, IntervalMs: 8, UnhealthyThreshold: 9, HealthyThreshold: 10}
	if set.WithDefaults() != set {
		t.Errorf("WithDefaults changed set fields")
	}
}

func TestValidateCatalog(t *testing.T) {
	ip := netip.MustParseAddr
	big := Limits{Services: 1000, Frontends: 1000, Backends: 100000, MaglevSize: 16381}
	other := func() Service {
		s := validService()
		s.Name = "api"
		s.Ports = []ServicePort{{8443, TCP}}
		return s
	}
	tests := []struct {
		name     string
		services func() []Service
		limits   Limits
		field    string
		kind     error
		reason   string
	}{
		{name: "empty", services: func() []Service { return nil }},
		{name: "empty with zero limits", services: func() []Service { return []Service{} }, limits: Limits{}},
		{name: "two services share a VIP on other ports", services: func() []Service { return []Service{validService(), other()} }},
		{name: "same VIP and port, other protocol", services: func() []Service {
			o := other()
			o.Ports = []ServicePort{{80, UDP}}
			return []Service{validService(), o}
		}},
		{name: "invalid service", services: func() []Service {
			o := other()
			o.Backends[1].Port = 0
			return []Service{validService(), o}
		}, field: "services[1].backends[1].port", kind: ErrInvalid},
		{name: "health-checked service", services: func() []Service {
			o := other()
			o.HealthCheck = &HealthCheck{Kind: "tcp"}
			return []Service{validService(), o}
		}},
		{name: "health check of another kind in a catalog", services: func() []Service {
			o := other()
			o.HealthCheck = &HealthCheck{Kind: "udp"}
			return []Service{validService(), o}
		}, field: "services[1].health_check.kind", kind: ErrInvalid, reason: "application-aware"},
		{name: "max_egress in a catalog", services: func() []Service {
			o := other()
			o.MaxEgressMbps = 10
			return []Service{o}
		}, field: "services[0].max_egress_mbps", kind: ErrPrerequisite},
		{name: "missing prerequisite in a catalog", services: func() []Service {
			o := other()
			o.Exposure = ExposureNorthSouth
			return []Service{validService(), o}
		}, field: "services[1].exposure", kind: ErrPrerequisite},
		{name: "duplicate name", services: func() []Service {
			o := other()
			o.Name = "web"
			return []Service{validService(), o}
		}, field: "services[1].name", kind: ErrConflict, reason: "services[0]"},
		{name: "frontend used twice", services: func() []Service {
			o := other()
			o.Ports = []ServicePort{{8443, TCP}, {443, TCP}}
			return []Service{validService(), o}
		}, field: "services[1].ports[1]", kind: ErrConflict, reason: `service "web"`},
		{name: "frontend used twice on IPv6 only", services: func() []Service {
			o := other()
			o.VIPs = []netip.Addr{ip("10.96.0.99"), ip("fd00:96::10")}
			o.Ports = []ServicePort{{80, TCP}}
			return []Service{validService(), o}
		}, field: "services[1].ports[0]", kind: ErrConflict},
		// validService: 2 VIPs x 2 ports = 4 datapath services.
		{name: "services fit exactly", services: func() []Service { return []Service{validService(), other()} },
			limits: Limits{Services: 6, Frontends: 100, Backends: 1000, MaglevSize: 100}},
		{name: "services exceeded", services: func() []Service { return []Service{validService(), other()} },
			limits: Limits{Services: 5, Frontends: 100, Backends: 1000, MaglevSize: 100}, field: "services[1]", kind: ErrLimit, reason: "6 datapath services"},
		// Per family: web has 2 frontends + 1 marker, api 1 frontend (its
		// marker (VIP, tcp) is web's) = 4.
		{name: "frontends fit exactly", services: func() []Service { return []Service{validService(), other()} },
			limits: Limits{Services: 100, Frontends: 4, Backends: 1000, MaglevSize: 100}},
		{name: "frontends exceeded by a marker", services: func() []Service {
			o := other()
			o.Ports = []ServicePort{{8443, UDP}} // a new (VIP, udp) marker
			return []Service{validService(), o}
		}, limits: Limits{Services: 100, Frontends: 4, Backends: 1000, MaglevSize: 100}, field: "services[1]", kind: ErrLimit, reason: "IPv4 frontend entries"},
		{name: "IPv6 frontends exceeded", services: func() []Service {
			w := validService()
			w.VIPs = []netip.Addr{ip("10.96.0.10"), ip("fd00:96::10")}
			o := other()
			o.VIPs = []netip.Addr{ip("fd00:96::20")}
			o.Backends = o.Backends[3:]
			return []Service{w, o}
		}, limits: Limits{Services: 100, Frontends: 4, Backends: 1000, MaglevSize: 100}, field: "services[1]", kind: ErrLimit, reason: "IPv6 frontend entries"},
		// Backends: web has 3 IPv4 + 1 IPv6 backends on 2 ports: 8 entries;
		// api 4 on one port. A disabled backend takes none.
		{name: "backends fit exactly", services: func() []Service { return []Service{validService(), other()} },
			limits: Limits{Services: 100, Frontends: 100, Backends: 12, MaglevSize: 100}},
		{name: "backends exceeded", services: func() []Service { return []Service{validService(), other()} },
			limits: Limits{Services: 100, Frontends: 100, Backends: 11, MaglevSize: 100}, field: "services[1]", kind: ErrLimit, reason: "backend entries"},
		{name: "disabled backends take no entries", services: func() []Service {
			o := other()
			o.Backends[0].Enabled = ptr(false)
			return []Service{validService(), o}
		}, limits: Limits{Services: 100, Frontends: 100, Backends: 11, MaglevSize: 100}},
		{name: "disabled service keeps its frontends", services: func() []Service {
			o := other()
			o.Enabled = ptr(false)
			return []Service{validService(), o}
		}, limits: Limits{Services: 5, Frontends: 100, Backends: 1000, MaglevSize: 100}, field: "services[1]", kind: ErrLimit},
		// Eligible = ready with weight > 0: web IPv4 has 2 (one drains).
		{name: "maglev fits", services: func() []Service { return []Service{validService()} },
			limits: Limits{Services: 100, Frontends: 100, Backends: 1000, MaglevSize: 2}},
		{name: "maglev exceeded", services: func() []Service {
			w := validService()
			w.Backends[2].State, w.Backends[2].DrainUntilUnixMs = BackendReady, 0
			return []Service{w}
		}, limits: Limits{Services: 100, Frontends: 100, Backends: 1000, MaglevSize: 2}, field: "services[0].backends", kind: ErrLimit, reason: "Maglev"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			limits := tt.limits
			if limits == (Limits{}) && tt.name != "empty with zero limits" {
				limits = big
			}
			err := ValidateCatalog(tt.services(), Node{}, limits)
			checkValidation(t, err, tt.field, tt.kind, tt.reason)
			if err != nil && tt.field != "" && !strings.Contains(err.Error(), "service \"") {
				t.Errorf("error %q does not name the service", err)
			}
		})
	}
}

// TestReservedNames checks that every fixed word of the REST surface
// under /v1/network/services/ is refused as a service name, by
// ValidateService and ValidateCatalog, with ErrReservedName (an
// ErrInvalid) on the field "name", and that names merely close to one
// are not.
func TestReservedNames(t *testing.T) {
	words := []string{"advertisements", "conntrack", "flows", "ha", "health", "policies", "pressure", "snat", "stats", "status", "telemetry"}
	if got := ReservedNames(); !reflect.DeepEqual(got, words) {
		t.Errorf("ReservedNames() = %v, want %v", got, words)
	}
	for _, w := range words {
		t.Run(w, func(t *testing.T) {
			if !IsReservedName(w) {
				t.Errorf("IsReservedName(%q) = false", w)
			}
			s := validService()
			s.Name = w
			err := ValidateService(s, Node{})
			var ve *ValidationError
			if !errors.Is(err, ErrReservedName) || !errors.Is(err, ErrInvalid) || !errors.As(err, &ve) || ve.Field != "name" {
				t.Fatalf("ValidateService: %v, want ErrReservedName on name", err)
			}
			if !strings.Contains(err.Error(), fmt.Sprintf("%q is reserved", w)) || !strings.Contains(err.Error(), "/v1/network/services/"+w) {
				t.Errorf("message %q does not say why", err)
			}
			err = ValidateCatalog([]Service{s}, Node{}, tierS)
			if !errors.Is(err, ErrReservedName) || !errors.As(err, &ve) || ve.Field != "services[0].name" {
				t.Errorf("ValidateCatalog: %v, want ErrReservedName on services[0].name", err)
			}
			// A catalog restored from disk may hold it (see
			// ValidateRestoredCatalog): the other rules still apply.
			if err := ValidateRestoredCatalog([]Service{s}, Node{}, tierS, map[string]bool{w: true}); err != nil {
				t.Errorf("legacy name refused: %v", err)
			}
			s.Ports[0].Port = 0
			if err := ValidateRestoredCatalog([]Service{s}, Node{}, tierS, map[string]bool{w: true}); !errors.Is(err, ErrInvalid) || errors.Is(err, ErrReservedName) {
				t.Errorf("legacy name with a bad port: %v, want the port refused", err)
			}
		})
	}
	for _, name := range []string{"flow", "flows-v2", "statuses", "my-health", "policy", "stat"} {
		s := validService()
		s.Name = name
		if err := ValidateService(s, Node{}); err != nil || IsReservedName(name) {
			t.Errorf("%q: %v (reserved %v)", name, err, IsReservedName(name))
		}
	}
}
