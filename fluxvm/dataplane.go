package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"go.opentelemetry.io/otel/trace"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/advertisements"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
	flowview "github.com/fluxvm/servicefabric/fluxvm/internal/flows"
	"github.com/fluxvm/servicefabric/fluxvm/internal/gctimer"
	"github.com/fluxvm/servicefabric/fluxvm/internal/hasync"
	healthchecks "github.com/fluxvm/servicefabric/fluxvm/internal/health"
	"github.com/fluxvm/servicefabric/fluxvm/internal/policies"
	"github.com/fluxvm/servicefabric/fluxvm/internal/pressure"
	"github.com/fluxvm/servicefabric/fluxvm/internal/socklb"
	"github.com/fluxvm/servicefabric/fluxvm/internal/xdproutes"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/internal/bpffs"
	"github.com/fluxvm/servicefabric/nat"
)

// Dataplane is the node's Service Fabric: the datapath with its pinned
// maps, the catalog of services, the attached VM-edge and north-south
// interfaces, the SNAT settings and the conntrack GC. It is safe for
// concurrent use.
//
// Only Open makes a usable Dataplane. On one it did not make, a nil
// *Dataplane or a zero Dataplane{}, no method panics: every method that
// returns an error fails with one matching ErrClosed (Close and Cleanup
// too), and Status, Services, Health, Advertisements and HAStatus answer
// as for an empty dataplane: the zero Status and HAStatus, no services,
// no health-checked services, and a snapshot of generation 0 without
// entries.
type Dataplane struct {
	mu     sync.Mutex
	opts   Options
	log    *slog.Logger
	tracer trace.Tracer
	dp     *bpf.Datapath
	// routes keeps the XDP next-hop cache true (xdproutes.go); set by
	// Open, then only read.
	routes *xdproutes.Watch
	ct     *conntrack.Map
	// flowMaps are ct's own handles of fluxvm_fct4, fct6, nat4, nat6.
	// flowMu: a compaction holds it (Lock) while it replaces the flow
	// maps; GC, shedding and HA imports, which write them, hold it
	// shared (compact.go).
	flowMaps [4]*ebpf.Map
	flowMu   sync.RWMutex
	// sizing is what the maps sized by need hold and why (sizing.go);
	// under mu.
	sizing sizingState
	// ha is flow-state replication (fluxvm/internal/hasync); nil when it
	// is off.
	ha *hasync.Sync
	// importMu serializes snapshot imports while ha is nil (ha.go; with
	// HA on, the component does).
	importMu sync.Mutex
	// pressure is the map pressure controller (fluxvm/internal/pressure;
	// pressure.go), gcTimer the conntrack GC timer
	// (fluxvm/internal/gctimer; gctimer.go), told of every GC.
	pressure *pressure.Controller
	gcTimer  *gctimer.Timer
	caps     bpf.Capacities
	limits   Limits
	inner    *ebpf.MapSpec

	services  map[string]*service
	frontends map[feKey]*frontend
	markers   map[markerKey][]*frontend
	be2fe     map[bpf.Be2feKey][]be2feSlot // the reverse translation index (be2fe.go)
	sids      *idPool
	bids      *idPool
	ifaces    map[string]*iface
	pacing    *edt.Pacing // EDT pacing's node side (fluxvm/internal/edt)
	snat      bpf.SNATConfig
	revision  uint64
	lastGC    *GCResult
	scope     *flowview.Scope            // flow records, counters, VM edge slots (internal/flows; flows.go, stats.go)
	sock      *socklb.LB                 // socket load balancing (internal/socklb; socklb.go); set by Open
	health    *healthchecks.Checks       // active health checks (internal/health; health.go)
	adv       *advertisements.Advertiser // VIP advertisements (internal/advertisements; advertise.go)
	// testHealthDial, set by tests before the first check, replaces
	// dialNode for the health checks.
	testHealthDial func(ctx context.Context, network, address string) (net.Conn, error)
	pol            *policies.Enforcer // identity policies (internal/policies; policy.go)
	// polMu serialises policy changes: taken before the service locks
	// and d.mu (changePolicies).
	polMu sync.Mutex

	// legacyNames are the services restored from the catalog with a name
	// that is now reserved (ReservedNames): they keep serving and can be
	// deleted, but not applied again under that name.
	legacyNames map[string]bool

	// lock holds the pin root while the dataplane is open (Close and
	// Cleanup release it).
	lock *bpf.PinRootLock
	// catLock holds the catalog's lock file (CatalogLockSuffix) while
	// the dataplane is open; nil without a catalog.
	catLock *catalog.Lock

	// closed is set (under mu) by Close and Cleanup: every later call
	// that reads or writes a map fails with ErrClosed instead of using
	// maps being released.
	closed bool
	// gcCtx ends when Close or Cleanup begins: it cancels a GC scan in
	// progress. gcRuns counts the GCs past their open check (Add under
	// mu while open); Close waits for them before releasing the maps.
	gcCtx    context.Context
	gcCancel context.CancelFunc
	gcRuns   sync.WaitGroup

	beforeGCScan func()                           // tests: runs just before GC's scan
	afterGCScan  func()                           // tests: runs after GC's scan (whatever its outcome), before its release of ids
	beforeSwap   func(fe *frontend, flags uint32) // tests: runs in commitStart, d.mu held, just before fe's new table goes in (flags: its new ones)

	applyState // concurrent applies, the catalog's store (apply.go)
}

