package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
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
// schema than this SDK reads (or lack a map it has).
//
// The handles belong to the View: Close them with it, never one by one,
// and never Unpin them (that would remove the running datapath's pin).
// The Maglev tables are not in Maps (a table opened from the outer map
// could be written): read one with MaglevTable.
func OpenView(root string) (*View, error) {
	if _, err := os.Stat(mapDir(root)); err != nil {
		return nil, fmt.Errorf("bpf: view %s: %w", root, err)
	}
	root, _, err := checkPinRoot(root, false)
	if err != nil {
		return nil, fmt.Errorf("bpf: view: %w", err)
	}
	spec, err := Spec(DefaultTier) // map names and layouts are the same in every tier
	if err != nil {
		return nil, err
	}
	v := &View{root: root, all: make(map[string]*ebpf.Map, len(spec.Maps))}
	for name := range spec.Maps {
		if dataSection(name) {
			continue
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(mapDir(root), name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, os.ErrNotExist) {
			// The root holds a datapath (its map directory exists)
			// that lacks a map this SDK has.
			err = fmt.Errorf("map %s not pinned: %w", name, ErrSchema)
		}
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
	v.maps.FluxvmMaglev = nil // see MaglevTable
	return v, nil
}

// MaglevTable returns a copy of the Maglev table of datapath service id
// sid (one backend id per slot), or nil when the service has none. The
// table is opened only for the copy and closed again: the kernel hands
// out inner maps writable, and a view must never write.
func (v *View) MaglevTable(sid uint32) ([]uint32, error) {
	outer := v.all["fluxvm_maglev"]
	if outer == nil {
		return nil, ErrClosed
	}
	var id ebpf.MapID
	if err := outer.Lookup(sid, &id); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("bpf: view: maglev slot %d: %w", sid, err)
	}
	inner, err := ebpf.NewMapFromID(id)
	if err != nil {
		return nil, fmt.Errorf("bpf: view: maglev table of %d: %w", sid, err)
	}
	defer inner.Close()
	out := make([]uint32, inner.MaxEntries())
	var k, val uint32
	it := inner.Iterate()
	for it.Next(&k, &val) {
		if int(k) < len(out) {
			out[k] = val
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("bpf: view: maglev table of %d: %w", sid, err)
	}
	return out, nil
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
