package flows

import (
	"context"
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
)

// Counters are packet and byte totals of the datapath.
type Counters struct {
	Packets      uint64 `json:"packets"`
	Bytes        uint64 `json:"bytes"`
	ReplyPackets uint64 `json:"reply_packets"`
	ReplyBytes   uint64 `json:"reply_bytes"`
	NewFlows     uint64 `json:"new_flows"`
	Failovers    uint64 `json:"failovers"`
	Drops        uint64 `json:"drops"`
}

// Add adds o to c.
func (c *Counters) Add(o Counters) {
	c.Packets += o.Packets
	c.Bytes += o.Bytes
	c.ReplyPackets += o.ReplyPackets
	c.ReplyBytes += o.ReplyBytes
	c.NewFlows += o.NewFlows
	c.Failovers += o.Failovers
	c.Drops += o.Drops
}

// VMStats are the service statistics of one VM's edge interfaces.
type VMStats struct {
	VMID       string   `json:"vm_id"`
	Interfaces []string `json:"interfaces"`
	Counters   Counters `json:"counters"`
}

// ServiceCounters are one service's counters, summed over its frontends
// and CPUs.
type ServiceCounters struct {
	Counters
	// HorizonDrops counts the packets EDT pacing dropped (edt_horizon).
	HorizonDrops uint64
}

func (c *ServiceCounters) add(o ServiceCounters) {
	c.Counters.Add(o.Counters)
	c.HorizonDrops += o.HorizonDrops
}

// Sums are the node's counters: what Stats reports.
type Sums struct {
	// Services by name.
	Services map[string]ServiceCounters
	// Drops by reason name (bpf.DropReason), reason 0 (none) left out.
	Drops map[string]uint64
	// Parser by counter name (bpf.Counter): see IsEventCounter.
	Parser map[string]uint64
}

// IsEventCounter reports whether a name in Sums.Parser is a datapath
// event counter (nat_stale, host_routed_packets, host_route_fallbacks,
// snat_retries, dsr_forwarded, snat_conflicts, and any counter added
// later) rather than a kind of packet the parser saw (ipv4, tcp,
// truncated, ...).
func IsEventCounter(name string) bool {
	for c := range bpf.NumCounters {
		if bpf.Counter(c).String() == name {
			return bpf.Counter(c) > bpf.CounterParseLimit
		}
	}
	return true
}

// Sums reads the counters of services (their frontends' service ids by
// service name), the drops and the parser counters. A ctx that ended
// before the read fails with an error wrapping ctx's.
func (s *Scope) Sums(ctx context.Context, services map[string][]uint32) (Sums, error) {
	if err := s.rlock("stats"); err != nil {
		return Sums{}, err
	}
	defer s.mu.RUnlock()
	if err := ctx.Err(); err != nil {
		return Sums{}, fmt.Errorf("stats: %w", err)
	}
	out := Sums{Services: make(map[string]ServiceCounters, len(services)), Drops: map[string]uint64{}, Parser: map[string]uint64{}}
	for name, ids := range services {
		c, err := s.sumService(ids)
		if err != nil {
			return Sums{}, fmt.Errorf("stats of %s: %w", name, err)
		}
		out.Services[name] = c
	}
	drops, err := s.deps.Drops()
	if err != nil {
		return Sums{}, fmt.Errorf("stats: %w", err)
	}
	for r := 1; r < bpf.NumDropReasons; r++ {
		out.Drops[bpf.DropReason(r).String()] = drops[r]
	}
	parser, err := s.deps.Counters()
	if err != nil {
		return Sums{}, fmt.Errorf("stats: %w", err)
	}
	for c := range bpf.NumCounters {
		out.Parser[bpf.Counter(c).String()] = parser[c]
	}
	return out, nil
}

// Service sums one service's counters over ids, its frontends' service
// ids. A slot that cannot be read fails the call.
func (s *Scope) Service(ids []uint32) (ServiceCounters, error) {
	if err := s.rlock("stats"); err != nil {
		return ServiceCounters{}, err
	}
	defer s.mu.RUnlock()
	c, err := s.sumService(ids)
	if err != nil {
		return ServiceCounters{}, fmt.Errorf("stats: %w", err)
	}
	return c, nil
}

// sumService sums the fluxvm_svc_stats slots of ids; s.mu held.
func (s *Scope) sumService(ids []uint32) (ServiceCounters, error) {
	var c ServiceCounters
	for _, id := range ids {
		fc, err := readSlot(s.deps.SvcStats, id)
		if err != nil {
			return ServiceCounters{}, err
		}
		c.add(fc)
	}
	return c, nil
}

// Edge is an attached VM-edge interface as the dataplane has it.
type Edge struct {
	Name, VMID string
	// Slot is its statistics slot (Register); 0: none.
	Slot uint32
}

