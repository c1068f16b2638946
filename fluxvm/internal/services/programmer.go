package services

import (
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"sync"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
	"github.com/fluxvm/servicefabric/fluxvm/internal/idpool"
	"github.com/fluxvm/servicefabric/fluxvm/internal/revindex"
	"github.com/fluxvm/servicefabric/intent"
)

// Config is what the Programmer is sized and seeded with.
type Config struct {
	// Capacities are the loaded tier's: service ids (Services), backend
	// ids (Backends), the largest Maglev table (MaglevSize). Zero
	// Services or Backends: no id to hand out (every new frontend fails
	// with intent.ErrLimit); zero MaglevSize is rejected.
	Capacities bpf.Capacities
	// MaglevSeed seeds every Maglev table (0 is a valid seed).
	MaglevSeed uint64
	// Catalog: the facade restores a catalog at Open (revindex.Config).
	Catalog bool
}

// Maps are the datapath maps the Programmer writes. The facade passes
// the loaded datapath's; tests pass fakes.
type Maps interface {
	// Frontends reads and writes frontend entries (fluxvm_svc4/6).
	revindex.Frontends
	// DeleteFrontend removes the entry of k; none is not an error.
	DeleteFrontend(k Key) error
	// PutBackend writes fluxvm_backends[id].
	PutBackend(id uint32, b bpf.Backend) error
	// PutGuard writes fluxvm_sguard[sid].
	PutGuard(sid uint32, g bpf.Guard) error
	// ResetStats zeroes fluxvm_svc_stats[sid] on every CPU.
	ResetStats(sid uint32) error
	// LookupEDT reads fluxvm_edt[sid]; PutEDT writes it.
	LookupEDT(sid uint32) (bpf.EDTValue, error)
	PutEDT(sid uint32, v bpf.EDTValue) error
	// Index is fluxvm_be2fe (the reverse translation index).
	Index() revindex.Map
	// NewTable makes a Maglev table's inner map of size slots holding
	// entries (backend ids) in slots 0..len(entries)-1, not in place
	// yet. It needs no lock.
	NewTable(size uint32, entries []uint32) (Table, error)
	// SwapTable puts t in place as the table of sid in fluxvm_maglev in
	// one update, or empties the slot when t is nil. It returns after an
	// RCU grace period (concurrent callers share it) and needs no lock.
	SwapTable(sid uint32, t Table) error
}

// Table is a Maglev table's inner map, built by Maps.NewTable.
type Table interface{ Close() error }

// Policy is what the identity policy component does for a frontend.
type Policy interface {
	// Attach writes the policy header of service's frontend sid, if it
	// has a policy, and returns the flags its entry is to get.
	Attach(service string, sid uint32) (uint32, error)
	// Detach removes frontend sid's policy header.
	Detach(sid uint32) error
}

// Deps is what the Programmer needs of the rest of the dataplane.
type Deps struct {
	Maps Maps
	// Lock is the facade's lock, which guards the Programmer's state: its
	// callers hold it, and CommitUnlocked and RemoveUnlocked release it
	// while they wait for RCU grace periods. Required.
	Lock sync.Locker
	// State is the state backend b of svc gets in the datapath: its
	// intent's, with the health checks' overlay. Required.
	State func(svc *intent.Service, b *intent.Backend) intent.BackendState
	// Pacing gives a service's EDT entry. Required.
	Pacing *edt.Pacing
	// Policy attaches and detaches identity policy headers. Required.
	Policy Policy
	// StaleSockets asks socket LB to look for connected UDP sockets whose
	// backend went (nil: none).
	StaleSockets func()
	// Retry asks the health checks to check service name again soon
	// (nil: none): FailClosed calls it.
	Retry func(name string)
	// Tier is the loaded tier, named in errors. Required.
	Tier func() bpf.Tier
	// Log: nil discards.
	Log *slog.Logger
	// BeforeSwap (tests; nil otherwise) runs when a frontend is ready for
	// its new table, with the flags its entry is to get.
	BeforeSwap func(fe *Frontend, flags uint32)
}