type feKey struct {
	vip   netip.Addr
	port  uint16
	proto uint8
}

type markerKey struct {
	vip   netip.Addr
	proto uint8
}

type service struct {
	intent    Service
	revision  uint64
	applied   time.Time
	frontends []*frontend
	fp        intent.Footprint // what it counts in d.index
	// seq is the catalog journal record of this intent (ApplyService);
	// 0 when it came from the snapshot at Open, or without a catalog.
	seq uint64
}

type frontend struct {
	key      feKey
	sid      uint32
	service  string
	backends map[netip.AddrPort]uint32
	eligible int
	size     uint32 // slots of its Maglev table in place; 0: none
	guard    bool
	flags    uint32 // SvcValue flags (svcFlags, revStoredOf)
	// live: its frontend entry is written, with flags and revision rev;
	// false until its first commit and once removeFrontend deleted it.
	live bool
	rev  uint32
	// repair: a change failed and could not put back what was there, so
	// its guard is closed until the service is programmed again
	// (failClosed).
	repair bool
	// edt is its fluxvm_edt entry as written (the departure clock aside),
	// once edtKnown (edt.go).
	edt      bpf.EDTValue
	edtKnown bool
}

// Interface kinds, as InterfaceStatus.Kind reports them.
const (
	InterfaceVMEdge     = "vm-edge"
	InterfaceNorthSouth = "north-south"
)

type iface struct {
	VMEdgeInterface // VMID is empty on a north-south interface
	kind            string
	index           int
	slot            uint32
	hooks           []HookStatus
	xdp             bpf.XDPMode // north-south: the XDP mode in force (XDPOff: none)
	xdpProblem      string      // north-south: why xdp_mode auto left XDP off
	problem         string
	// made are the hooks this Dataplane attached itself, and madeXDP its
	// XDP link, as opposed to those an earlier start attached and it
	// adopted: what the rollback of a failed Open detaches (detachMade).
	made    []bpf.Hook
	madeXDP bool
}

// keepMade carries what old (the same interface, attached before) made
// into ifc, which replaces it.
func (ifc *iface) keepMade(old *iface) {
	if old == nil {
		return
	}
	for _, h := range old.made {
		if !slices.Contains(ifc.made, h) {
			ifc.made = append(ifc.made, h)
		}
	}
	ifc.madeXDP = ifc.madeXDP || old.madeXDP
}

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
		services: map[string]*service{}, frontends: map[feKey]*frontend{},
		markers: map[markerKey][]*frontend{}, ifaces: map[string]*iface{}, ha: hs,
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
	d.inner = d.dp.Spec().Maps["fluxvm_maglev"].InnerMap
	d.sids = newIDPool(d.caps.Services)
	d.bids = newIDPool(d.caps.Backends)
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

// restoreOpenMeta puts back into m the fields Open writes from its
// options (timeouts, flow sample rate, the HA flag) as prev had them.
func restoreOpenMeta(m *bpf.Meta, prev bpf.Meta) {
	m.TimeoutTcpSynS, m.TimeoutTcpEstablishedS, m.TimeoutTcpFinS = prev.TimeoutTcpSynS, prev.TimeoutTcpEstablishedS, prev.TimeoutTcpFinS
	m.TimeoutTcpRstS, m.TimeoutUdpS = prev.TimeoutTcpRstS, prev.TimeoutUdpS
	m.FlowSampleRate = prev.FlowSampleRate
	m.Flags = m.Flags&^bpf.MetaFlagHA | prev.Flags&bpf.MetaFlagHA
}

// writeSNAT writes the SNAT addresses and port range of the configuration
// to fluxvm_snat. Without an address of a family, new north-south NAT
// flows of that family drop (snat_failed); validation keeps services that
// would need one out.
func (d *Dataplane) writeSNAT() error {
	cfg := d.opts.settings()
	v := cfg.SNATConfig()
	if err := d.dp.Maps().FluxvmSnat.Put(uint32(0), v); err != nil {
		return fmt.Errorf("snat config: %w", err)
	}
	d.snat = v
	d.log.Info("fluxvm: SNAT configured", "address_v4", cfg.SNATAddressFor(false), "address_v6", cfg.SNATAddressFor(true),
		"port_min", v.PortMin, "port_max", v.PortMax)
	return nil
}

