package bpf

import (
	"fmt"
	"reflect"

	"github.com/cilium/ebpf"
)

// Maps are the datapath's maps, one field each, as bpf2go generates them
// from the C sources (fluxvm_service_bpfel.go): FluxvmFct4 is the map
// fluxvm_fct4, and so on. Reach a map through its field, never by a name
// in a string: a map misspelt or gone from the object is then a compile
// error, not a nil map at run time.
type Maps = serviceMaps

// Programs are the datapath's programs, one field each, as bpf2go
// generates them (FluxvmFromVm is fluxvm_from_vm, and so on).
type Programs = servicePrograms

// Maps returns the loaded maps. They belong to the Datapath: never Close
// or Unpin one of them (Close the Datapath). After Close every field is
// nil. The result is a copy: CompactFlowMaps replaces the flow maps'
// handles (take them again after it); every other field stays the same
// handle for the Datapath's life.
func (d *Datapath) Maps() *Maps {
	d.live.RLock()
	defer d.live.RUnlock()
	m := d.maps
	return &m
}

// Programs returns the loaded programs (a copy, as Maps). After Close
// every field is nil.
func (d *Datapath) Programs() *Programs {
	d.live.RLock()
	defer d.live.RUnlock()
	p := d.progs
	return &p
}

// assignTyped points each field of dst (a struct of *ebpf.Map or
// *ebpf.Program fields tagged `ebpf:"name"`) at the collection's object of
// that name, leaving the collection their owner. An object the collection
// lacks is an error: the object file does not match this SDK.
func assignTyped(dst any, coll *ebpf.Collection) error {
	return assignNamed(dst, coll.Maps, coll.Programs)
}

// assignNamed is assignTyped over maps and programs by name.
func assignNamed(dst any, maps map[string]*ebpf.Map, progs map[string]*ebpf.Program) error {
	v := reflect.ValueOf(dst).Elem()
	t := v.Type()
	for i := range t.NumField() {
		name := t.Field(i).Tag.Get("ebpf")
		if name == "" {
			continue
		}
		var obj any
		switch t.Field(i).Type {
		case reflect.TypeFor[*ebpf.Map]():
			m, ok := maps[name]
			if !ok {
				return fmt.Errorf("map %s: %w", name, ErrObjectMismatch)
			}
			obj = m
		case reflect.TypeFor[*ebpf.Program]():
			p, ok := progs[name]
			if !ok {
				return fmt.Errorf("program %s: %w", name, ErrObjectMismatch)
			}
			obj = p
		default:
			continue
		}
		v.Field(i).Set(reflect.ValueOf(obj))
	}
	return nil
}
