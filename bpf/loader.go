package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/bpffs"
)

// ProgramGeneration identifies the programs of this SDK release. Pinned
// state written by an older generation keeps its lifecycle maps (conntrack
// and reverse NAT) across the reload; every other map is recreated, which
// leaves each service guard closed until the control plane reprograms it.
//
// Generation 2 added the north-south hooks (SNAT, DSR, host routing); its
// conntrack and reverse-NAT values grew at the end, and the reload carries
// generation-1 entries over zero-extended (see migrate).
//
// Generation 3 sizes each Maglev table by its backends: the inner-map
// template of fluxvm_maglev became BPF_F_INNER_MAP, which a pinned outer
// map of generation 2 does not have (its template is not visible through
// the pin, so only the generation tells), and the program reads each
// table's size from the table.
//
// Generation 4 derives the reverse translation of east-west flows from
// their conntrack entry, found through the new fluxvm_be2fe index: new
// east-west flows learn no reverse-NAT half (CTFlagRevDerived). Flows
// learned by generation 3 keep their halves: their replies are found
// through the index, or by the half when the conntrack entry was evicted,
// and the GC collects the halves with the flows.
//
// Generation 5 adds identity policy (fluxvm_spol, fluxvm_sid4/6): a
// conntrack value grew at the end by the policy revision its flow was
// admitted under (0 for flows carried over: a flow of a service with a
// policy is decided again at its next packet), and a frontend with
// SvcFlagPolicy drops until its policy's header is written (fail closed).
//
// Generation 6 adds L7 enforce (SvcFlagL7, PolicyFlagL7): the conntrack
// value's last word became the proxy interface of CTFlagL7 flows (zero in
// every entry carried over), the counters array grew by two and the
// per-service statistics by the policy and L7 counts (96 bytes).
const ProgramGeneration = 6

// socketMapsOff is the size of the socket LB maps while socket LB is off.
const socketMapsOff = 64

// DefaultPinRoot is the pin root a node uses unless told otherwise.
const DefaultPinRoot = "/sys/fs/bpf/fluxvm/service"

// LifecycleMaps hold flow state that must survive program reloads,
// upgrades and daemon restarts: conntrack, reverse NAT, and socket load
// balancing's associations (a UDP socket's backend, and the way back to
// the VIP that its receives and getpeername show). The socket maps' values
// carry no last-seen time: Activate catches up every entry the new maps
// lack (catchUpAbsent).
var LifecycleMaps = []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6", "fluxvm_sock_fwd", "fluxvm_sock_rev"}

// Errors of the loader, checkable with errors.Is.
var (
	ErrPinRoot        = errors.New("invalid pin root")
	ErrObjectMismatch = errors.New("object does not match this SDK's map layouts")
	ErrClosed         = errors.New("datapath is closed")
)

// Options configure Open. The zero value loads the embedded tier M object
// under DefaultPinRoot.
type Options struct {
	// PinRoot is the directory on bpffs that this datapath owns. Nothing
	// outside it is ever created or removed. Default DefaultPinRoot.
	PinRoot string
	// Tier selects map capacities. Default DefaultTier.
	Tier Tier
	// ObjectDir, when set, loads the object from this directory
	// (ObjectName(tier)) instead of the embedded one.
	ObjectDir string
	// HashSeed seeds the datapath's flow hash, which picks the Maglev
	// slot of a new flow. Open writes it to the meta map every time,
	// also over a different seed found in the pins (Status reports
	// that): a change moves only new flows, since established ones keep
	// their backends through conntrack. 0, the default, is a seed like
	// any other: nodes that must pick the same backends for the same
	// flows (an HA pair) agree by default, or by configuring one value
	// on all of them. The datapath folds it to 32 bits (low half XOR
	// high half).
	HashSeed uint64
	// AttachMode forces TCX or cls_bpf; empty picks TCX where the kernel
	// has it.
	AttachMode AttachMode
	// MountBPFFS lets Open mount a BPF filesystem at /sys/fs/bpf when the
	// machine has none there (a fresh VM, a minimal container). Without
	// it, a pin root below an unmounted /sys/fs/bpf is an error
	// (ErrPinRoot) that says so: mounting changes the machine, which a
	// library does only when asked. The reference daemon asks.
	MountBPFFS bool
	// SocketLB sizes the socket load-balancing maps (fluxvm_sock_fwd,
	// fluxvm_sock_rev) for the tier. Without it they get a token size
	// (socketMapsOff entries): an LRU map is preallocated, and at tier L
	// the two would hold ~50 MB that nothing uses. Turning it on later
	// resizes them at that Open (they are lifecycle maps: what they held
	// is carried over).
	SocketLB bool
	// Staged leaves whatever runs now running until Activate: the pinned
	// attachments keep their programs, and those programs keep the maps
	// they were loaded with, while the caller writes its state into the
	// new maps (a tier change or generation reload creates them empty).
	// Without it Open activates at once, and after a reload or tier
	// change the attached hooks run on empty service maps until the
	// caller has written them: VIP packets pass untranslated meanwhile.
	Staged bool
	// Sizes loads the maps of SizedMaps it gives a size with that many
	// entries (fluxvm_haq: bytes) instead of the tier's capacity, which
	// stays their ceiling (sizing.go): a token size for a map nothing can
	// use yet, grown later by GrowFlowMaps. A pinned conntrack or
	// reverse-NAT map larger than the size given that holds entries is
	// kept (up to the ceiling): no map shrinks below what it held. The
	// zero value loads every map at the tier's capacity. A fluxvm_sflows
	// below its capacity needs FeatureFlowRecords in OmitFeatures
	// (Sizes.FlowSlots), or Open fails with ErrMapSize.
	Sizes Sizes
	// OmitFeatures are the node-level features (Features) left out of
	// the loaded programs: not verified, no cost per packet, and no
	// effect whatever the maps say. The zero value omits none: every
	// feature is loaded and switched at run time as before (the meta
	// map's HA flag and flow sample rate, the services' pacing), so an
	// embedder who sets nothing loses nothing. Turning one on again is
	// a new Open (Staged keeps the flows); package fluxvm omits every
	// feature its configuration does not use (features.go).
	OmitFeatures Features
}