// restore re-applies the catalog (the snapshot and its journal, package
// fluxvm/internal/catalog) with the ids it recorded. After a plain
// restart every write repeats what the adopted maps already hold; after
// a generation reload or tier change it reprograms the recreated maps. A
// journal that held changes is then compacted into the snapshot, and the
// store starts compacting in the background.
//
// A service whose name has become reserved since it was applied (the
// catalog of an older version, or edited by hand) is restored with a
// warning rather than refused: refusing would stop the node from starting
// while the datapath keeps forwarding for the service. It keeps serving,
// is listed, and can be deleted (DeleteService; REST DELETE
// /v1/network/services/{name}), but not read by name over REST nor
// applied again under that name: delete it and apply it again under
// another name.
func (d *Dataplane) restore() (err error) {
	_, span := d.startSpan(context.Background(), SpanRestore)
	defer endSpan(span, &err)
	d.index = intent.NewCatalogIndex()
	d.busy = map[string]int{}
	d.reserved = map[string]Service{}
	if d.opts.CatalogPath == "" {
		return nil
	}
	st, err := d.openCatalog()
	if err != nil {
		return err
	}
	cat, dirty, err := st.Load()
	if err != nil {
		return err
	}
	var intents []Service
	for _, cs := range cat.Services {
		intents = append(intents, cs.Service)
		if IsReservedName(cs.Service.Name) {
			if d.legacyNames == nil {
				d.legacyNames = map[string]bool{}
			}
			d.legacyNames[cs.Service.Name] = true
			d.log.Warn("fluxvm: restored a service whose name is reserved for the REST API; it keeps serving but cannot be read by name over REST or applied again: delete it and apply it again under another name",
				"service", cs.Service.Name, "catalog", d.opts.CatalogPath, "reserved", ReservedNames())
		}
	}
	if err := intent.ValidateRestoredCatalog(intents, d.opts.settings().Node(), d.limits, d.legacyNames); err != nil {
		return fmt.Errorf("fluxvm: restore catalog %s: %w", d.opts.CatalogPath, err)
	}
	for _, cs := range cat.Services {
		s := &service{intent: cs.Service, revision: cs.Revision, applied: cs.AppliedAt, fp: intent.FootprintOf(&cs.Service)}
		for _, cf := range cs.Frontends {
			if !d.sids.reserve(cf.ServiceID) {
				return fmt.Errorf("fluxvm: restore catalog: service id %d of %s: %w", cf.ServiceID, cs.Service.Name, ErrConflict)
			}
			fe := &frontend{key: feKey{cf.VIP, cf.Port, cf.Protocol.Number()}, sid: cf.ServiceID, service: cs.Service.Name, backends: map[netip.AddrPort]uint32{}}
			for _, cb := range cf.Backends {
				if !d.bids.reserve(cb.BackendID) {
					return fmt.Errorf("fluxvm: restore catalog: backend id %d of %s: %w", cb.BackendID, cs.Service.Name, ErrConflict)
				}
				fe.backends[cb.Endpoint] = cb.BackendID
			}
			d.frontends[fe.key] = fe
			s.frontends = append(s.frontends, fe)
		}
		d.services[cs.Service.Name] = s
		d.index.Add(cs.Service.Name, &s.fp)
		if cs.Revision > d.revision {
			d.revision = cs.Revision
		}
	}
	// Identity policies first: each frontend attaches its service's
	// policy before its flag goes in (readyFrontend).
	if err := d.pol.Restore(cat.Policies); err != nil {
		return fmt.Errorf("fluxvm: restore identity policies: %w", err)
	}
	for _, cs := range cat.Services {
		if err := d.program(cs.Service, d.services[cs.Service.Name]); err != nil {
			return fmt.Errorf("fluxvm: restore %s: %w", cs.Service.Name, err)
		}
	}
	// What a previous process left in the policy maps and nothing uses
	// now goes (after a plain restart the maps were kept).
	if err := d.pol.Write(); err != nil {
		return fmt.Errorf("fluxvm: restore identity policies: %w", err)
	}
	d.store = st
	if dirty {
		if err := st.Compact(); err != nil {
			return fmt.Errorf("fluxvm: restore catalog: %w", err)
		}
	}
	st.Start()
	span.SetAttributes(AttrServices.Int(len(cat.Services)))
	d.log.Info("fluxvm: catalog restored", "services", len(cat.Services), "journal_seq", cat.Seq)
	return nil
}

// markClosed sets closed and reports whether this call did (false: the
// Dataplane was closed already). It also cancels a GC scan in progress;
// stopGC then waits for it.
func (d *Dataplane) markClosed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return false
	}
	d.closed = true
	if d.gcCancel != nil {
		d.gcCancel()
	}
	return true
}

// unopened reports a Dataplane that Open did not make: a nil *Dataplane
// or a zero Dataplane{}. Every exported method asks first (opened), and
// answers as a closed Dataplane's would (see Close), without panicking.
func (d *Dataplane) unopened() bool { return d == nil || d.dp == nil }

// opened fails with an error matching ErrClosed for a Dataplane that Open
// did not make (unopened).
func (d *Dataplane) opened(op string) error {
	if d.unopened() {
		return fmt.Errorf("fluxvm: %s: the Dataplane is not open (nil, or not made by Open): %w", op, ErrClosed)
	}
	return nil
}

// checkOpen is the first thing every call that uses a map does, with mu
// held.
func (d *Dataplane) checkOpen(op string) error {
	if d.closed {
		return fmt.Errorf("fluxvm: %s: %w", op, ErrClosed)
	}
	return nil
}

// stopGC stops the GC timer and waits for every GC still running (the
// timer's or a manual one; markClosed cancelled their scans), so that no
// scan uses the maps Close releases. Call it after markClosed, without mu.
func (d *Dataplane) stopGC() {
	d.gcTimer.Close()
	d.gcRuns.Wait()
}

