package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
)

// Tier selects the map capacities the TC object is compiled with. A tier
// change needs a reload with new maps, because BPF maps cannot grow.
type Tier uint8

// The tiers (values match FLUXVM_TIER_* in fluxvm_service_maps.bpf.h).
const (
	TierS Tier = 1
	TierM Tier = 2
	TierL Tier = 3
)

// DefaultTier is used when none is configured.
const DefaultTier = TierM

// ErrUnknownTier reports a tier other than S, M or L.
var ErrUnknownTier = errors.New("unknown map tier (want S, M or L)")

// ParseTier accepts "S", "M" or "L" in either case.
func ParseTier(s string) (Tier, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "S":
		return TierS, nil
	case "M":
		return TierM, nil
	case "L":
		return TierL, nil
	}
	return 0, fmt.Errorf("bpf: tier %q: %w", s, ErrUnknownTier)
}

func (t Tier) String() string {
	switch t {
	case TierS:
		return "S"
	case TierM:
		return "M"
	case TierL:
		return "L"
	}
	return fmt.Sprintf("tier(%d)", uint8(t))
}

// Capacities are the map sizes of a tier, as compiled into its object.
type Capacities struct {
	Services   uint32 // services (Maglev tables, guards, stats)
	Frontends  uint32 // frontend entries per address family
	Backends   uint32 // backend ids
	MaglevSize uint32 // slots per Maglev table (prime)
	Conntrack  uint32 // conntrack entries per address family
	NAT        uint32 // reverse-NAT entries per address family
	Edges      uint32 // VM-edge interfaces with statistics (slot 0 unused)
	Sockets    uint32 // socket LB associations (fluxvm_sock_fwd, and as many ways back)
}

// CapacitiesOf reads the capacities from a collection spec of the TC
// object, so they always describe the object actually loaded.
func CapacitiesOf(spec *ebpf.CollectionSpec) (Capacities, error) {
	get := func(name string) (uint32, error) {
		m := spec.Maps[name]
		if m == nil {
			return 0, fmt.Errorf("bpf: object has no map %s", name)
		}
		return m.MaxEntries, nil
	}
	var c Capacities
	var err error
	for _, f := range []struct {
		dst  *uint32
		name string
	}{
		{&c.Services, "fluxvm_sguard"}, {&c.Frontends, "fluxvm_svc4"}, {&c.Backends, "fluxvm_backends"},
		{&c.Conntrack, "fluxvm_fct4"}, {&c.NAT, "fluxvm_nat4"}, {&c.Edges, "fluxvm_edge_stats"},
		{&c.Sockets, "fluxvm_sock_fwd"},
	} {
		if *f.dst, err = get(f.name); err != nil {
			return c, err
		}
	}
	mg := spec.Maps["fluxvm_maglev"]
	if mg == nil || mg.InnerMap == nil {
		return c, errors.New("bpf: object has no fluxvm_maglev table template")
	}
	c.MaglevSize = mg.InnerMap.MaxEntries
	return c, nil
}

// ObjectName is the file name of the TC object of tier t as operators
// install it (scripts/build-ebpf.sh --install).
func ObjectName(t Tier) string {
	return "fluxvm_service_tier_" + t.String() + ".bpf.o"
}

// Spec returns the collection spec of the embedded TC object of tier t.
// Each call returns a fresh copy that the caller may modify.
func Spec(t Tier) (*ebpf.CollectionSpec, error) {
	var (
		spec *ebpf.CollectionSpec
		err  error
	)
	switch t {
	case TierS:
		spec, err = loadServiceTierS()
	case TierM:
		spec, err = loadService()
	case TierL:
		spec, err = loadServiceTierL()
	default:
		return nil, fmt.Errorf("bpf: spec: %w", ErrUnknownTier)
	}
	if err != nil {
		return nil, fmt.Errorf("bpf: embedded object of tier %s: %w", t, err)
	}
	return spec, nil
}

// SpecFromDir loads the TC object of tier t from dir, for operators who
// rebuilt the objects (for example under /usr/lib/fluxvm/bpf). The object
// must have the layouts of this SDK's schema; the loader checks its maps
// against the embedded object before using it.
func SpecFromDir(dir string, t Tier) (*ebpf.CollectionSpec, error) {
	if _, err := Spec(t); err != nil {
		return nil, err
	}
	path := filepath.Join(dir, ObjectName(t))
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("bpf: object for tier %s: %w", t, err)
	}
	defer f.Close()
	spec, err := ebpf.LoadCollectionSpecFromReader(f)
	if err != nil {
		return nil, fmt.Errorf("bpf: %s: %w", path, err)
	}
	return spec, nil
}
