package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// GCMarkPin is the name of the conntrack GC's mark in the pin root's maps
// directory. It is a map the control plane creates, not one of the
// object's: no program reads it, and its name lacks the fluxvm_ prefix of
// the object's pins, so that the loader neither adopts it nor removes it
// as stale. A restart, a program-generation reload, a tier change and a
// compaction (which replace the object's maps) leave it in place;
// Remove deletes it with the rest of the pin root.
const GCMarkPin = "gc_mark"

// GCMark is when the conntrack GC last ran and the period its timer was
// in, kept with the pins so that the next process counts from it: a
// restart does not postpone the GC (package fluxvm, Dataplane.GC). Times
// are on the datapath's clock (Now: CLOCK_MONOTONIC_COARSE, what every
// deadline in the lifecycle maps is stamped on): it never jumps with the
// wall clock, and the pins, like the clock, do not survive a reboot.
type GCMark struct {
	// Last is when the last GC began its scan (ns, datapath clock).
	Last uint64
	// Period is the GC timer's period after that GC (ns; it adapts), and
	// Base the configured period it adapts around; both 0 when the
	// process that ran the GC had no timer.
	Period uint64
	Base   uint64
}

// gcMarkSpec is the mark's map: one 24-byte value.
func gcMarkSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{Name: "fluxvm_gc_mark", Type: ebpf.Array, KeySize: 4, ValueSize: 24, MaxEntries: 1}
}

// ErrNoGCMark: the pin root holds no GC mark (no GC has run, or no
// start has counted from, since the pins were created).
var ErrNoGCMark = errors.New("no GC mark")

func (d *Datapath) gcMarkPath() string { return filepath.Join(mapDir(d.opts.PinRoot), GCMarkPin) }

// GCMark reads the pinned GC mark. It fails with an error matching
// ErrNoGCMark when there is none, and ErrObjectMismatch when the pin is
// not a mark of this layout (SetGCMark replaces it).
func (d *Datapath) GCMark() (GCMark, error) {
	var g GCMark
	if d.coll == nil {
		return g, fmt.Errorf("bpf: gc mark: %w", ErrClosed)
	}
	m, err := ebpf.LoadPinnedMap(d.gcMarkPath(), nil)
	if errors.Is(err, os.ErrNotExist) {
		return g, fmt.Errorf("bpf: gc mark: %w", ErrNoGCMark)
	}
	if err != nil {
		return g, fmt.Errorf("bpf: gc mark: %w", err)
	}
	defer m.Close()
	if !compatible(m, gcMarkSpec()) {
		return g, fmt.Errorf("bpf: gc mark: %s is %v with %d-byte values: %w", GCMarkPin, m.Type(), m.ValueSize(), ErrObjectMismatch)
	}
	if err := m.Lookup(uint32(0), &g); err != nil {
		return g, fmt.Errorf("bpf: gc mark: %w", err)
	}
	if g == (GCMark{}) {
		// Created but never written (a writer that failed midway).
		return g, fmt.Errorf("bpf: gc mark: %w", ErrNoGCMark)
	}
	return g, nil
}

// SetGCMark writes the GC mark, pinning its map first when there is none
// (or replacing a pin of another layout).
func (d *Datapath) SetGCMark(g GCMark) error {
	if d.coll == nil {
		return fmt.Errorf("bpf: set gc mark: %w", ErrClosed)
	}
	path := d.gcMarkPath()
	m, err := ebpf.LoadPinnedMap(path, nil)
	if err == nil && !compatible(m, gcMarkSpec()) {
		m.Close()
		if err := os.Remove(path); err != nil {
			return fmt.Errorf("bpf: set gc mark: replace %s: %w", GCMarkPin, err)
		}
		err = os.ErrNotExist
	}
	if errors.Is(err, os.ErrNotExist) {
		if m, err = ebpf.NewMap(gcMarkSpec()); err != nil {
			return fmt.Errorf("bpf: set gc mark: create: %w", err)
		}
		defer m.Close()
		// Written before it is pinned: a reader never finds it empty.
		if err := m.Put(uint32(0), g); err != nil {
			return fmt.Errorf("bpf: set gc mark: %w", err)
		}
		if err := m.Pin(path); err != nil {
			return fmt.Errorf("bpf: set gc mark: pin: %w", err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("bpf: set gc mark: %w", err)
	}
	defer m.Close()
	if err := m.Put(uint32(0), g); err != nil {
		return fmt.Errorf("bpf: set gc mark: %w", err)
	}
	return nil
}
