// Package flows is FluxScope's node side and the datapath's counters, a
// component of the fluxvm dataplane (DESIGN.md calls it "flows/otlp"; the
// OTLP export itself is the daemon's, over package
// github.com/fluxvm/servicefabric/flows/otlp): it reads the flow records
// of fluxvm_sflows and names their services and interfaces (Flows), sums
// the per-CPU counters of fluxvm_svc_stats per service, of
// fluxvm_edge_stats per VM, and the node's drops and parser counters
// (Sums, VMStats), and hands out the per-VM-edge statistics slots
// (Register, Unregister over fluxvm_edge_slots).
//
// What it reads it is given: the maps (Deps; a Table is what *ebpf.Map
// offers), and on each call a copy of the dataplane's view (the services'
// frontend ids, the attached VM edges and their slots, the names of
// services and interfaces). How an interface outside that view is named
// (the node's namespace) is the dataplane's func, Deps.InterfaceName.
//
// Lock: Scope's own RWMutex guards its state (the slot pool, closed) and
// is held, shared, while a read uses the maps, so that Close, which the
// dataplane calls before it closes the maps, waits for reads in progress
// and later reads fail with errs.ErrClosed instead of using a closed map.
// The dataplane may hold its lock (d.mu) while it calls in (a
// component's lock is always taken after d.mu); Scope never calls back
// into the dataplane with its lock held: Deps.InterfaceName runs while
// the flow ring is read, after the lock was let go, on handles of the
// ring's maps of Scope's own.
package flows

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	flowrec "github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
)

// Table is a map Scope reads (and, for the slots, writes): *ebpf.Map.
type Table interface {
	Lookup(key, valueOut any) error
	Put(key, value any) error
}

// Config sizes the component.
type Config struct {
	// EdgeSlots is the number of entries of fluxvm_edge_stats (the tier's
	// bpf.Capacities.Edges); slot 0 is never handed out. 0 or 1: no VM
	// edge gets per-VM statistics (Register reports the problem).
	EdgeSlots uint32
	// CPUs is the number of possible CPUs (the per-CPU value a new slot
	// is zeroed with); 0: ebpf.MustPossibleCPU().
	CPUs int
}

// Deps are the maps the component reads and what names an interface
// outside the attached ones.
type Deps struct {
	// SvcStats and EdgeStats are fluxvm_svc_stats and fluxvm_edge_stats:
	// per-CPU []bpf.ServiceStats by service id and by edge slot.
	SvcStats, EdgeStats Table
	// EdgeSlots is fluxvm_edge_slots: bpf.EdgeSlot by ifindex &
	// bpf.EdgeSlotMask.
	EdgeSlots Table
	// Drops and Counters sum fluxvm_drops and fluxvm_counters over CPUs
	// (bpf.ReadDrops, bpf.ReadCounters).
	Drops    func() (bpf.Drops, error)
	Counters func() (bpf.Counters, error)
	// Ring and Seq are fluxvm_sflows and fluxvm_flow_seq; each Flows
	// reads clones of its own. Nil: Flows fails.
	Ring, Seq *ebpf.Map
	// InterfaceName names an interface index that Names does not (the
	// node's namespace; "" when it has none). An error (the dataplane
	// closing) fails the Flows call that asked. Called without Scope's
	// lock; nil: such an interface is "if<index>".
	InterfaceName func(index int) (string, error)
}

// Status is the component's state.
type Status struct {
	// EdgeSlots is how many VM edges can get per-VM statistics, and
	// EdgeSlotsUsed how many have them.
	EdgeSlots     int `json:"edge_slots"`
	EdgeSlotsUsed int `json:"edge_slots_used"`
}

// Scope is the component. Its zero value is not usable: call New.
type Scope struct {
	cfg  Config
	deps Deps

	mu     sync.RWMutex
	edges  slotPool
	closed bool
}

