package bpf

import (
	"errors"
	"testing"
)

func TestTierCapacities(t *testing.T) {
	want := map[Tier]Capacities{
		TierS: {Services: 256, Frontends: 1024, Backends: 4096, MaglevSize: 16381, Conntrack: 65536, NAT: 65536, Edges: 256, Sockets: 16384},
		TierM: {Services: 1024, Frontends: 4096, Backends: 16384, MaglevSize: 65537, Conntrack: 262144, NAT: 262144, Edges: 1024, Sockets: 65536},
		TierL: {Services: 4096, Frontends: 16384, Backends: 65536, MaglevSize: 131071, Conntrack: 1048576, NAT: 1048576, Edges: 4096, Sockets: 262144},
	}
	for tier, w := range want {
		spec, err := Spec(tier)
		if err != nil {
			t.Fatal(err)
		}
		got, err := CapacitiesOf(spec)
		if err != nil {
			t.Fatal(err)
		}
		if got != w {
			t.Errorf("tier %s: %+v, want %+v", tier, got, w)
		}
		// Layouts are the same in every tier: only sizes differ.
		m, _ := Spec(TierM)
		for name, ms := range spec.Maps {
			mm := m.Maps[name]
			if mm == nil || mm.Type != ms.Type || mm.KeySize != ms.KeySize || mm.ValueSize != ms.ValueSize {
				t.Errorf("tier %s: map %s differs in layout from tier M", tier, name)
			}
		}
	}
}

func TestParseTier(t *testing.T) {
	for in, want := range map[string]Tier{"S": TierS, "m": TierM, " L ": TierL} {
		if got, err := ParseTier(in); err != nil || got != want {
			t.Errorf("ParseTier(%q) = %v, %v", in, got, err)
		}
	}
	if _, err := ParseTier("XL"); !errors.Is(err, ErrUnknownTier) {
		t.Errorf("ParseTier(XL) error %v", err)
	}
	if _, err := Spec(Tier(9)); !errors.Is(err, ErrUnknownTier) {
		t.Errorf("Spec(9) error %v", err)
	}
}