// Programmer writes services into the datapath and keeps what it wrote:
// the frontends with their ids, the VIP markers, the reverse translation
// index, the frontends closed for repair, and the Maglev tables to build
// in. Every method but BuildTables is called with Deps.Lock held.
type Programmer struct {
	cfg       Config
	deps      Deps
	log       *slog.Logger
	frontends map[Key]*Frontend
	markers   map[markerKey][]*Frontend
	index     *revindex.Index
	sids      *idpool.Pool
	bids      *idpool.Pool
	// repairs are the frontends that FailClosed closed, by service,
	// until the service is programmed again: its next change removes
	// those it no longer wants, even one the service's record does not
	// list (a new frontend of an apply whose rollback failed).
	repairs map[string][]*Frontend
	tables  tablePool
}

// New makes a Programmer with no frontend. It writes nothing.
func New(cfg Config, deps Deps) (*Programmer, error) {
	switch {
	case deps.Maps == nil, deps.Lock == nil, deps.State == nil, deps.Pacing == nil, deps.Policy == nil, deps.Tier == nil:
		return nil, errors.New("services: maps, lock, state, pacing, policy and tier are required")
	case cfg.Capacities.MaglevSize == 0:
		return nil, errors.New("services: no Maglev table size")
	}
	log := deps.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if deps.StaleSockets == nil {
		deps.StaleSockets = func() {}
	}
	if deps.Retry == nil {
		deps.Retry = func(string) {}
	}
	x, err := revindex.New(revindex.Config{Catalog: cfg.Catalog}, revindex.Deps{
		Map: deps.Maps.Index, Tier: deps.Tier, Frontends: deps.Maps,
	})
	if err != nil {
		return nil, err
	}
	p := &Programmer{cfg: cfg, deps: deps, log: log, index: x, tables: newTablePool(),
		sids: idpool.New(cfg.Capacities.Services), bids: idpool.New(cfg.Capacities.Backends)}
	p.Reset()
	return p, nil
}

// Reset forgets every frontend, marker, repair and index slot (Cleanup
// removed the maps). The ids stay as they are.
func (p *Programmer) Reset() {
	p.frontends = map[Key]*Frontend{}
	p.markers = map[markerKey][]*Frontend{}
	p.repairs = map[string][]*Frontend{}
	p.index.Reset()
}

// Frontend is the frontend k, or nil.
func (p *Programmer) Frontend(k Key) *Frontend { return p.frontends[k] }

// Frontends yields every frontend the datapath has.
func (p *Programmer) Frontends() iter.Seq2[Key, *Frontend] { return maps.All(p.frontends) }

// Len is how many frontends the datapath has.
func (p *Programmer) Len() int { return len(p.frontends) }

// ServiceIDs and BackendIDs are the id pools (conntrack GC releases
// their quarantined ids).
func (p *Programmer) ServiceIDs() *idpool.Pool { return p.sids }
func (p *Programmer) BackendIDs() *idpool.Pool { return p.bids }

// Index is the reverse translation index (Seed and Settle at Open).
func (p *Programmer) Index() *revindex.Index { return p.index }

// Adopt takes service s's frontend k with service id sid and backends
// (endpoint → backend id) as the catalog recorded them, before Program
// writes them (the restore at Open): the ids are reserved, and fail with
// intent.ErrConflict when taken already.
func (p *Programmer) Adopt(s *Service, k Key, sid uint32, backends map[netip.AddrPort]uint32) error {
	name := s.Intent.Name
	if p.frontends[k] != nil || !p.sids.Reserve(sid) {
		return fmt.Errorf("service id %d of %s: %w", sid, name, intent.ErrConflict)
	}
	fe := &Frontend{key: k, sid: sid, service: name, backends: map[netip.AddrPort]uint32{}}
	for ep, bid := range backends {
		if !p.bids.Reserve(bid) {
			return fmt.Errorf("backend id %d of %s: %w", bid, name, intent.ErrConflict)
		}
		fe.backends[ep] = bid
	}
	p.frontends[k] = fe
	s.Frontends = append(s.Frontends, fe)
	return nil
}

