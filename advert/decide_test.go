package advert

import (
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
)

func TestDecide(t *testing.T) {
	vip := netip.MustParseAddr("203.0.113.10")
	good := Input{
		VIP: vip, Service: "web", Exposure: ExposureNorthSouth,
		Ports:   []Port{{Port: 443, Protocol: "tcp"}},
		Enabled: true, Advertise: true, ReadyBackends: 1,
	}
	tests := []struct {
		name       string
		mutate     func(*Input)
		advertised bool
		reason     Reason
	}{
		{"advertise, enabled, north-south, one ready backend", func(*Input) {}, true, ""},
		{"exposure both", func(in *Input) { in.Exposure = ExposureBoth }, true, ""},
		{"many ready backends", func(in *Input) { in.ReadyBackends = 7 }, true, ""},
		{"advertise=false", func(in *Input) { in.Advertise = false }, false, ReasonAdvertiseFalse},
		{"advertise=false wins over disabled and no backend", func(in *Input) {
			in.Advertise, in.Enabled, in.ReadyBackends = false, false, 0
		}, false, ReasonAdvertiseFalse},
		{"service disabled", func(in *Input) { in.Enabled = false }, false, ReasonServiceDisabled},
		{"disabled wins over no backend", func(in *Input) { in.Enabled, in.ReadyBackends = false, 0 }, false, ReasonServiceDisabled},
		{"east-west exposure", func(in *Input) { in.Exposure = ExposureEastWest }, false, ReasonNotNorthSouth},
		{"empty exposure is east-west", func(in *Input) { in.Exposure = "" }, false, ReasonNotNorthSouth},
		{"no ready backend", func(in *Input) { in.ReadyBackends = 0 }, false, ReasonNoReadyBackend},
		{"negative count is none", func(in *Input) { in.ReadyBackends = -1 }, false, ReasonNoReadyBackend},
		{"zero input withdraws", func(in *Input) { *in = Input{VIP: vip, Service: "web"} }, false, ReasonAdvertiseFalse},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := good
			in.Ports = append([]Port(nil), good.Ports...)
			tt.mutate(&in)
			e := Decide(in)
			if e.Advertised != tt.advertised || e.Reason != tt.reason {
				t.Fatalf("Decide = advertised %v reason %q, want %v %q", e.Advertised, e.Reason, tt.advertised, tt.reason)
			}
			if e.VIP != in.VIP || e.Service != in.Service || e.Exposure != in.Exposure {
				t.Fatalf("Decide copied %+v from %+v", e, in)
			}
			// Every decision is a valid entry for Publish.
			if _, err := normalize([]Entry{e}); err != nil {
				t.Fatalf("Decide result rejected by Publish: %v", err)
			}
		})
	}
}

func TestDecideCopiesPorts(t *testing.T) {
	ports := []Port{{Port: 80, Protocol: "tcp"}}
	e := Decide(Input{VIP: netip.MustParseAddr("192.0.2.1"), Service: "s", Ports: ports})
	ports[0].Port = 81
	if e.Ports[0].Port != 80 {
		t.Fatal("Decide shares the caller's Ports slice")
	}
}

// TestDecideSNAT: an SNAT address's entry is advertised exactly when the
// node announces its SNAT addresses, is a valid entry either way, and
// reads back through Decode with its kind; AdvertisedPrefixes includes it
// beside the VIPs.
func TestDecideSNAT(t *testing.T) {
	own, peer := netip.MustParseAddr("10.97.0.1"), netip.MustParseAddr("fd00:97::2")
	vip := Decide(Input{VIP: netip.MustParseAddr("10.96.0.10"), Service: "web", Exposure: ExposureNorthSouth, Enabled: true, Advertise: true, ReadyBackends: 1})
	for _, advertise := range []bool{true, false} {
		entries := []Entry{DecideSNAT(peer, KindSNATPeer, advertise), vip, DecideSNAT(own, KindSNAT, advertise)}
		for _, e := range []Entry{entries[0], entries[2]} {
			if e.Advertised != advertise || (e.Reason == "") != advertise || e.Service != SNATService {
				t.Errorf("advertise %v: %+v", advertise, e)
			}
		}
		p, err := NewPublisher(Options{Path: filepath.Join(t.TempDir(), "adv.json")})
		if err != nil {
			t.Fatal(err)
		}
		s, _, err := p.Publish(entries)
		if err != nil {
			t.Fatalf("advertise %v: %v", advertise, err)
		}
		back, err := Read(p.Path())
		if err != nil || !EqualEntries(back.Entries, s.Entries) {
			t.Fatalf("advertise %v: read back %+v, %v", advertise, back.Entries, err)
		}
		kinds := map[netip.Addr]Kind{}
		for _, e := range back.Entries {
			kinds[e.VIP] = e.Kind
		}
		if kinds[own] != KindSNAT || kinds[peer] != KindSNATPeer || kinds[vip.VIP] != KindVIP {
			t.Errorf("advertise %v: kinds %v", advertise, kinds)
		}
		want := []netip.Prefix{netip.MustParsePrefix("10.96.0.10/32")}
		if advertise {
			want = []netip.Prefix{netip.MustParsePrefix("10.96.0.10/32"), netip.MustParsePrefix("10.97.0.1/32"), netip.MustParsePrefix("fd00:97::2/128")}
		}
		if got := back.AdvertisedPrefixes(); !slices.Equal(got, want) {
			t.Errorf("advertise %v: prefixes %v, want %v", advertise, got, want)
		}
	}
}