// Status says what Open found in the pin root and what it did.
type Status struct {
	PinRoot       string
	SchemaVersion uint32
	Generation    uint32
	Tier          Tier
	Capacities    Capacities
	// Created: the pin root held no state; everything is new.
	Created bool
	// SchemaRebuilt: the pins had another (or no readable) schema and the
	// owned root was rebuilt. PreviousSchema is 0 when it was unreadable.
	SchemaRebuilt  bool
	PreviousSchema uint32
	// Reloaded: the pins came from another program generation; lifecycle
	// maps were kept and every other map recreated.
	Reloaded           bool
	PreviousGeneration uint32
	// TierChanged: the maps were recreated at the new tier's capacities,
	// and the lifecycle maps' entries migrated into them.
	TierChanged  bool
	PreviousTier Tier
	// Migrated and NotMigrated total Migrations: the entries now in the
	// new lifecycle maps, and those that did not fit.
	Migrated    int
	NotMigrated int
	// Migrations details each lifecycle map that was migrated (a tier
	// change, or a generation whose layouts grew).
	Migrations []Migration
	// HashSeed is the flow-hash seed in the meta map (Options.HashSeed).
	// HashSeedChanged: the adopted pins held another seed,
	// PreviousHashSeed; new flows now pick by HashSeed, established ones
	// keep their backends.
	HashSeed         uint64
	HashSeedChanged  bool
	PreviousHashSeed uint64
	// KeptMaps and NewMaps name the maps reused from the pins and the maps
	// created by this Open.
	KeptMaps, NewMaps []string
	// Features are the node-level features the loaded programs hold
	// (Options.OmitFeatures left out of AllFeatures).
	Features Features
	// FrontendIndex is what Open's rebuild of the IPv4 frontend index
	// found (feindex.go).
	FrontendIndex FrontendIndexStats
	// Links lists the pinned attachments whose program was updated.
	Links []string
	// SeveredLinks lists pinned attachments whose interface no longer
	// exists (a VM's tap removed while no process ran); their pins were
	// removed.
	SeveredLinks []string
	// MountedBPFFS: there was no bpffs at /sys/fs/bpf and Open mounted
	// one. If this process runs in a private mount namespace (as under
	// `ip netns exec`), the pins go away with it; run the daemon in the
	// host's mount namespace to keep state across restarts.
	MountedBPFFS bool
	// MountWarning, when Open mounted bpffs in a mount namespace that is
	// not the host's (PID 1's), says so: the pins vanish when the process
	// exits, and it says how to run instead (under `ip netns exec`:
	// `nsenter --net=/run/netns/NAME`). Empty otherwise.
	MountWarning string
}