// VMStats sums the counters of vmID's edges among edges: what its
// clients sent to VIPs, what came back, and what was dropped. A VM none
// of edges belongs to is errs.ErrNotFound.
func (s *Scope) VMStats(ctx context.Context, vmID string, edges []Edge) (VMStats, error) {
	if err := s.rlock("stats of VM " + vmID); err != nil {
		return VMStats{}, err
	}
	defer s.mu.RUnlock()
	if err := ctx.Err(); err != nil {
		return VMStats{}, fmt.Errorf("stats of VM %s: %w", vmID, err)
	}
	out := VMStats{VMID: vmID}
	found := false
	for _, e := range edges {
		if e.VMID != vmID {
			continue
		}
		found = true
		out.Interfaces = append(out.Interfaces, e.Name)
		if e.Slot == 0 {
			continue
		}
		c, err := readSlot(s.deps.EdgeStats, e.Slot)
		if err != nil {
			return VMStats{}, fmt.Errorf("stats of VM %s: %w", vmID, err)
		}
		out.Counters.Add(c.Counters)
	}
	if !found {
		return VMStats{}, fmt.Errorf("VM %s: %w", vmID, errs.ErrNotFound)
	}
	return out, nil
}

// readSlot sums one per-CPU fluxvm_svc_stats_value slot.
func readSlot(m Table, slot uint32) (ServiceCounters, error) {
	var per []bpf.ServiceStats
	if err := m.Lookup(slot, &per); err != nil {
		return ServiceCounters{}, err
	}
	var c ServiceCounters
	for _, p := range per {
		c.add(ServiceCounters{Counters{p.Packets, p.Bytes, p.ReplyPackets, p.ReplyBytes, p.NewFlows, p.Failovers, p.Drops}, p.EdtDrops})
	}
	return c, nil
}

// Register gives the VM edge of ifindex its statistics slot: the one
// fluxvm_edge_slots holds for it (adopted after a restart), else a free
// one, zeroed. Two interfaces whose ifindexes agree in the low 16 bits
// cannot both be counted, nor more than the slots there are: the second
// one gets slot 0 and problem says why. err is a map write's failure.
func (s *Scope) Register(ifindex int) (slot uint32, problem string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, "", fmt.Errorf("statistics slot: %w", errs.ErrClosed)
	}
	key := uint32(ifindex) & bpf.EdgeSlotMask
	var cur bpf.EdgeSlot
	if err := s.deps.EdgeSlots.Lookup(key, &cur); err != nil {
		return 0, "", err
	}
	if cur.Slot != 0 && cur.Ifindex != uint32(ifindex) {
		return 0, fmt.Sprintf("no per-VM statistics: ifindex %d shares its statistics key with ifindex %d", ifindex, cur.Ifindex), nil
	}
	if cur.Slot != 0 {
		s.edges.take(cur.Slot) // adopted after a restart
		return cur.Slot, "", nil
	}
	if slot = s.edges.next(); slot == 0 {
		return 0, "no per-VM statistics: every statistics slot of the tier is in use", nil
	}
	// A write that fails leaves the slot taken, as before the
	// component: the interface is not attached, the slot stays unused.
	if err := s.deps.EdgeStats.Put(slot, make([]bpf.ServiceStats, s.cfg.CPUs)); err != nil {
		return 0, "", err
	}
	if err := s.deps.EdgeSlots.Put(key, bpf.EdgeSlot{Ifindex: uint32(ifindex), Slot: slot}); err != nil {
		return 0, "", err
	}
	return slot, "", nil
}

// Unregister gives slot (Register's, for ifindex) back; slot 0 does
// nothing.
func (s *Scope) Unregister(ifindex int, slot uint32) error {
	if slot == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	key := uint32(ifindex) & bpf.EdgeSlotMask
	if err := s.deps.EdgeSlots.Put(key, bpf.EdgeSlot{}); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	s.edges.free(slot)
	return nil
}

// slotPool hands out slots 1..n-1, round robin, so that a slot given
// back is the last to be handed out again.
type slotPool struct {
	taken  []bool
	cursor uint32 // where the search for a free slot starts
	used   int
}

func newSlotPool(n uint32) slotPool {
	p := slotPool{taken: make([]bool, n), cursor: 1}
	if n > 0 {
		p.taken[0] = true // slot 0 is "none" in fluxvm_edge_slots
	}
	return p
}

func (p *slotPool) size() int {
	if len(p.taken) == 0 {
		return 0
	}
	return len(p.taken) - 1
}

func (p *slotPool) inUse() int { return p.used }

// take marks slot as used (one a restart adopts).
func (p *slotPool) take(slot uint32) {
	if int(slot) < len(p.taken) && !p.taken[slot] {
		p.taken[slot] = true
		p.used++
	}
}

// next takes the first free slot from the cursor on, or returns 0.
func (p *slotPool) next() uint32 {
	n := uint32(len(p.taken))
	if p.used >= p.size() {
		return 0
	}
	for i := uint32(0); i < n; i++ {
		slot := (p.cursor + i) % n
		if !p.taken[slot] {
			p.take(slot)
			p.cursor = slot + 1
			return slot
		}
	}
	return 0
}

// free gives slot back (twice is once).
func (p *slotPool) free(slot uint32) {
	if slot != 0 && int(slot) < len(p.taken) && p.taken[slot] {
		p.taken[slot] = false
		p.used--
	}
}
