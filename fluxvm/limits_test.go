package fluxvm

import (
	"errors"
	"fmt"
	"net/netip"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
)

func TestLimitsFor(t *testing.T) {
	got := LimitsFor(bpf.Capacities{Services: 256, Frontends: 1024, Backends: 4096, MaglevSize: 16381, Conntrack: 1, NAT: 1})
	want := Limits{Services: 255, Frontends: 1024, Backends: 4095, MaglevSize: 16381}
	if got != want {
		t.Errorf("LimitsFor = %+v, want %+v", got, want)
	}
	if got := LimitsFor(bpf.Capacities{}); got != (Limits{}) {
		t.Errorf("LimitsFor(zero) = %+v", got)
	}
	for _, tier := range []bpf.Tier{bpf.TierS, bpf.TierM, bpf.TierL} {
		l, err := LimitsForTier(tier)
		if err != nil {
			t.Fatal(err)
		}
		spec, err := bpf.Spec(tier)
		if err != nil {
			t.Fatal(err)
		}
		c, err := bpf.CapacitiesOf(spec)
		if err != nil {
			t.Fatal(err)
		}
		if l != LimitsFor(c) || l.Services <= 0 || l.Backends <= 0 || l.Frontends <= 0 || l.MaglevSize <= 0 {
			t.Errorf("tier %s: limits %+v from capacities %+v", tier, l, c)
		}
	}
	if _, err := LimitsForTier(0); err == nil {
		t.Error("LimitsForTier(0) succeeded")
	}
}

// TestValidateCatalogTierM fills tier M with services of one VIP and one
// port each, up to its datapath service limit, and one more.
func TestValidateCatalogTierM(t *testing.T) {
	limits, err := LimitsForTier(bpf.TierM)
	if err != nil {
		t.Fatal(err)
	}
	mk := func(n int) []Service {
		out := make([]Service, n)
		for i := range out {
			out[i] = Service{
				Name:     fmt.Sprintf("svc-%d", i),
				VIPs:     []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})},
				Ports:    []ServicePort{{Port: 80, Protocol: TCP}},
				Backends: []Backend{{Address: netip.MustParseAddr("10.200.1.2"), Port: 8080}},
			}
		}
		return out
	}
	if err := ValidateCatalog(mk(limits.Services), DefaultConfig(), limits); err != nil {
		t.Fatalf("%d services: %v", limits.Services, err)
	}
	err = ValidateCatalog(mk(limits.Services+1), DefaultConfig(), limits)
	var ve *ValidationError
	if !errors.Is(err, ErrLimit) || !errors.As(err, &ve) || ve.Field != fmt.Sprintf("services[%d]", limits.Services) {
		t.Fatalf("%d services: %v, want ErrLimit on services[%d]", limits.Services+1, err, limits.Services)
	}
}

// TestTierSLimits: package intent's tests use tier S's limits as
// literals; they must still be the tier's.
func TestTierSLimits(t *testing.T) {
	l, err := LimitsForTier(bpf.TierS)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Limits{Services: 255, Frontends: 1024, Backends: 4095, MaglevSize: 16381}); l != want {
		t.Errorf("tier S limits %+v, intent's tests assume %+v", l, want)
	}
}

// TestConfigNode: Config.Node maps the configuration keys intent
// validation depends on, and the wrappers pass it, so that ValidateService
// with a Config decides as intent.ValidateService with its Node.
func TestConfigNode(t *testing.T) {
	ip := netip.MustParseAddr
	tests := []struct {
		name        string
		snat, snat6 string
		want        intent.Node
	}{
		{name: "none", want: intent.Node{NorthSouth: true}},
		{name: "IPv4 snat_address", snat: "203.0.113.10", want: intent.Node{NorthSouth: true, SNAT4: ip("203.0.113.10")}},
		{name: "IPv6 snat_address", snat: "2001:db8::10", want: intent.Node{NorthSouth: true, SNAT6: ip("2001:db8::10")}},
		{name: "both", snat: "203.0.113.10", snat6: "2001:db8::10", want: intent.Node{NorthSouth: true, SNAT4: ip("203.0.113.10"), SNAT6: ip("2001:db8::10")}},
		{name: "snat_address_v6 only", snat6: "2001:db8::10", want: intent.Node{NorthSouth: true, SNAT6: ip("2001:db8::10")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultConfig()
			c.NorthSouthInterfaces = []string{"eth0"}
			if tt.snat != "" {
				c.SNATAddress = ip(tt.snat)
			}
			if tt.snat6 != "" {
				c.SNATAddressV6 = ip(tt.snat6)
			}
			if got := c.Node(); got != tt.want {
				t.Errorf("Node() = %+v, want %+v", got, tt.want)
			}
			s := Service{Name: "web", Exposure: ExposureNorthSouth, VIPs: []netip.Addr{ip("10.96.0.10"), ip("fd00:96::10")},
				Ports: []ServicePort{{Port: 80, Protocol: TCP}}}
			got, want := ValidateService(s, c), intent.ValidateService(s, tt.want)
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("ValidateService = %v, intent.ValidateService = %v", got, want)
			}
		})
	}
	if dc := DefaultConfig(); dc.Node() != (intent.Node{}) {
		t.Errorf("DefaultConfig().Node() = %+v, want the zero Node", dc.Node())
	}
	c := DefaultConfig()
	c.EDTEnabled = true
	if !c.Node().EDTEnabled {
		t.Error("edt_enabled not mapped")
	}
	// The re-exported categories are intent's values.
	for _, p := range [][2]error{{ErrInvalid, intent.ErrInvalid}, {ErrLimit, intent.ErrLimit}, {ErrConflict, intent.ErrConflict},
		{ErrUnsupported, intent.ErrUnsupported}, {ErrMalformed, intent.ErrMalformed}, {ErrTooLarge, intent.ErrTooLarge}} {
		if p[0] != p[1] {
			t.Errorf("%v is not intent's", p[0])
		}
	}
}