// Datapath is the loaded TC object with its maps pinned under one owned
// pin root. Close releases this process's handles and leaves pins and
// attachments in place, so traffic keeps flowing while no process runs;
// Remove tears everything down.
type Datapath struct {
	opts   Options
	spec   *ebpf.CollectionSpec
	coll   *ebpf.Collection
	status Status
	// staged is what Activate still has to do; nil once active.
	staged *staged
	// mem caches the Maglev tables' memory for MapMemory.
	mem memoryCache
	// afterInnerLookup, in tests, runs in MapMemory between reading a
	// Maglev slot's table id and opening that table.
	afterInnerLookup func(slot uint32)
	// maps and progs are the collection's objects, typed (Maps,
	// Programs); the collection owns them.
	maps  Maps
	progs Programs
	// xcoll is the north-south XDP object, loaded on coll's maps, and
	// xprogs its programs, typed (XDPPrograms).
	xcoll  *ebpf.Collection
	xprogs XDPPrograms
	// ccoll is the socket load-balancing object, loaded on coll's maps,
	// and cprogs its programs, typed (ConnectPrograms).
	ccoll  *ebpf.Collection
	cprogs ConnectPrograms
	// fe writes fluxvm_svc4 and its index (feindex.go).
	fe *FrontendIndex
	// sd is the socket iterator of DestroyStaleUDPSockets (sockdestroy.go).
	sd sockDestroy
	// mc is the map iterator of MapEntries (mapcount.go).
	mc mapCounter
	// nh is the control word of the XDP next-hop cache (xdp_routes.go).
	nh nhControl
	// clsAttached: a hook was attached by cls_bpf, whose filters hold
	// their program without a link to switch (CompactFlowMaps refuses).
	clsAttached bool
	// live is held (Lock) while CompactFlowMaps switches the handles
	// (coll, xcoll, ccoll, maps, progs), and read-held by the methods that
	// run without the caller's lock: the XDP route cache's writes and
	// the socket iterator.
	live sync.RWMutex
}

// staged is the part of an Open that Activate completes.
type staged struct {
	// old holds the replaced lifecycle maps by name, still written by the
	// programs attached before Activate, for the catch-up.
	old map[string]*ebpf.Map
	// since is when the first migration pass began (datapath clock).
	since uint64
	// cls are the hooks whose cls_bpf filter of ours Attach found and
	// left running the old program: Activate replaces them (a filter
	// has no link to switch, so it is replaced in place then).
	cls map[clsHook]bool
}

// clsHook is a hook of an interface (by index) attached by cls_bpf.
type clsHook struct {
	index int
	hook  Hook
}

