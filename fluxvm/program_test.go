package fluxvm

import (
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
)

// TestSvcFlags checks the frontend flags of every exposure x mode x
// host_routing, and the flags of a VIP marker shared by several frontends.
func TestSvcFlags(t *testing.T) {
	for _, tt := range []struct {
		exp  Exposure
		mode Mode
		hr   bool
		want uint32
	}{
		{"", "", false, 0},
		{ExposureEastWest, ModeNAT, false, 0},
		{ExposureEastWest, ModeNAT, true, bpf.SvcFlagHostRouting},
		{ExposureEastWest, ModeDSR, false, bpf.SvcFlagDSR},
		{ExposureNorthSouth, ModeNAT, false, bpf.SvcFlagNorthSouth | bpf.SvcFlagNoEastWest},
		{ExposureNorthSouth, "", true, bpf.SvcFlagNorthSouth | bpf.SvcFlagNoEastWest | bpf.SvcFlagHostRouting},
		{ExposureNorthSouth, ModeDSR, false, bpf.SvcFlagNorthSouth | bpf.SvcFlagNoEastWest | bpf.SvcFlagDSR},
		{ExposureBoth, ModeNAT, false, bpf.SvcFlagNorthSouth},
		{ExposureBoth, ModeNAT, true, bpf.SvcFlagNorthSouth | bpf.SvcFlagHostRouting},
		{ExposureBoth, ModeDSR, false, bpf.SvcFlagNorthSouth | bpf.SvcFlagDSR},
	} {
		s := Service{Exposure: tt.exp, Mode: tt.mode, HostRouting: tt.hr}
		if got := svcFlags(&s); got != tt.want {
			t.Errorf("exposure %q mode %q host_routing %v: flags %#x, want %#x", tt.exp, tt.mode, tt.hr, got, tt.want)
		}
	}

	fe := func(exp Exposure, mode Mode) *frontend {
		s := Service{Exposure: exp, Mode: mode, HostRouting: mode == ModeNAT}
		return &frontend{flags: svcFlags(&s)}
	}
	ew, ns, both, nsDSR := fe(ExposureEastWest, ModeNAT), fe(ExposureNorthSouth, ModeNAT), fe(ExposureBoth, ModeDSR), fe(ExposureNorthSouth, ModeDSR)
	const m, nsf, noEW = bpf.SvcFlagVIPMarker, bpf.SvcFlagNorthSouth, bpf.SvcFlagNoEastWest
	for _, tt := range []struct {
		name string
		fes  []*frontend
		want uint32
	}{
		{"east-west", []*frontend{ew}, m},
		{"north-south", []*frontend{ns}, m | nsf | noEW},
		{"both", []*frontend{both}, m | nsf},
		{"north-south only, two modes", []*frontend{ns, nsDSR}, m | nsf | noEW},
		{"east-west and north-south", []*frontend{ew, ns}, m | nsf},
		{"north-south and east-west", []*frontend{ns, ew}, m | nsf},
		{"north-south and both", []*frontend{ns, both}, m | nsf},
		{"none", nil, m},
	} {
		if got := markerFlags(tt.fes); got != tt.want {
			t.Errorf("%s: marker flags %#x, want %#x (never DSR or host_routing)", tt.name, got, tt.want)
		}
	}
}
