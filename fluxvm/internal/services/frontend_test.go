package services

import (
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
)

// TestSvcFlags checks the frontend flags of every exposure x mode x
// host_routing, and the flags of a VIP marker shared by several frontends.
func TestSvcFlags(t *testing.T) {
	for _, tt := range []struct {
		exp  intent.Exposure
		mode intent.Mode
		hr   bool
		want uint32
	}{
		{"", "", false, 0},
		{intent.ExposureEastWest, intent.ModeNAT, false, 0},
		{intent.ExposureEastWest, intent.ModeNAT, true, bpf.SvcFlagHostRouting},
		{intent.ExposureEastWest, intent.ModeDSR, false, bpf.SvcFlagDSR},
		{intent.ExposureNorthSouth, intent.ModeNAT, false, bpf.SvcFlagNorthSouth | bpf.SvcFlagNoEastWest},
		{intent.ExposureNorthSouth, "", true, bpf.SvcFlagNorthSouth | bpf.SvcFlagNoEastWest | bpf.SvcFlagHostRouting},
		{intent.ExposureNorthSouth, intent.ModeDSR, false, bpf.SvcFlagNorthSouth | bpf.SvcFlagNoEastWest | bpf.SvcFlagDSR},
		{intent.ExposureBoth, intent.ModeNAT, false, bpf.SvcFlagNorthSouth},
		{intent.ExposureBoth, intent.ModeNAT, true, bpf.SvcFlagNorthSouth | bpf.SvcFlagHostRouting},
		{intent.ExposureBoth, intent.ModeDSR, false, bpf.SvcFlagNorthSouth | bpf.SvcFlagDSR},
	} {
		s := intent.Service{Exposure: tt.exp, Mode: tt.mode, HostRouting: tt.hr}
		if got := Flags(&s); got != tt.want {
			t.Errorf("exposure %q mode %q host_routing %v: flags %#x, want %#x", tt.exp, tt.mode, tt.hr, got, tt.want)
		}
	}

	fe := func(exp intent.Exposure, mode intent.Mode) *Frontend {
		s := intent.Service{Exposure: exp, Mode: mode, HostRouting: mode == intent.ModeNAT}
		return &Frontend{flags: Flags(&s)}
	}
	ew, ns, both, nsDSR := fe(intent.ExposureEastWest, intent.ModeNAT), fe(intent.ExposureNorthSouth, intent.ModeNAT), fe(intent.ExposureBoth, intent.ModeDSR), fe(intent.ExposureNorthSouth, intent.ModeDSR)
	const m, nsf, noEW = bpf.SvcFlagVIPMarker, bpf.SvcFlagNorthSouth, bpf.SvcFlagNoEastWest
	for _, tt := range []struct {
		name string
		fes  []*Frontend
		want uint32
	}{
		{"east-west", []*Frontend{ew}, m},
		{"north-south", []*Frontend{ns}, m | nsf | noEW},
		{"both", []*Frontend{both}, m | nsf},
		{"north-south only, two modes", []*Frontend{ns, nsDSR}, m | nsf | noEW},
		{"east-west and north-south", []*Frontend{ew, ns}, m | nsf},
		{"north-south and east-west", []*Frontend{ns, ew}, m | nsf},
		{"north-south and both", []*Frontend{ns, both}, m | nsf},
		{"none", nil, m},
	} {
		if got := markerFlags(tt.fes); got != tt.want {
			t.Errorf("%s: marker flags %#x, want %#x (never DSR or host_routing)", tt.name, got, tt.want)
		}
	}
}
