package fluxvm

import (
	"context"
	"log/slog"
	"net"
	"slices"
	"sync"

	"github.com/cilium/ebpf"
	"go.opentelemetry.io/otel/trace"

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
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
	"github.com/fluxvm/servicefabric/fluxvm/internal/socklb"
	"github.com/fluxvm/servicefabric/fluxvm/internal/xdproutes"
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

	services map[string]*service
	// prog programs the services' frontends, backends and Maglev tables
	// and keeps what it wrote (fluxvm/internal/services; programmer.go);
	// its state is under mu.
	prog   *services.Programmer
	ifaces map[string]*iface
	pacing *edt.Pacing // EDT pacing's node side (fluxvm/internal/edt)
	snat   bpf.SNATConfig
	// snatPeers are the group's other SNAT addresses in fluxvm_snat_peers
	// (SetSNATPeers; snatpeers.go), sorted by address.
	snatPeers []bpf.SNATPeer
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

	beforeGCScan func()                                    // tests: runs just before GC's scan
	afterGCScan  func()                                    // tests: runs after GC's scan (whatever its outcome), before its release of ids
	beforeSwap   func(fe *services.Frontend, flags uint32) // tests: runs with d.mu held just before fe's new table goes in (flags: its new ones)

	applyState // concurrent applies, the catalog's store (apply.go)
}

// service is a service as programmed (services.Service): its intent,
// revision, frontends and catalog record.
type service = services.Service

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