// Open loads the datapath, adopting or rebuilding the state in the pin
// root as Status describes. It never touches anything outside the root.
// An Open that fails removes the directories it created (the pin root,
// its maps and links directories, and those above the root), unless
// something was put in them.
func Open(opts Options) (_ *Datapath, err error) {
	if runtime.GOOS != "linux" {
		return nil, fmt.Errorf("bpf: open: the datapath needs Linux (eBPF, TC), not %s: %w", runtime.GOOS, errors.ErrUnsupported)
	}
	if opts.PinRoot == "" {
		opts.PinRoot = DefaultPinRoot
	}
	if opts.Tier == 0 {
		opts.Tier = DefaultTier
	}
	if opts.AttachMode != "" && opts.AttachMode != AttachTCX && opts.AttachMode != AttachClsBPF {
		return nil, fmt.Errorf("bpf: open: attach mode %q: %w", opts.AttachMode, ErrAttachMode)
	}
	root, mounted, err := checkPinRoot(opts.PinRoot, opts.MountBPFFS)
	if err != nil {
		return nil, err
	}
	opts.PinRoot = root
	spec, err := loadSpec(opts)
	if err != nil {
		return nil, err
	}
	if err := setFeatures(spec, opts, "TC", true); err != nil {
		return nil, err
	}
	if !opts.SocketLB {
		for _, name := range []string{"fluxvm_sock_fwd", "fluxvm_sock_rev"} {
			if m := spec.Maps[name]; m != nil {
				m.MaxEntries = socketMapsOff
			}
		}
	}
	caps, err := CapacitiesOf(spec)
	if err != nil {
		return nil, err
	}
	// Deepest first: links and maps, the root and what is above it.
	var made []string
	for _, dir := range []string{linkDir(root), mapDir(root)} {
		if len(bpffs.MissingDirs(dir)) > 0 {
			made = append(made, dir)
		}
	}
	made = append(made, bpffs.MissingDirs(root)...)
	defer func() {
		if err != nil {
			_ = bpffs.RemoveEmptyDirs(made)
		}
	}()
	for _, dir := range []string{root, mapDir(root), linkDir(root)} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("bpf: open: %w", err)
		}
	}

	st := Status{PinRoot: root, SchemaVersion: SchemaVersion, Generation: ProgramGeneration, Tier: opts.Tier, Capacities: caps,
		HashSeed: opts.HashSeed, MountedBPFFS: mounted, Features: loadedFeatures(opts)}
	if mounted {
		st.MountWarning = privateMountWarning(bpffs.MountNamespace())
	}
	pinned, prev, flowSeq, err := adoptPins(root, spec, &st)
	stg := &staged{old: map[string]*ebpf.Map{}}
	defer func() {
		for name, m := range pinned {
			if stg.old[name] != m {
				m.Close()
			}
		}
	}()
	if err != nil {
		return nil, err
	}
	if err := sizeSpec(spec, opts.Tier, opts.Sizes, loadedFeatures(opts), pinned); err != nil {
		return nil, err
	}
	closeOld := func() {
		for _, m := range stg.old {
			m.Close()
		}
	}
	if stg.since, err = monotonicCoarse(); err != nil {
		return nil, fmt.Errorf("bpf: open: %w", err)
	}

	// Build the full map set: reused pins, or new maps (not pinned until
	// the programs loaded, so a failed Open leaves the old state alone).
	maps := make(map[string]*ebpf.Map, len(spec.Maps))
	var fresh []*ebpf.Map
	closeFresh := func() {
		for _, m := range fresh {
			m.Close()
		}
		closeOld()
	}
	var create []string
	for name, ms := range spec.Maps {
		if dataSection(name) {
			continue // the collection creates it, with the features set
		}
		if m, ok := pinned[name]; ok && compatible(m, ms) {
			maps[name] = m
			continue
		}
		create = append(create, name)
	}
	// When anything is recreated, so is the meta map (its content carried
	// over by writeMeta): the running programs keep reading the old one,
	// with the old tier and seed, until Activate switches them.
	if _, kept := maps["fluxvm_meta"]; kept && len(create) > 0 {
		delete(maps, "fluxvm_meta")
		create = append(create, "fluxvm_meta")
	}
	for name := range maps {
		st.KeptMaps = append(st.KeptMaps, name)
	}
	// New maps are created, and lifecycle entries migrated into them, in
	// parallel: preallocating a tier's LRU maps is most of a tier
	// change's cost (about 0.5 s for tier M's four, one after the other).
	type created struct {
		m   *ebpf.Map
		mg  *Migration
		err error
	}
	results := make([]created, len(create))
	var wg sync.WaitGroup
	for i, name := range create {
		old, migrating := pinned[name]
		migrating = migrating && slices.Contains(LifecycleMaps, name)
		if migrating {
			stg.old[name] = old
		}
		wg.Go(func() {
			r := &results[i]
			if r.m, r.err = ebpf.NewMap(spec.Maps[name]); r.err != nil {
				r.err = fmt.Errorf("bpf: open: create %s: %w", name, r.err)
				return
			}
			if migrating {
				mg, err := migrate(name, old, r.m)
				if err != nil {
					r.err = fmt.Errorf("bpf: open: migrate %s: %w", name, err)
					return
				}
				r.mg = &mg
			}
		})
	}
	wg.Wait()
	var errs []error
	for i, r := range results {
		if r.m != nil {
			fresh = append(fresh, r.m)
			maps[create[i]] = r.m
			st.NewMaps = append(st.NewMaps, create[i])
		}
		if r.mg != nil {
			st.Migrations = append(st.Migrations, *r.mg)
			st.Migrated += r.mg.Migrated
			st.NotMigrated += r.mg.DidNotFit()
		}
		errs = append(errs, r.err)
	}
	if err := errors.Join(errs...); err != nil {
		closeFresh()
		return nil, err
	}
	if err := carryFlowSeq(maps, create, flowSeq); err != nil {
		closeFresh()
		return nil, err
	}
	slices.SortFunc(st.Migrations, func(a, b Migration) int { return strings.Compare(a.Map, b.Map) })
	slices.Sort(st.KeptMaps)
	slices.Sort(st.NewMaps)

	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: maps})
	if err != nil {
		closeFresh()
		return nil, fmt.Errorf("bpf: open: load programs: %w", err)
	}
	for _, m := range fresh {
		m.Close() // the collection holds its own references now
	}
	d := &Datapath{opts: opts, spec: spec, coll: coll, status: st, staged: stg}
	if err := errors.Join(assignTyped(&d.maps, coll), assignTyped(&d.progs, coll)); err != nil {
		d.Close()
		return nil, fmt.Errorf("bpf: open: %w", err)
	}
	// The XDP program runs on the same maps: loaded with every program
	// load (a restart, a reload, a tier change), and switched into its
	// pinned links by Activate with the TC programs.
	if d.xcoll, err = loadXDP(opts, coll); err != nil {
		d.Close()
		return nil, err
	}
	if err := assignTyped(&d.xprogs, d.xcoll); err != nil {
		d.Close()
		return nil, fmt.Errorf("bpf: open: XDP object: %w", err)
	}
	if d.ccoll, err = loadConnect(opts, coll); err != nil {
		d.Close()
		return nil, err
	}
	if err := assignTyped(&d.cprogs, d.ccoll); err != nil {
		d.Close()
		return nil, fmt.Errorf("bpf: open: socket LB object: %w", err)
	}
	if err := d.writeMeta(prev); err != nil {
		d.Close()
		return nil, err
	}
	// Before any program of this load runs: the index answers for
	// fluxvm_svc4 as it is (kept frontends, or none).
	if d.fe, err = NewFrontendIndex(d.maps.FluxvmSvc4, d.maps.FluxvmFe4); err != nil {
		d.Close()
		return nil, fmt.Errorf("bpf: open: %w", err)
	}
	if d.status.FrontendIndex, err = d.fe.Rebuild(); err != nil {
		d.Close()
		return nil, fmt.Errorf("bpf: open: %w", err)
	}
	if !opts.Staged {
		if err := d.Activate(); err != nil {
			d.Close()
			return nil, err
		}
	}
	return d, nil
}

