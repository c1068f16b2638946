package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// ErrSchema: the pins were written by another BPF schema than this SDK's.
var ErrSchema = errors.New("pinned maps are of another schema")

// View is a read-only look at the maps a datapath pinned under its root:
// what a CLI or a second tool uses to read flows, statistics and services
// while the datapath runs, without loading programs or touching pins and
// attachments. Its map handles are read-only (BPF_F_RDONLY): lookups and
// iteration work, every write fails.
type View struct {
	root string
	maps Maps
	all  map[string]*ebpf.Map
	meta Meta
}

// OpenView opens the maps pinned under root (the PinRoot of a Datapath)
// read-only. It fails with an error matching os.ErrNotExist when root
// holds no datapath, and with ErrSchema when its pins are of another
// schema than this SDK reads.
func OpenView(root string) (*View, error) {
	root, _, err := checkPinRoot(root, false)
	if err != nil {
		return nil, err
	}
	spec, err := Spec(DefaultTier) // map names and layouts are the same in every tier
	if err != nil {
		return nil, err
	}
	v := &View{root: root, all: make(map[string]*ebpf.Map, len(spec.Maps))}
	for name := range spec.Maps {
		m, err := ebpf.LoadPinnedMap(filepath.Join(mapDir(root), name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			v.Close()
			return nil, fmt.Errorf("bpf: view %s: %w", root, err)
		}
		v.all[name] = m
	}
	mm := v.all["fluxvm_meta"]
	if mm.ValueSize() != uint32(binary.Size(v.meta)) {
		v.Close()
		return nil, fmt.Errorf("bpf: view %s: meta map of %d bytes: %w", root, mm.ValueSize(), ErrSchema)
	}
	if err := mm.Lookup(uint32(0), &v.meta); err != nil {
		v.Close()
		return nil, fmt.Errorf("bpf: view %s: meta: %w", root, err)
	}
	if v.meta.SchemaVersion != SchemaVersion {
		v.Close()
		return nil, fmt.Errorf("bpf: view %s: schema %d, this SDK reads %d: %w", root, v.meta.SchemaVersion, SchemaVersion, ErrSchema)
	}
	if err := assignNamed(&v.maps, v.all, nil); err != nil {
		v.Close()
		return nil, fmt.Errorf("bpf: view %s: %w", root, err)
	}
	return v, nil
}

// Maps returns the pinned maps, typed, read-only.
func (v *View) Maps() *Maps { return &v.maps }

// Meta returns the meta entry as OpenView read it: schema, program
// generation, tier, flow-hash seed, timeouts.
func (v *View) Meta() Meta { return v.meta }

// Close releases the view's map handles; the datapath is not affected.
func (v *View) Close() error {
	var errs []error
	for _, m := range v.all {
		errs = append(errs, m.Close())
	}
	v.all, v.maps = nil, Maps{}
	return errors.Join(errs...)
}