// Close stops the health checks and the GC timer, cancels a GC in
// progress and waits for it, publishes the last advertisements not yet
// written and stops their publisher, and releases this process's handles.
// The datapath keeps forwarding: pins and attachments stay in place, and
// so do the fq qdiscs edt_manage_fq installed (the next Open adopts them)
// and the advertisement file, as last published. Changes under way
// finish first, and the catalog journal is compacted into the catalog
// file (package fluxvm/internal/catalog). A second Close does nothing and
// returns nil.
//
// Close lets the pin root go: another Open (or the package-level
// Cleanup) may take it from then on.
//
// After Close (or Cleanup), every method that returns an error, but
// Cleanup, fails with an error matching ErrClosed and touches no map.
// Status, Services, Health and Advertisements, which read only the
// dataplane's memory, keep answering: with the state as it was at Close,
// or after Cleanup that of an empty dataplane (no services, no
// interfaces, every VIP withdrawn).
func (d *Dataplane) Close() error {
	if err := d.opened("close"); err != nil {
		return err
	}
	if !d.markClosed() {
		return nil
	}
	// Changes under way finish (and are journaled) first.
	d.inflight.Wait()
	d.health.Close()
	d.pressure.Close()
	d.stopGC()
	d.stopHA()
	d.sock.Close()
	d.routes.Close() // its only error is the close of its netlink socket
	d.adv.Close()
	d.pacing.Close()
	d.scope.Close()
	cerr := d.closeCatalog()
	// A compaction finishes first (it holds flowMu to its end).
	d.flowMu.Lock()
	defer d.flowMu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	closeMaps(d.flowMaps[:])
	return errors.Join(cerr, d.dp.Close(), d.lock.Release(), d.catLock.Release())
}

// Cleanup removes everything the dataplane owns: it stops the dataplane
// as Close does, publishes a snapshot with no advertisements, and then
// removes what the package-level Cleanup removes, with the pin root
// still held: the VM-edge, north-south, XDP and socket-hook attachments,
// the pin root (and its parents that Open created, when they are
// empty), the fq qdiscs of edt_manage_fq (on every interface of the
// node's namespace that has FluxVM's, handle f1d0:), the catalog (file and
// journal) and the HA lease file next to it (see Cleanup for why).
// The advertisement file is not removed: Cleanup publishes a snapshot with
// no entries, so that routing adapters withdraw every VIP (a missing file
// would leave them to guess); when that snapshot cannot be written,
// Cleanup still removes the rest and returns an error saying so.
//
// After Close, Cleanup does what the package-level Cleanup does with this
// dataplane's pin root, catalog and advertisement file: it takes the pin
// root again (ErrInUse if another Dataplane opened it meanwhile) and
// removes what the closed dataplane left. So does a second Cleanup, which
// then finds nothing left to remove.
//
// A ctx that ended before Cleanup begins changes nothing (the dataplane
// stays open) and fails with an error wrapping ctx's. Once it began
// (the dataplane marked closed) it is past its point of no return: it
// removes everything and finishes whatever ctx says, since a cleanup left
// half done would leave attachments running on maps no one owns.
func (d *Dataplane) Cleanup(ctx context.Context) error {
	if err := d.begin(ctx, "cleanup"); err != nil {
		return err
	}
	if !d.markClosed() {
		return Cleanup(ctx, d.cleanupOptions())
	}
	d.inflight.Wait()
	d.health.Close()
	d.pressure.Close()
	d.stopGC()
	d.stopHA()
	d.sock.Close()
	d.routes.Close() // its only error is the close of its netlink socket
	d.adv.Submit([]advert.Entry{})
	d.adv.Close()
	d.pacing.Close()
	d.scope.Close()
	var errs []error
	if d.store != nil {
		d.store.Drop()
	}
	// The goroutine's last publish only logs a failure; try once more
	// here, so that Cleanup fails when adapters were not told to withdraw.
	if err := d.adv.Flush(); err != nil {
		errs = append(errs, fmt.Errorf("advertisements: the empty snapshot that withdraws every VIP was not published: %w", err))
	}
	d.flowMu.Lock()
	defer d.flowMu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	closeMaps(d.flowMaps[:])
	errs = append(errs, d.dp.Close(), removeState(d.cleanupOptions()), d.catLock.Remove(), d.lock.Release())
	// What Status, Services and Health report from now on: nothing is
	// left.
	d.services, d.frontends, d.markers, d.ifaces = map[string]*service{}, map[feKey]*frontend{}, map[markerKey][]*frontend{}, map[string]*iface{}
	d.be2fe = map[bpf.Be2feKey][]be2feSlot{}
	d.sock.Removed()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("fluxvm: cleanup: %w", err)
	}
	return nil
}

// hooksOf returns the hooks of an interface kind.
func hooksOf(kind string) []bpf.Hook {
	if kind == InterfaceNorthSouth {
		return []bpf.Hook{bpf.HookNSIn, bpf.HookNSOut}
	}
	return []bpf.Hook{bpf.HookFromVM, bpf.HookToVM}
}