// Activate completes a staged Open (Options.Staged): it pins the new maps
// in place of the old ones, points every pinned attachment at the new
// programs (and replaces the cls_bpf filters of ours that Attach found
// with filters of the new programs), and copies into the new lifecycle maps the flows that the old
// programs learned or changed since Open migrated them (Migration.CaughtUp).
// Until then the old programs ran on the old maps, so no packet met a
// half-written map. Activating an active datapath does nothing.
//
// If Activate fails, the attachments it did not switch keep running the
// old programs on the old maps, while the pins may already name the new
// ones; Open again to retry. That Open adopts the new pins and switches
// the rest, but the flows those old programs learned since this Open are
// not carried over: their next packets pick a backend afresh.
func (d *Datapath) Activate() error {
	if d.coll == nil {
		return ErrClosed
	}
	stg := d.staged
	if stg == nil {
		return nil
	}
	root := d.opts.PinRoot
	// What the old programs learned or changed since the migration (the
	// caller's restore took that long), copied while they still run: after
	// the switch a reply whose flow the new map lacks is not translated,
	// so the catch-up after it is left with what the last moments added.
	catch := func(since uint64) error {
		for i := range d.status.Migrations {
			mg := &d.status.Migrations[i]
			learned, changed, err := catchUp(mg.Map, stg.old[mg.Map], d.coll.Maps[mg.Map], since)
			if err != nil {
				return fmt.Errorf("bpf: activate: catch up %s: %w", mg.Map, err)
			}
			mg.CaughtUp += learned + changed
			mg.Entries += learned
			mg.Migrated += learned
			d.status.Migrated += learned
		}
		return nil
	}
	pass, err := monotonicCoarse()
	if err != nil {
		return fmt.Errorf("bpf: activate: %w", err)
	}
	if err := catch(stg.since); err != nil {
		return err
	}
	stg.since = pass
	// Pin the new maps in place of whatever stood there, so that the pins
	// name what runs once the links below are switched.
	for _, name := range d.status.NewMaps {
		path := filepath.Join(mapDir(root), name)
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("bpf: activate: replace pin %s: %w", name, err)
		}
		if err := d.coll.Maps[name].Pin(path); err != nil {
			return fmt.Errorf("bpf: activate: pin %s: %w", name, err)
		}
	}
	if err := removeStalePins(root, d.spec); err != nil {
		return err
	}
	// Programs attached by an earlier process run the old code until
	// their links are pointed at the new programs.
	if d.status.Links, d.status.SeveredLinks, err = d.updateLinks(); err != nil {
		return err
	}
	// Our cls_bpf filters that Attach found, replaced by filters of the
	// new programs.
	for h := range stg.cls {
		progName, _ := h.hook.program()
		if _, err := attachClsBPF(h.index, h.hook, d.hookProgram(h.hook), progName); err != nil {
			return fmt.Errorf("bpf: activate: %w", err)
		}
		delete(stg.cls, h)
	}
	if err := catch(stg.since); err != nil {
		return err
	}
	for _, m := range stg.old {
		m.Close()
	}
	d.staged = nil
	return nil
}

// Status reports what Open found and did.
func (d *Datapath) Status() Status { return d.status }