// New checks cfg and deps and returns the component; it changes nothing.
func New(cfg Config, deps Deps) (*Scope, error) {
	if deps.SvcStats == nil || deps.EdgeStats == nil || deps.EdgeSlots == nil || deps.Drops == nil || deps.Counters == nil {
		return nil, errors.New("flows: the statistics maps are required")
	}
	if cfg.CPUs < 0 {
		return nil, fmt.Errorf("flows: %d CPUs", cfg.CPUs)
	}
	if cfg.CPUs == 0 {
		cfg.CPUs = ebpf.MustPossibleCPU()
	}
	return &Scope{cfg: cfg, deps: deps, edges: newSlotPool(cfg.EdgeSlots)}, nil
}

// Start does nothing: Scope has no goroutine. It is there for the
// dataplane's ordered start.
func (s *Scope) Start() {}

// Close waits for the reads in progress; later calls fail with
// errs.ErrClosed and use no map. Idempotent.
func (s *Scope) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return nil
}

// Status reports the edge slots.
func (s *Scope) Status() Status {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return Status{EdgeSlots: s.edges.size(), EdgeSlotsUsed: s.edges.inUse()}
}

// rlock takes the shared lock of a read, or fails once closed.
func (s *Scope) rlock(op string) error {
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		return fmt.Errorf("%s: %w", op, errs.ErrClosed)
	}
	return nil
}

// Names are the dataplane's names of a flow record's ids, as copied
// under its lock.
type Names struct {
	// Services names frontends' service ids.
	Services map[uint32]string
	// Interfaces names the attached interfaces by index.
	Interfaces map[int]string
}

// Flows returns up to limit flow records that f keeps, newest first
// (flows.Reader.Read on clones of Deps.Ring and Deps.Seq, made under the
// lock and read without it), named from names, then Deps.InterfaceName
// (asked once per index). A ctx that ends before the read or while it
// reads fails with an error wrapping ctx's (the ring's read is not
// interrupted); an error of InterfaceName fails the call.
func (s *Scope) Flows(ctx context.Context, limit int, f flowrec.Filter, names Names) ([]flowrec.Record, error) {
	ring, seq, err := s.cloneRing()
	if err != nil {
		return nil, err
	}
	defer ring.Close()
	defer seq.Close()
	n := s.namer(names)
	r := flowrec.Reader{Ring: ring, Seq: seq, Service: n.service, Interface: n.iface}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("flows: %w", err)
	}
	out, err := r.Read(limit, f)
	if err != nil {
		return nil, err
	}
	if n.err != nil {
		return nil, n.err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("flows: %w", err)
	}
	return out, nil
}

// cloneRing returns handles of the ring's maps of Scope's own (the
// caller closes them), which stay valid after Close.
func (s *Scope) cloneRing() (*ebpf.Map, *ebpf.Map, error) {
	if err := s.rlock("flows"); err != nil {
		return nil, nil, err
	}
	defer s.mu.RUnlock()
	if s.deps.Ring == nil || s.deps.Seq == nil {
		return nil, nil, errors.New("flows: no flow record maps")
	}
	ring, err := s.deps.Ring.Clone()
	if err != nil {
		return nil, nil, fmt.Errorf("flows: %w", err)
	}
	seq, err := s.deps.Seq.Clone()
	if err != nil {
		ring.Close()
		return nil, nil, fmt.Errorf("flows: %w", err)
	}
	return ring, seq, nil
}

// namer names the ids of one Flows call's records.
type namer struct {
	names  Names
	lookup func(index int) (string, error)
	err    error // the first error of lookup
}

func (s *Scope) namer(names Names) *namer {
	if names.Interfaces == nil {
		names.Interfaces = map[int]string{}
	}
	return &namer{names: names, lookup: s.deps.InterfaceName}
}

func (n *namer) service(id uint32) string { return n.names.Services[id] }

// iface names index from the attached interfaces, else asks lookup once
// per index (its answer, "" included, is kept for the call's other
// records).
func (n *namer) iface(index int) string {
	if name, ok := n.names.Interfaces[index]; ok {
		return name
	}
	var name string
	if n.lookup != nil {
		var err error
		if name, err = n.lookup(index); err != nil && n.err == nil {
			n.err = err
		}
	}
	n.names.Interfaces[index] = name
	return name
}