// AddInterface attaches the VM-edge programs to a VM's host-side
// interface. It is idempotent. An interface that is attached as a
// north-south interface is a conflict (ErrConflict); one the node's
// namespace does not have is ErrNotFound (and bpf.ErrNoInterface). A call
// that fails leaves the interface as it found it: the hooks it attached
// are detached, those attached before it stay. An L7 proxy interface
// attached again with another index (its veth recreated) is what the
// policies that redirect to it name from then on.
//
// A ctx that ended before the hooks are attached (on entry, or while the
// call waited for the dataplane's lock) attaches nothing and fails with
// an error wrapping ctx's; once attaching, the call finishes.
func (d *Dataplane) AddInterface(ctx context.Context, vi VMEdgeInterface) (InterfaceStatus, error) {
	if err := d.begin(ctx, "add interface"); err != nil {
		return InterfaceStatus{}, err
	}
	st, err := d.addInterface(ctx, vi)
	if err != nil {
		return st, err
	}
	if err := d.refreshProxies(vi.Name); err != nil {
		return st, fmt.Errorf("fluxvm: add interface %s: attached, but the L7 policies that redirect to it were not updated: %w", vi.Name, err)
	}
	return st, nil
}

func (d *Dataplane) addInterface(ctx context.Context, vi VMEdgeInterface) (InterfaceStatus, error) {
	if vi.Name == "" || vi.VMID == "" {
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface: %w", &ValidationError{Field: "interface", Reason: "name and vm_id are required"})
	}
	if why := ifnameProblem(vi.Name); why != "" {
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface: %w", verr(ErrInvalid, "name", "%s", why))
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("add interface"); err != nil {
		return InterfaceStatus{}, err
	}
	if err := ctxErr(ctx, "add interface "+vi.Name); err != nil {
		return InterfaceStatus{}, err
	}
	if other, ok := d.ifaces[vi.Name]; ok {
		switch {
		case other.kind != InterfaceVMEdge:
			return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface %s: it is a %s interface: %w", vi.Name, other.kind, ErrConflict)
		case other.VMID != vi.VMID:
			return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface %s: belongs to VM %s: %w", vi.Name, other.VMID, ErrConflict)
		}
	}
	ifc := &iface{VMEdgeInterface: vi, kind: InterfaceVMEdge}
	if err := d.attach(ifc); err != nil {
		return InterfaceStatus{}, ifaceError(fmt.Errorf("fluxvm: add interface %s: %w", vi.Name, err))
	}
	old := d.ifaces[vi.Name]
	if old != nil {
		ifc.slot = old.slot
	} else if err := d.registerEdge(ifc); err != nil {
		if uerr := d.detachMade(ifc); uerr != nil {
			err = errors.Join(err, uerr)
		}
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface %s: statistics: %w", vi.Name, err)
	}
	ifc.keepMade(old)
	d.ifaces[vi.Name] = ifc
	d.allowXDPEgress(vi.Name)
	d.log.Info("fluxvm: VM interface attached", "interface", vi.Name, "vm", vi.VMID, "mode", ifc.hooks[0].Mode)
	return ifc.status(), nil
}

// AddNorthSouthInterface attaches the north-south programs to one of the
// node's uplinks: ns_in on TC ingress (clients outside the node reach
// north-south VIPs; replies of remote backends to the SNAT address are
// translated back) and ns_out on TC egress (replies to the SNAT address
// that met no ingress hook of ours). It is idempotent. An interface that
// is attached as a VM edge is a conflict (ErrConflict); one the node's
// namespace does not have is ErrNotFound (and bpf.ErrNoInterface).
//
// With NorthSouth.XDPMode (xdp_mode) other than off, the north-south XDP
// program is attached too, after the TC hooks, in that mode (auto: native,
// else generic); InterfaceStatus.XDP says which mode is in force. An XDP
// program of another product on the interface fails the call with an
// error naming it (bpf.ErrForeignProgram) before anything is attached,
// and stays attached. An offload that hides VLAN tags or checksum state
// from XDP (bpf.ErrXDPOffload: the driver strips tags on receive, or a
// veth's peer keeps them beside its frames or leaves checksums to the
// receiver) fails the call as well, before anything is attached, when
// xdp_mode is native or generic (the error names the offload and the
// ethtool command that turns it off); with auto the interface gets the TC
// hooks alone, InterfaceStatus.XDP is "off" and XDPProblem says why. In
// both cases an XDP program of ours left there by an earlier start is
// detached. Should the XDP attach fail otherwise, the TC hooks
// this call attached are detached again (those attached before it, by
// this Dataplane or an earlier start, stay). With
// xdp_mode off, an XDP program of ours left by an earlier start is
// detached.
//
// The name then counts as configured in north_south_interfaces for the
// validation of services (exposure north-south or both) for the rest of
// the dataplane's life, also after RemoveInterface.
// North-south interfaces have no per-VM statistics slot.
//
// A ctx that ended before the hooks are attached (on entry, while the
// call waited for the dataplane's lock, or during the XDP checks) attaches
// nothing and fails with an error wrapping ctx's; once attaching, the
// call finishes.
func (d *Dataplane) AddNorthSouthInterface(ctx context.Context, name string) (InterfaceStatus, error) {
	if err := d.begin(ctx, "add north-south interface"); err != nil {
		return InterfaceStatus{}, err
	}
	if why := ifnameProblem(name); why != "" {
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add north-south interface: %w", verr(ErrInvalid, "name", "%s", why))
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("add north-south interface"); err != nil {
		return InterfaceStatus{}, err
	}
	if err := ctxErr(ctx, "add north-south interface "+name); err != nil {
		return InterfaceStatus{}, err
	}
	if other, ok := d.ifaces[name]; ok && other.kind != InterfaceNorthSouth {
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add north-south interface %s: it is the VM-edge interface of VM %s: %w", name, other.VMID, ErrConflict)
	}
	ifc := &iface{VMEdgeInterface: VMEdgeInterface{Name: name}, kind: InterfaceNorthSouth}
	// A foreign XDP program, and offloads that XDP would misread under
	// an explicit mode, are refused before anything is attached (auto
	// falls back to TC alone in attachXDP).
	if mode := d.xdpMode(); mode != bpf.XDPOff {
		err := d.opts.InNamespace(func() error {
			err := d.dp.CheckXDP(bpf.Interface{Name: name})
			if errors.Is(err, bpf.ErrXDPOffload) {
				if mode == bpf.XDPAuto {
					return nil
				}
				// Ours from an earlier start would misread them too.
				if derr := d.dp.DetachXDP(bpf.Interface{Name: name}); derr != nil && !errors.Is(derr, bpf.ErrNotAttached) {
					err = errors.Join(err, fmt.Errorf("detach our earlier XDP program: %w", derr))
				} else if known, ok := d.ifaces[name]; ok {
					known.xdp = bpf.XDPOff
				}
			}
			return err
		})
		if err != nil {
			return InterfaceStatus{}, ifaceError(fmt.Errorf("fluxvm: add north-south interface %s: %w", name, err))
		}
	}
	if err := ctxErr(ctx, "add north-south interface "+name); err != nil {
		return InterfaceStatus{}, err
	}
	if err := d.attach(ifc); err != nil {
		return InterfaceStatus{}, ifaceError(fmt.Errorf("fluxvm: add north-south interface %s: %w", name, err))
	}
	if err := d.attachXDP(ifc); err != nil {
		// An uplink is attached whole or not at all: the TC hooks this
		// call attached go again (those attached before it stay).
		if uerr := d.detachMade(ifc); uerr != nil {
			err = errors.Join(err, fmt.Errorf("undo the TC hooks: %w", uerr))
		}
		return InterfaceStatus{}, ifaceError(fmt.Errorf("fluxvm: add north-south interface %s: %w", name, err))
	}
	ifc.keepMade(d.ifaces[name])
	d.ifaces[name] = ifc
	if !slices.Contains(d.opts.NorthSouth.Interfaces, name) {
		d.opts.NorthSouth.Interfaces = append(slices.Clip(d.opts.NorthSouth.Interfaces), name)
	}
	if ifc.xdpProblem != "" {
		d.log.Warn("fluxvm: north-south interface attached without XDP (xdp_mode auto)", "interface", name, "mode", ifc.hooks[0].Mode, "reason", ifc.xdpProblem)
	} else {
		d.log.Info("fluxvm: north-south interface attached", "interface", name, "mode", ifc.hooks[0].Mode, "xdp", string(ifc.xdp))
	}
	return ifc.status(), nil
}

// allowXDPEgress lists the configured xdp_egress_interfaces that exist
// now as devices the XDP program may send to; one that does not exist yet
// (a VM edge that comes later) is listed when it is added. d.mu held.
func (d *Dataplane) allowXDPEgress(only string) {
	if d.xdpMode() == bpf.XDPOff {
		return
	}
	for _, n := range d.opts.NorthSouth.XDPEgress {
		if only != "" && n != only {
			continue
		}
		if err := d.opts.InNamespace(func() error { return d.dp.AllowXDPEgress(bpf.Interface{Name: n}) }); err != nil {
			d.log.Warn("fluxvm: XDP egress interface not listed (yet)", "interface", n, "err", err)
		}
	}
}

// xdpMode is the configured xdp_mode (empty: off).
func (d *Dataplane) xdpMode() bpf.XDPMode {
	if d.opts.NorthSouth.XDPMode == "" {
		return bpf.XDPOff
	}
	return d.opts.NorthSouth.XDPMode
}

// attachXDP puts the north-south XDP program on ifc in the configured
// mode and records the mode in force; with xdp_mode off it removes ours,
// if an earlier start left it there. With auto, an interface whose
// offloads XDP would misread (bpf.ErrXDPOffload) keeps TC alone: XDP off,
// the reason in ifc.xdpProblem (AttachXDP detached ours).
func (d *Dataplane) attachXDP(ifc *iface) error {
	return d.opts.InNamespace(func() error {
		mode := d.xdpMode()
		ifc.xdpProblem = ""
		if mode == bpf.XDPOff {
			ifc.xdp = bpf.XDPOff
			if err := d.dp.DetachXDP(bpf.Interface{Index: ifc.index}); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
				return err
			}
			return nil
		}
		a, err := d.dp.AttachXDP(bpf.Interface{Index: ifc.index}, mode)
		if mode == bpf.XDPAuto && errors.Is(err, bpf.ErrXDPOffload) {
			ifc.xdp, ifc.xdpProblem = bpf.XDPOff, err.Error()
			return nil
		}
		if err != nil {
			return err
		}
		ifc.xdp, ifc.madeXDP = a.Mode, !a.Reused
		return nil
	})
}

// detachHooks removes the TC programs of ifc's kind (and the XDP program
// of a north-south interface).
func (d *Dataplane) detachHooks(ifc *iface) error {
	return d.opts.InNamespace(func() error {
		var errs []error
		for _, h := range hooksOf(ifc.kind) {
			if err := d.dp.Detach(bpf.Interface{Index: ifc.index}, h); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
				errs = append(errs, err)
			}
		}
		if ifc.kind == InterfaceNorthSouth {
			if err := d.dp.DetachXDP(bpf.Interface{Index: ifc.index}); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	})
}

// attach puts the programs of ifc's kind on its hooks and records them,
// and in ifc.made those it attached itself (not found attached already).
func (d *Dataplane) attach(ifc *iface) error {
	return d.opts.InNamespace(func() error {
		for _, h := range hooksOf(ifc.kind) {
			a, err := d.dp.Attach(bpf.Interface{Name: ifc.Name}, h)
			if err != nil {
				// Both hooks or none: a VM edge that translates on
				// the way out but not back (or the reverse) would
				// break every flow through it. What was attached
				// before this call (an earlier start's) stays.
				for _, u := range ifc.made {
					if derr := d.dp.Detach(bpf.Interface{Index: ifc.index}, u); derr != nil {
						err = errors.Join(err, fmt.Errorf("undo %s: %w", u, derr))
					}
				}
				ifc.hooks, ifc.made = nil, nil
				return err
			}
			ifc.index = a.Ifindex
			ifc.hooks = append(ifc.hooks, HookStatus{Hook: h.String(), Mode: string(a.Mode)})
			if !a.Reused {
				ifc.made = append(ifc.made, h)
			}
		}
		return nil
	})
}

// RemoveInterface detaches the programs from a VM-edge or north-south
// interface (on a north-south one, the TC hooks and our XDP program). The
// L7 policies that redirect to it then fail closed (their new flows drop)
// until it is attached again.
//
// A ctx that ended before the hooks are detached (on entry, or while the
// call waited for the dataplane's lock) detaches nothing and fails with
// an error wrapping ctx's; once detaching, the call finishes.
func (d *Dataplane) RemoveInterface(ctx context.Context, name string) error {
	if err := d.begin(ctx, "remove interface"); err != nil {
		return err
	}
	if err := d.removeInterface(ctx, name); err != nil {
		return err
	}
	if err := d.refreshProxies(name); err != nil {
		return fmt.Errorf("fluxvm: remove interface %s: detached, but the L7 policies that redirect to it were not updated: %w", name, err)
	}
	return nil
}

func (d *Dataplane) removeInterface(ctx context.Context, name string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("remove interface"); err != nil {
		return err
	}
	if err := ctxErr(ctx, "remove interface "+name); err != nil {
		return err
	}
	ifc, ok := d.ifaces[name]
	if !ok {
		return fmt.Errorf("fluxvm: remove interface %s: %w", name, ErrNotFound)
	}
	if err := d.detachHooks(ifc); err != nil {
		return fmt.Errorf("fluxvm: remove interface %s: %w", name, err)
	}
	if err := d.unregisterEdge(ifc); err != nil {
		return fmt.Errorf("fluxvm: remove interface %s: statistics: %w", name, err)
	}
	delete(d.ifaces, name)
	return nil
}

func (i *iface) status() InterfaceStatus {
	st := InterfaceStatus{Name: i.Name, Kind: i.kind, Index: i.index, VMID: i.VMID, Hooks: slices.Clone(i.hooks), Problem: i.problem}
	if i.kind == InterfaceNorthSouth {
		st.XDP, st.XDPProblem = string(i.xdp), i.xdpProblem
		if st.XDP == "" {
			st.XDP = string(bpf.XDPOff)
		}
	}
	return st
}

// Status describes the dataplane. It answers after Close too (see
// Close), without Memory: that is the one part read from the kernel (see
// MemoryStatus). Memory costs 1–2 ms at 4,000 Maglev tables; the
// first call after Open, which reads every table once, about 40 µs per
// table (bpf.Datapath.MapMemory caches what cannot change).
func (d *Dataplane) Status() Status {
	if d.unopened() {
		return Status{}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	st := d.dp.Status()
	out := Status{
		SchemaVersion: st.SchemaVersion, Generation: st.Generation, Tier: st.Tier.String(), PinRoot: st.PinRoot,
		Capacities: Capacities(st.Capacities),
		Load: LoadStatus{
			Created: st.Created, SchemaRebuilt: st.SchemaRebuilt, PreviousSchema: st.PreviousSchema,
			Reloaded: st.Reloaded, PreviousGeneration: st.PreviousGeneration, TierChanged: st.TierChanged,
			Migrated: st.Migrated, NotMigrated: st.NotMigrated, Migrations: slices.Clone(st.Migrations),
			HashSeedChanged: st.HashSeedChanged, Features: st.Features.Names(),
		},
		Seeds:         SeedStatus{FlowHash: st.HashSeed, Maglev: d.opts.MaglevSeed},
		Services:      len(d.services),
		SNAT:          d.snatStatus(),
		XDPRouteCache: d.routes.Status(),
		FrontendIndex: d.dp.FrontendIndexStats(),
		LastGC:        d.lastGC,
		SocketLB:      d.sock.Status(),
		// Advertiser.Status takes only the advertiser's own lock.
		Advertisements: d.adv.Status(),
	}
	if st.TierChanged {
		out.Load.PreviousTier = st.PreviousTier.String()
	}
	if st.HashSeedChanged {
		prev := st.PreviousHashSeed
		out.Load.PreviousHashSeed = &prev
	}
	for _, ifc := range d.ifaces {
		out.Interfaces = append(out.Interfaces, ifc.status())
	}
	sort.Slice(out.Interfaces, func(i, j int) bool { return out.Interfaces[i].Name < out.Interfaces[j].Name })
	if !d.closed {
		out.Memory = d.memoryStatus()
		if p, err := d.pressureStatus(); err == nil || p.Error != "" {
			out.Pressure = &p
		}
		out.MapSizes = d.mapSizesStatus(out.Pressure)
	}
	out.EDT = d.edtStatus()
	out.HA = d.HA().Status()
	return out
}

// memoryStatus reads the kernel memory of the maps. d.mu must be held,
// so that Close cannot release the maps meanwhile.
func (d *Dataplane) memoryStatus() *MemoryStatus {
	mm, err := d.dp.MapMemory()
	if err != nil {
		return &MemoryStatus{Error: err.Error()}
	}
	return &MemoryStatus{
		Maps: mm.Maps,
		MaglevInner: InnerMapsMemory{
			Count: mm.MaglevInner.Count, Bytes: mm.MaglevInner.Bytes, LargestBytes: mm.MaglevInner.LargestBytes,
		},
		Total: mm.Total,
	}
}

// snatStatus describes what writeSNAT put in fluxvm_snat.
func (d *Dataplane) snatStatus() SNATStatus {
	st := SNATStatus{PortMin: d.snat.PortMin, PortMax: d.snat.PortMax}
	if d.snat.Flags&bpf.SNATFlagV4 != 0 {
		st.Address4 = bpf.Addr([4]uint32{d.snat.Addr4}, bpf.FamilyIPv4)
	}
	if d.snat.Flags&bpf.SNATFlagV6 != 0 {
		st.Address6 = bpf.Addr(d.snat.Addr6, bpf.FamilyIPv6)
	}
	return st
}

// GC removes dead flows now (the timer does the same periodically) and
// then frees the ids that removed services and backends held. The scan
// runs without the dataplane's lock, so other calls proceed meanwhile;
// Close cancels it and waits for it to return, and a GC it interrupted,
// or one called after Close, fails with an error matching ErrClosed.
// The GC timer counts from it: the timer's next GC is due one period
// after the last GC began, whoever ran it (fluxvm/internal/gctimer).
func (d *Dataplane) GC(ctx context.Context) (GCResult, error) {
	if err := d.opened("gc"); err != nil {
		return GCResult{}, err
	}
	return d.gc(ctx, false)
}

// gc is GC; timer says the GC timer runs it, whose period adapts to
// what it found (gctimer.Timer.Note).
func (d *Dataplane) gc(ctx context.Context, timer bool) (_ GCResult, err error) {
	ctx, span := d.startSpan(ctx, SpanGC)
	defer endSpan(span, &err)
	now, err := conntrack.Now()
	if err != nil {
		return GCResult{}, fmt.Errorf("fluxvm: gc: %w", err)
	}
	// Not while a compaction replaces the flow maps (compact.go).
	d.flowMu.RLock()
	defer d.flowMu.RUnlock()
	// Only the ids in quarantine before the scan are free of flows after
	// it: an id released meanwhile may be named by a flow already passed.
	d.mu.Lock()
	if err := d.checkOpen("gc"); err != nil {
		d.mu.Unlock()
		return GCResult{}, err
	}
	// Added under mu while open: Close's wait (stopGC) comes after.
	d.gcRuns.Add(1)
	defer d.gcRuns.Done()
	smark, bmark := d.sids.quarantineMark(), d.bids.quarantineMark()
	d.mu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(d.gcCtx, cancel)()
	if d.beforeGCScan != nil {
		d.beforeGCScan()
	}
	start := time.Now()
	r, err := d.ct.GC(ctx, now)
	if d.afterGCScan != nil {
		d.afterGCScan()
	}
	if err != nil {
		if d.gcCtx.Err() != nil {
			return GCResult{}, fmt.Errorf("fluxvm: gc: interrupted by Close: %w", ErrClosed)
		}
		return GCResult{}, fmt.Errorf("fluxvm: gc: %w", err)
	}
	res := GCResult{
		At: start, Duration: time.Since(start), Scanned: r.Scanned,
		Expired: r.Expired, Drained: r.Drained, BackendGone: r.BackendGone,
		Orphans:  r.StaleNATRemoved + r.SupersededNATRemoved,
		Repaired: r.CTRepaired + r.NATRepaired,
	}
	span.SetAttributes(AttrGCScanned.Int(res.Scanned), AttrGCExpired.Int(res.Expired), AttrGCDrained.Int(res.Drained),
		AttrGCBackendGone.Int(res.BackendGone), AttrGCOrphans.Int(res.Orphans), AttrGCRepaired.Int(res.Repaired),
		AttrGCCollected.Int(res.Expired+res.Drained+res.BackendGone+res.Orphans))
	d.mu.Lock()
	d.lastGC = &res
	d.gcTimer.Note(now, res, timer)
	// Flows naming the ids quarantined before the scan are gone now.
	d.sids.releaseQuarantinedBefore(smark)
	if d.bids.releaseQuarantinedBefore(bmark) > 0 {
		// A backend id may name another backend from now on: XDP must
		// not reuse a route it cached under it.
		d.invalidateXDPRoutes()
	}
	d.mu.Unlock()
	return res, nil
}