// Map returns the map called name (for example "fluxvm_fct4"), or nil:
// for code that goes over every map by name (memory figures, listings).
// Code that uses one particular map reaches it through Maps, typed, so
// that a misspelt or vanished map is a compile error.
func (d *Datapath) Map(name string) *ebpf.Map {
	if d.coll == nil {
		return nil
	}
	return d.coll.Maps[name]
}

// Spec returns the collection spec the datapath was loaded from. Its
// fluxvm_maglev InnerMap is the template for new Maglev tables.
func (d *Datapath) Spec() *ebpf.CollectionSpec { return d.spec }

// Close releases this process's handles. Pins and attachments stay; a
// datapath closed before Activate leaves them as Open found them.
func (d *Datapath) Close() error {
	if d.coll != nil {
		d.coll.Close()
		d.coll = nil
		d.maps, d.progs = Maps{}, Programs{}
	}
	if d.xcoll != nil {
		d.xcoll.Close()
		d.xcoll = nil
		d.xprogs = XDPPrograms{}
	}
	if d.ccoll != nil {
		d.ccoll.Close()
		d.ccoll = nil
		d.cprogs = ConnectPrograms{}
	}
	d.sd.close()
	d.mc.close()
	if d.staged != nil {
		for _, m := range d.staged.old {
			m.Close()
		}
		d.staged = nil
	}
	return nil
}

// ReadMeta returns the meta map's entry.
func (d *Datapath) ReadMeta() (Meta, error) {
	var m Meta
	mm := d.Maps().FluxvmMeta
	if mm == nil {
		return m, ErrClosed
	}
	if err := mm.Lookup(uint32(0), &m); err != nil {
		return m, fmt.Errorf("bpf: read meta: %w", err)
	}
	return m, nil
}

// UpdateMeta changes the tunable fields of the meta map (timeouts, flags)
// with f. Identity fields (schema, generation, tier, hash seed) keep their
// values whatever f does to them. Once active, switching on the HA flag
// or a flow sample rate that the loaded programs cannot honour
// (Options.OmitFeatures) is refused with ErrFeatureNotLoaded, changing
// nothing.
func (d *Datapath) UpdateMeta(f func(*Meta)) error {
	m, err := d.ReadMeta()
	if err != nil {
		return err
	}
	keep := m
	f(&m)
	m.SchemaVersion, m.ProgramGeneration, m.Tier, m.HashSeed = keep.SchemaVersion, keep.ProgramGeneration, keep.Tier, keep.HashSeed
	if err := d.checkMetaFeatures(keep, m); err != nil {
		return err
	}
	if err := d.Maps().FluxvmMeta.Put(uint32(0), m); err != nil {
		return fmt.Errorf("bpf: update meta: %w", err)
	}
	return nil
}

// writeMeta stamps schema, generation, tier and the configured hash
// seed, keeping the previous timeouts when the meta map was adopted.
func (d *Datapath) writeMeta(prev *Meta) error {
	m := Meta{}
	if prev != nil {
		m = *prev
	}
	m.SchemaVersion = SchemaVersion
	m.ProgramGeneration = ProgramGeneration
	m.Tier = uint32(d.opts.Tier)
	m.HashSeed = d.opts.HashSeed
	if err := d.maps.FluxvmMeta.Put(uint32(0), m); err != nil {
		return fmt.Errorf("bpf: write meta: %w", err)
	}
	return nil
}

func loadSpec(opts Options) (*ebpf.CollectionSpec, error) {
	embedded, err := Spec(opts.Tier)
	if err != nil {
		return nil, err
	}
	if opts.ObjectDir == "" {
		return embedded, nil
	}
	spec, err := SpecFromDir(opts.ObjectDir, opts.Tier)
	if err != nil {
		return nil, err
	}
	for name, want := range embedded.Maps {
		if dataSection(name) {
			continue // setFeatures checks the features
		}
		got := spec.Maps[name]
		if got == nil || got.Type != want.Type || got.KeySize != want.KeySize || got.ValueSize != want.ValueSize || got.MaxEntries != want.MaxEntries {
			return nil, fmt.Errorf("bpf: %s: map %s: %w", ObjectName(opts.Tier), name, ErrObjectMismatch)
		}
	}
	return spec, nil
}

