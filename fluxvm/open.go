package fluxvm

import (
	"context"
	"errors"
	"fmt"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
	"github.com/fluxvm/servicefabric/internal/bpffs"
	"github.com/fluxvm/servicefabric/nat"
)

// Open loads the datapath (adopting the pins as bpf.Open describes),
// restores the catalog, attaches the configured interfaces, publishes the
// VIP advertisements of the restored catalog and starts the health
// checks and the GC timer.
//
// The pin root (Loader.PinRoot) is the dataplane's alone from before Open
// changes anything until Close or Cleanup: Open takes an exclusive lock
// on it (bpf.LockPinRoot), and then one on the catalog's lock file
// (CatalogPath + CatalogLockSuffix, when CatalogPath is set; its
// directory must exist), and a second Open on either, in this process or
// another, fails with an error matching ErrInUse that names the holder.
// A failed Open lets it go, removing it again when Open created it and
// nothing was pinned.
//
// An Open that fails undoes what it made, the last made first, and
// returns no Dataplane: the interfaces it attached itself are detached,
// the fq it installed removed, and the catalog journal, the map handles
// and the goroutines it started closed. What an earlier start left in
// the pin root (its maps, and the attachments Open found and adopted)
// stays in place, still forwarding: a restart that fails does not take
// the running datapath down. When the pin root held no state (a first
// start), nothing is left: no attachment, no pin, and no pin root, nor
// the directories above it that Open created, nor the catalog's lock
// file. The settings Open writes into the kept meta and SNAT maps
// (timeouts, flow sample rate, HA flag, SNAT addresses and ports) are
// put back as the earlier start had them. Two limits: FluxVM's cls_bpf
// filters are found by name (fluxvm:), not through the pin root, so the
// rollback of a failed first start, like Cleanup, removes those of the
// whole network namespace (Cleanup also every fq of handle f1d0:; in
// cls_bpf mode run one dataplane per network namespace); and an interface whose role
// changed across the restart (VM edge to north-south, or back) in
// cls_bpf mode loses the earlier start's filter, which the new hook's
// replaced, when the restart fails. What cleans up after an
// earlier start stays done: the switch of adopted attachments to the new
// programs and maps (bpf Datapath.Activate; the next Open adopts those),
// its socket hooks removed from cgroups no longer configured, and its fq
// removed from interfaces no longer in edt_interfaces.
//
// ctx bounds the start: a ctx that ended before Open began makes nothing
// and fails with an error wrapping ctx's; one that ends while it loads
// (it is checked after the pin root is taken, after the maps are loaded
// and after the catalog is restored) fails it the same way, rolled back
// as any failed Open. The point of no return is the switch of the
// attachments to the new programs (bpf Datapath.Activate): from there
// Open finishes and returns the Dataplane, whatever ctx says. ctx bounds
// the start only; the Dataplane's life ends with Close.
func Open(ctx context.Context, opts Options) (_ *Dataplane, err error) {
	if err := ctxErr(ctx, "open"); err != nil {
		return nil, err
	}
	// Options validate themselves and fill their own defaults: from here
	// on each setting in force is in one field (options.go).
	if err := opts.check(optionsNames, checkAll); err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	opts = opts.WithDefaults()
	omit := opts.omitFeatures() // load-time features (features.go)
	// Socket load balancing is refused before anything is loaded or
	// attached: on a host without cgroup v2, or a cgroup_path that is not
	// a cgroup v2 directory.
	cgroupPath, err := opts.socketLBCgroup()
	if err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	hs, hl, err := newHASync(opts)
	if err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}

	// From here on every step that makes something pushes its undo; a
	// failure runs them, the last made first (the doc comment above).
	var undo undoStack
	defer func() {
		if err == nil {
			return
		}
		if uerr := undo.run(); uerr != nil {
			opts.Logger.Error("fluxvm: open: the rollback of the failed start left something behind", "err", uerr)
			err = errors.Join(err, fmt.Errorf("fluxvm: open: rollback: %w", uerr))
		}
	}()
	// What MkdirAll of the pin root will create, for a first start's
	// rollback (before the lock, which creates the pin root to hold it).
	newDirs := bpffs.MissingDirs(pinRootOf(opts.Loader))
	// The pin root is this dataplane's alone, before anything changes:
	// a second Open on it (in this process or another) fails with
	// ErrInUse. Close and Cleanup let it go; a failed Open too, removing
	// the pin root again when it made it and nothing was pinned.
	lk, err := bpf.LockPinRoot(opts.Loader)
	if err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	undo.push(lk.Abandon)
	if err := ctxErr(ctx, "open"); err != nil {
		return nil, err
	}
	// Then the catalog's lock file, as Cleanup takes them: it covers the
	// state outside bpffs (catalog, journal, HA lease) against a cleanup
	// that cannot see or hold the pin root, or names another one.
	cl, err := catalog.TakeLock(opts.CatalogPath)
	if err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	undo.push(cl.Abandon)
	// fq goes on edt_interfaces first, all or nothing.
	pacing, err := edt.New(edt.Config{
		Enabled: opts.EDT.Enabled, Horizon: opts.EDT.Horizon, ManageFQ: opts.EDT.ManageFQ,
		Interfaces: opts.EDT.Interfaces, HorizonFallback: opts.EDT.HorizonFallback,
		InNamespace: opts.InNamespace, Logger: opts.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	if err := pacing.Start(); err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	undo.push(pacing.Rollback)
	// Staged: the programs attached by an earlier process keep running on
	// their maps until the catalog is restored into the new ones (a tier
	// change or reload creates them empty); a VIP packet never meets an
	// empty frontend map and passes untranslated.
	lo := opts.Loader
	lo.Staged = true
	lo.SocketLB = opts.SocketLB.CgroupConnect
	var sizeReasons map[string]sizeReason
	lo.Sizes, sizeReasons = openSizes(&opts, hs != nil) // maps sized by need (sizing.go)
	lo.OmitFeatures = omit
	// On the pin root held: when LockPinRoot mounted bpffs, the status
	// says so (and init logs the warning that the pins vanish at exit
	// in a private mount namespace).
	dp, err := lk.Open(lo)
	if err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	first := dp.Status().Created
	undo.push(func() error {
		if !first {
			// An earlier start's state: its pins and attachments stay.
			return dp.Close()
		}
		// The pin root held nothing: all that is in it is this Open's.
		return errors.Join(opts.InNamespace(dp.Remove), bpffs.RemoveEmptyDirs(newDirs))
	})
	if err := ctxErr(ctx, "open"); err != nil {
		return nil, err
	}
	d := &Dataplane{
		opts: opts, log: opts.Logger, tracer: tracerOf(opts.TracerProvider), dp: dp, pacing: pacing, lock: lk, catLock: cl,
		services: map[string]*service{}, ifaces: map[string]*iface{}, ha: hs,
		sizing: sizingState{reason: sizeReasons},
	}
	hl.d = d // what the HA component reads of the dataplane (hasync.go)
	d.gcCtx, d.gcCancel = context.WithCancel(context.Background())
	undo.push(func() error { d.gcCancel(); return nil })
	if d.gcTimer, err = d.newGCTimer(opts.ConntrackGCInterval); err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	if d.pressure, err = d.newPressure(); err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	if d.health, err = d.newHealth(); err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	undo.push(d.health.Close)
	if d.adv, err = d.newAdvertiser(); err != nil {
		return nil, err
	}
	undo.push(d.adv.Close)
	if err := d.init(ctx, &undo); err != nil {
		return nil, err
	}
	// The last moment a cancelled Open is rolled back: Activate switches
	// the attachments of an earlier start to the new programs.
	if err := ctxErr(ctx, "open"); err != nil {
		return nil, err
	}
	if err := dp.Activate(); err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	// After Activate, so that hooks pinned by an earlier start already
	// run the new programs: AttachCgroup finds them and keeps them.
	if err := d.initSocketLB(cgroupPath, &undo); err != nil {
		return nil, err
	}
	if err := d.initRouteWatch(); err != nil {
		return nil, err
	}
	if err := d.startHA(); err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	undo.push(func() error { d.stopHA(); return nil })
	// Nothing fails from here on: the Dataplane owns what Open made.
	if st := dp.Status(); st.TierChanged || len(st.Migrations) > 0 {
		d.log.Info("fluxvm: lifecycle maps migrated", "migrated", st.Migrated, "not_migrated", st.NotMigrated, "detail", st.Migrations)
	}
	d.routes.Start()
	d.startAdvertiser()
	d.health.Start()
	d.sock.Start()
	d.gcTimer.Start()
	d.pressure.Start()
	return d, nil
}

// init restores the catalog into the loaded maps and attaches the
// configured interfaces, pushing onto undo what a failed Open must undo.
func (d *Dataplane) init(ctx context.Context, undo *undoStack) error {
	st := d.dp.Status()
	d.caps = st.Capacities
	d.limits = LimitsFor(d.caps)
	if err := d.newProgrammer(); err != nil {
		return err
	}
	if err := d.newScope(); err != nil {
		return err
	}
	switch {
	case st.MountWarning != "":
		d.log.Warn("fluxvm: " + st.MountWarning)
	case st.MountedBPFFS:
		d.log.Info("fluxvm: mounted bpffs at /sys/fs/bpf")
	}
	d.log.Info("fluxvm: datapath loaded", "pin_root", st.PinRoot, "tier", st.Tier.String(),
		"created", st.Created, "schema_rebuilt", st.SchemaRebuilt, "reloaded", st.Reloaded,
		"tier_changed", st.TierChanged, "migrated", st.Migrated, "not_migrated", st.NotMigrated)
	if st.HashSeedChanged {
		d.log.Warn("fluxvm: flow-hash seed changed: new flows pick by the new seed, established flows keep their backends",
			"hash_seed", st.HashSeed, "previous_hash_seed", st.PreviousHashSeed)
	}
	d.log.Info("fluxvm: seeds", "hash_seed", st.HashSeed, "maglev_seed", d.opts.MaglevSeed)
	d.log.Info("fluxvm: flow records", "flow_sample_rate", d.opts.FlowSampleRate)
	d.log.Info("fluxvm: datapath features loaded", "features", st.Features.String())
	if len(st.SeveredLinks) > 0 {
		d.log.Warn("fluxvm: attachments of interfaces that no longer exist were removed", "links", st.SeveredLinks)
	}

	// The settings go into the meta and SNAT maps, which a restart
	// adopts: the running datapath reads them at once. A failed Open
	// puts back what the earlier start had written (a first start's
	// maps go with it anyway).
	prev, err := d.dp.ReadMeta()
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	if err := d.dp.UpdateMeta(func(m *bpf.Meta) {
		_ = d.opts.Timeouts.ApplyTo(m)
		m.FlowSampleRate = d.opts.FlowSampleRate
		haMetaFlags(m, d.ha != nil)
	}); err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	undo.push(func() error {
		if err := d.dp.UpdateMeta(func(m *bpf.Meta) { restoreOpenMeta(m, prev) }); err != nil {
			return fmt.Errorf("restoring the earlier start's settings in the meta map: %w", err)
		}
		return nil
	})
	// The flow views work on handles of their own: a compaction
	// (compact.go) replaces the datapath's, and the views' old ones stay
	// open until no operation uses them.
	fm, err := d.cloneFlowMaps()
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	d.flowMaps = fm
	undo.push(func() error { closeMaps(d.flowMaps[:]); return nil })
	nt, err := nat.New(fm[2], fm[3])
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	d.ct, err = conntrack.New(conntrack.Config{
		CT4: fm[0], CT6: fm[1],
		Backends: d.dp.Maps().FluxvmBackends, NAT: nt, Timeouts: d.opts.Timeouts,
		Removed: d.haRemoved,
	})
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	var prevSNAT bpf.SNATConfig
	if err := d.dp.Maps().FluxvmSnat.Lookup(uint32(0), &prevSNAT); err != nil {
		return fmt.Errorf("fluxvm: open: snat config: %w", err)
	}
	if err := d.readSNATPeers(); err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	if err := d.writeSNAT(); err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	undo.push(func() error {
		if err := d.dp.Maps().FluxvmSnat.Put(uint32(0), prevSNAT); err != nil {
			return fmt.Errorf("restoring the earlier start's SNAT config: %w", err)
		}
		return nil
	})
	// The reverse translation index keeps its slot order across the
	// restore (be2fe.go).
	if err := d.seedBe2fe(); err != nil {
		return err
	}
	if err := d.openPolicies(); err != nil {
		return err
	}
	// restore opens the catalog journal (d.store), also when it fails
	// after that.
	undo.push(func() error {
		if d.store == nil {
			return nil
		}
		if err := d.store.Drop(); err != nil {
			return fmt.Errorf("catalog journal: %w", err)
		}
		return nil
	})
	if err := d.restore(); err != nil {
		return err
	}
	d.syncHA()
	if err := d.writeEDTNode(); err != nil {
		return fmt.Errorf("fluxvm: restore: %w", err)
	}
	if err := d.settleBe2fe(); err != nil {
		return fmt.Errorf("fluxvm: restore: %w", err)
	}
	// The interfaces attached so far, when a later one fails: only what
	// this Open attached itself is detached.
	undo.push(func() error {
		var errs []error
		for _, ifc := range d.ifaces {
			if err := d.detachMade(ifc); err != nil {
				errs = append(errs, fmt.Errorf("interface %s: %w", ifc.Name, err))
			}
		}
		return errors.Join(errs...)
	})
	for _, vi := range d.opts.VMEdgeInterfaces {
		if _, err := d.AddInterface(ctx, vi); err != nil {
			return err
		}
	}
	for _, name := range d.opts.NorthSouth.Interfaces {
		if _, err := d.AddNorthSouthInterface(ctx, name); err != nil {
			return err
		}
	}
	// A restored L7 policy whose proxy interface is not attached now
	// fails closed (the restore resolved it by its device alone).
	for _, name := range d.pol.ProxyNames() {
		if err := d.refreshProxies(name); err != nil {
			return fmt.Errorf("fluxvm: open: %w", err)
		}
	}
	d.allowXDPEgress("")
	return nil
}
