package bpf

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// PinnedMap opens, read-only, the map pinned now under the name of m, one
// of the datapath's maps (a field of Maps, so that a misspelt name is a
// compile error). The caller closes it.
//
// On a plain restart that is m itself, adopted from the pins. After a
// staged Open that recreated m (a generation reload, a tier change), it
// is the map of the previous generation or tier until Activate pins m in
// its place: what the programs running meanwhile read, and what the
// caller may want to carry over. It fails with an error matching
// os.ErrNotExist when nothing is pinned under that name (a fresh pin
// root), and with ErrObjectMismatch when the pinned map has another type,
// key size or value size than m (its capacity may differ).
func (d *Datapath) PinnedMap(m *ebpf.Map) (*ebpf.Map, error) {
	if d.coll == nil {
		return nil, ErrClosed
	}
	name := ""
	for n, cm := range d.coll.Maps {
		if cm == m {
			name = n
			break
		}
	}
	if m == nil || name == "" {
		return nil, errors.New("bpf: pinned map: not a map of this datapath")
	}
	pm, err := ebpf.LoadPinnedMap(filepath.Join(mapDir(d.opts.PinRoot), name), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("bpf: pinned map %s: %w", name, err)
	}
	if pm.Type() != m.Type() || pm.KeySize() != m.KeySize() || pm.ValueSize() != m.ValueSize() {
		pm.Close()
		return nil, fmt.Errorf("bpf: pinned map %s: %w", name, ErrObjectMismatch)
	}
	return pm, nil
}