// checkPinRoot makes sure root is an absolute directory strictly below a
// bpffs mount, mounting bpffs at /sys/fs/bpf on a machine without one when
// mount is set.
func checkPinRoot(root string, mount bool) (string, bool, error) {
	if !filepath.IsAbs(root) {
		return "", false, fmt.Errorf("bpf: pin root %q: %w: not absolute", root, ErrPinRoot)
	}
	root = filepath.Clean(root)
	mounted := false
	if strings.HasPrefix(root+"/", bpffs.DefaultRoot+"/") {
		if root == bpffs.DefaultRoot {
			return "", false, fmt.Errorf("bpf: pin root %q: %w: must be a directory of its own below the mount", root, ErrPinRoot)
		}
		if mount {
			var err error
			if mounted, err = bpffs.Ensure(bpffs.DefaultRoot); err != nil {
				return "", false, fmt.Errorf("bpf: pin root: %w", err)
			}
		} else if ok, err := bpffs.IsBPFFS(bpffs.DefaultRoot); err == nil && !ok {
			return "", false, fmt.Errorf("bpf: pin root %q: %w: %s", root, ErrPinRoot, noBPFFS(bpffs.MountNamespace()))
		}
	}
	parent := filepath.Dir(root)
	for {
		if _, err := os.Stat(parent); err == nil {
			break
		}
		parent = filepath.Dir(parent)
	}
	ok, err := bpffs.IsBPFFS(parent)
	if err != nil {
		return "", false, fmt.Errorf("bpf: pin root: %w", err)
	}
	if !ok {
		return "", false, fmt.Errorf("bpf: pin root %q: %w: %s is not on bpffs", root, ErrPinRoot, parent)
	}
	return root, mounted, nil
}

// mountOption names the option that lets Open mount bpffs, as bpf and
// fluxvm callers spell it.
const mountOption = "bpf.Options.MountBPFFS (fluxvm.Options.Loader.MountBPFFS)"

// noBPFFS says that /sys/fs/bpf has no BPF filesystem in the mount
// namespace ns, and what to do about it. Under `ip netns exec` (a private
// mount namespace with /sys mounted again) the host's BPF filesystem is
// only hidden: mounting one here would make the pins vanish at exit, so
// the advice is to enter the network namespace alone.
func noBPFFS(ns bpffs.Namespace) string {
	netns := "/run/netns/NAME"
	if ns.NetNS != "" {
		netns = "/run/netns/" + ns.NetNS
	}
	vanish := fmt.Sprintf("setting %s would mount one here, which vanishes, with every pin under it, when the process exits", mountOption)
	switch {
	case ns.IPNetnsExec:
		return fmt.Sprintf("no BPF filesystem is mounted at %s in this process's mount namespace: the process runs under `ip netns exec`, which gives it a private /sys that hides the host's; run it under `nsenter --net=%s` instead, which enters the network namespace only; %s",
			bpffs.DefaultRoot, netns, vanish)
	case ns.Private:
		return fmt.Sprintf("no BPF filesystem is mounted at %s in this process's mount namespace, which is not the host's: mount one at %s in the host's mount namespace, or run the process there; %s",
			bpffs.DefaultRoot, bpffs.DefaultRoot, vanish)
	}
	return fmt.Sprintf("no BPF filesystem is mounted at %s: mount one (mount -t bpf bpf %s), or let Open mount it: %s",
		bpffs.DefaultRoot, bpffs.DefaultRoot, mountOption)
}

// privateMountWarning is Status.MountWarning for a BPF filesystem Open
// mounted in the mount namespace ns: empty when that is the host's.
func privateMountWarning(ns bpffs.Namespace) string {
	if !ns.Private {
		return ""
	}
	netns := "/run/netns/NAME"
	if ns.NetNS != "" {
		netns = "/run/netns/" + ns.NetNS
	}
	how := "in the host's mount namespace"
	if ns.IPNetnsExec {
		how = fmt.Sprintf("under `nsenter --net=%s` instead of `ip netns exec`, which gives the process a private /sys", netns)
	}
	return fmt.Sprintf("the BPF filesystem mounted at %s lives in this process's mount namespace, which is not the host's: the pins, and with them the flows and the attachments, vanish when the process exits; run it %s",
		bpffs.DefaultRoot, how)
}

func mapDir(root string) string  { return filepath.Join(root, "maps") }
func linkDir(root string) string { return filepath.Join(root, "links") }