// CheckIDs fails with intent.ErrLimit when svc needs more new ids than
// are free.
func (p *Programmer) CheckIDs(svc *intent.Service) error {
	needS, needB := 0, 0
	for _, w := range Wanted(svc) {
		fe := p.frontends[w.Key]
		if fe == nil || fe.service != svc.Name {
			needS++
		}
		for _, b := range w.Backends {
			if fe == nil || fe.service != svc.Name || fe.backends[b.Endpoint()] == 0 {
				needB++
			}
		}
	}
	if needS > p.sids.Available() {
		return fmt.Errorf("%w: %d new frontends, %d service ids free in tier %s", intent.ErrLimit, needS, p.sids.Available(), p.deps.Tier())
	}
	if needB > p.bids.Available() {
		return fmt.Errorf("%w: %d new backend entries, %d backend ids free in tier %s", intent.ErrLimit, needB, p.bids.Available(), p.deps.Tier())
	}
	return nil
}

// FrontendsOf lists the frontends of service name that ss know of and
// the datapath still has.
func (p *Programmer) FrontendsOf(name string, ss ...*Service) []*Frontend {
	var out []*Frontend
	for _, s := range ss {
		if s == nil {
			continue
		}
		for _, fe := range s.Frontends {
			if fe.service == name && p.frontends[fe.key] == fe && !slices.Contains(out, fe) {
				out = append(out, fe)
			}
		}
	}
	return out
}

// InPlace reports whether every frontend of s is in the datapath as its
// last change left it: its entry written (a failed delete may have
// retired it) and none of the service's frontends closed for repair
// (FailClosed). An unchanged intent is applied again only when not.
func (p *Programmer) InPlace(s *Service) bool {
	if len(p.repairs[s.Intent.Name]) > 0 {
		return false
	}
	for _, fe := range s.Frontends {
		if !fe.live || fe.repair {
			return false
		}
	}
	return true
}

// Forget drops the repairs of service name: it is programmed, or gone.
func (p *Programmer) Forget(name string) { delete(p.repairs, name) }

// withRepairs adds to fes, frontends of service name, those of its
// frontends closed for repair that the datapath still has.
func (p *Programmer) withRepairs(name string, fes []*Frontend) []*Frontend {
	for _, fe := range p.repairs[name] {
		if p.frontends[fe.key] == fe && !slices.Contains(fes, fe) {
			fes = append(fes, fe)
		}
	}
	return fes
}

// FailClosed is the last resort of a change that failed and could not
// put back what was there (cause: why not): the frontends of service
// name that ss know of may hold a mix of tables, entries and backends of
// two intents, so their guards are closed (their packets drop as
// guard_closed, new and established flows alike) and they are marked
// for repair: RepairPending reports it, the next apply of the service
// programs it even with an unchanged intent (InPlace), and Deps.Retry
// has its health checks reprogram it soon.
func (p *Programmer) FailClosed(name string, cause error, ss ...*Service) {
	fes := p.FrontendsOf(name, ss...)
	var errs []error
	p.repairs[name] = p.withRepairs(name, slices.Clone(fes))
	for _, fe := range fes {
		fe.repair, fe.guard = true, false
		if err := p.deps.Maps.PutGuard(fe.sid, bpf.Guard{Revision: fe.rev}); err != nil {
			errs = append(errs, fmt.Errorf("frontend %s: close guard: %w", fe.key, err))
		}
	}
	p.deps.Retry(name)
	p.log.Error("fluxvm: a change failed and putting back what was there failed too; the service's frontends are closed (their packets drop) until it is programmed again",
		"service", name, "frontends", len(fes), "err", cause, "close_err", errors.Join(errs...))
}
