package fluxvm

import (
	"fmt"

	"github.com/fluxvm/servicefabric/bpf"
)

// LimitsFor returns the limits of an object with capacities c. Service
// and backend id 0 mean "none" in the maps and are never allocated, so one
// of each is subtracted.
func LimitsFor(c bpf.Capacities) Limits {
	dec := func(n uint32) int {
		if n == 0 {
			return 0
		}
		return int(n) - 1
	}
	return Limits{
		Services:   dec(c.Services),
		Frontends:  int(c.Frontends),
		Backends:   dec(c.Backends),
		MaglevSize: int(c.MaglevSize),
	}
}

// LimitsForTier returns the limits of the embedded object of tier t,
// without loading anything into the kernel.
func LimitsForTier(t bpf.Tier) (Limits, error) {
	spec, err := bpf.Spec(t)
	if err != nil {
		return Limits{}, fmt.Errorf("fluxvm: limits of tier %s: %w", t, err)
	}
	c, err := bpf.CapacitiesOf(spec)
	if err != nil {
		return Limits{}, fmt.Errorf("fluxvm: limits of tier %s: %w", t, err)
	}
	return LimitsFor(c), nil
}