// adoptPins opens the maps pinned under root and decides, from the meta
// map, which of them may be reused. It removes pins that must not be (and
// only our own names). It returns the adoptable maps by name, the
// previous meta entry when the meta map itself is kept, and the flow
// record sequence the pinned fluxvm_flow_seq holds (0 when none).
func adoptPins(root string, spec *ebpf.CollectionSpec, st *Status) (map[string]*ebpf.Map, *Meta, uint64, error) {
	entries, err := os.ReadDir(mapDir(root))
	if err != nil {
		return nil, nil, 0, fmt.Errorf("bpf: open: %w", err)
	}
	var ours []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "fluxvm_") {
			ours = append(ours, e.Name())
		}
	}
	if len(ours) == 0 {
		st.Created = true
		return nil, nil, 0, nil
	}
	pinned := make(map[string]*ebpf.Map)
	closeAll := func() {
		for _, m := range pinned {
			m.Close()
		}
	}
	for _, name := range ours {
		m, err := ebpf.LoadPinnedMap(filepath.Join(mapDir(root), name), nil)
		if err != nil {
			continue // an unreadable pin is rebuilt below
		}
		pinned[name] = m
	}

	var prev Meta
	metaOK := false
	if mm := pinned["fluxvm_meta"]; mm != nil && mm.ValueSize() == uint32(binary.Size(prev)) {
		metaOK = mm.Lookup(uint32(0), &prev) == nil
	}
	switch {
	case !metaOK || prev.SchemaVersion != SchemaVersion:
		// Another schema: nothing is reusable. Every map is created anew
		// and Activate replaces the pins (or removes those of names this
		// schema no longer has).
		st.SchemaRebuilt = true
		if metaOK {
			st.PreviousSchema = prev.SchemaVersion
		}
		closeAll()
		return nil, nil, 0, nil
	}
	var flowSeq uint64
	if m := pinned["fluxvm_flow_seq"]; m != nil && m.ValueSize() == 8 {
		_ = m.Lookup(uint32(0), &flowSeq) // unreadable: start afresh
	}

	keep := func(name string) bool { return true }
	if prev.ProgramGeneration != ProgramGeneration {
		st.Reloaded = true
		st.PreviousGeneration = prev.ProgramGeneration
		keep = func(name string) bool { return slices.Contains(LifecycleMaps, name) }
	}
	if Tier(prev.Tier) != st.Tier {
		st.TierChanged = true
		st.PreviousTier = Tier(prev.Tier)
	}
	// The flows in the kept lifecycle maps were hashed with this seed.
	if prev.HashSeed != st.HashSeed {
		st.HashSeedChanged = true
		st.PreviousHashSeed = prev.HashSeed
	}
	for name, m := range pinned {
		if spec.Maps[name] == nil || !keep(name) {
			// Lifecycle maps stay open for migration even when their
			// size changed; everything else is recreated.
			if !slices.Contains(LifecycleMaps, name) || spec.Maps[name] == nil {
				m.Close()
				delete(pinned, name)
			}
		}
	}
	var meta *Meta
	if pinned["fluxvm_meta"] != nil && compatible(pinned["fluxvm_meta"], spec.Maps["fluxvm_meta"]) {
		meta = &prev
	}
	return pinned, meta, flowSeq, nil
}

// flowSeqSkip is how far a recreated flow record sequence starts past the
// old one: further than the old programs can count in the window between
// Open and Activate (16.7 million records), and small beside 2^32, so
// that reloads in a row do not bring the 32-bit ids round to those of
// flows an earlier generation recorded (two skips of 2^31 would: the ids
// wrap after two reloads).
const flowSeqSkip = 1 << 24

// carryFlowSeq starts a recreated fluxvm_flow_seq (a program-generation
// reload recreates every map but the lifecycle ones) past the pinned one's
// value seq. Conntrack and reverse-NAT entries keep their flows' record
// ids across a reload; a sequence restarted at 0 would hand those ids to
// new flows' records, and the kept flows would count into them.
func carryFlowSeq(maps map[string]*ebpf.Map, create []string, seq uint64) error {
	m := maps["fluxvm_flow_seq"]
	if seq == 0 || m == nil || !slices.Contains(create, "fluxvm_flow_seq") {
		return nil
	}
	if err := m.Put(uint32(0), seq+flowSeqSkip); err != nil {
		return fmt.Errorf("bpf: open: carry the flow record sequence over: %w", err)
	}
	return nil
}

// compatible reports whether a pinned map can stand in for spec as is.
// (A map-in-map's inner template is not visible through the pin; a
// mismatch there makes the program load fail loudly instead.)
func compatible(m *ebpf.Map, spec *ebpf.MapSpec) bool {
	return m.Type() == spec.Type && m.KeySize() == spec.KeySize && m.ValueSize() == spec.ValueSize &&
		m.MaxEntries() == spec.MaxEntries && m.Flags() == spec.Flags
}

func countEntries(m *ebpf.Map) (int, error) {
	n := 0
	k, v := make([]byte, m.KeySize()), make([]byte, m.ValueSize())
	it := m.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	return n, it.Err()
}
