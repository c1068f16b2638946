package fluxvm

import (
	"errors"
	"fmt"
	"maps"
	"os"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
)

// The reverse translation index, fluxvm_be2fe: which frontends list each
// backend endpoint, in a stable slot order, and which frontends are past
// the map's slots (SvcFlagRevStored). Its rules and its model are the
// services component's (fluxvm/internal/services, reverse.go;
// docs/architecture.md, "Reverse translation index"); the facade gives
// it the index pinned at Open, and the map as the restore left it.

// seedBe2fe starts the index from the one pinned now, before restore
// programs the catalog (ReverseIndex.Seed): after a generation reload or
// a tier change the pin is still the previous map until Activate. A pin
// of another layout, or of another schema, is ignored.
func (d *Dataplane) seedBe2fe() error {
	st := d.dp.Status()
	if st.Created || st.SchemaRebuilt {
		return nil
	}
	pm, err := d.dp.PinnedMap(d.dp.Maps().FluxvmBe2fe)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil
	case errors.Is(err, bpf.ErrObjectMismatch):
		d.log.Warn("fluxvm: the pinned reverse translation index has another layout; its order is not carried over", "err", err)
		return nil
	case err != nil:
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	defer pm.Close()
	pinned, err := readBe2fe(pm)
	if err != nil {
		return fmt.Errorf("fluxvm: open: read the pinned reverse translation index: %w", err)
	}
	d.prog.Seed(maps.All(pinned))
	return nil
}

// settleBe2fe ends the restore (Programmer.Settle).
func (d *Dataplane) settleBe2fe() error {
	have, err := readBe2fe(d.dp.Maps().FluxvmBe2fe)
	if err != nil {
		return fmt.Errorf("reverse translation index: %w", err)
	}
	return d.prog.Settle(have)
}

// readBe2fe reads every entry of an index map.
func readBe2fe(m *ebpf.Map) (map[bpf.Be2feKey]bpf.Be2feValue, error) {
	var (
		k   bpf.Be2feKey
		v   bpf.Be2feValue
		out = map[bpf.Be2feKey]bpf.Be2feValue{}
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	return out, it.Err()
}
