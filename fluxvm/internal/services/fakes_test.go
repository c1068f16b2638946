package services

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
	"github.com/fluxvm/servicefabric/fluxvm/internal/revindex"
	"github.com/fluxvm/servicefabric/intent"
)

// fakeMaps are the datapath maps in memory, with the log of every write
// in order ("backend 3", "table 1", "frontend 10.96.0.1:80/tcp" ...),
// and the lock's state at each table swap.
type fakeMaps struct {
	frontends map[Key]bpf.SvcValue
	backends  map[uint32]bpf.Backend
	guards    map[uint32]bpf.Guard
	edt       map[uint32]bpf.EDTValue
	tables    map[uint32]*fakeTable
	index     *fakeIndexMap
	log       []string
	lock      *fakeLock
	// lockedSwaps counts the swaps made with the lock held.
	lockedSwaps int
	// failSwap, when set, fails the next swap of that service id.
	failSwap uint32
}

func newFakeMaps() *fakeMaps {
	return &fakeMaps{frontends: map[Key]bpf.SvcValue{}, backends: map[uint32]bpf.Backend{}, guards: map[uint32]bpf.Guard{},
		edt: map[uint32]bpf.EDTValue{}, tables: map[uint32]*fakeTable{}, index: &fakeIndexMap{entries: map[bpf.Be2feKey]bpf.Be2feValue{}}}
}

func (m *fakeMaps) logf(format string, args ...any) {
	m.log = append(m.log, fmt.Sprintf(format, args...))
}

func (m *fakeMaps) Lookup(k Key) (bpf.SvcValue, bool, error) {
	v, ok := m.frontends[k]
	return v, ok, nil
}

func (m *fakeMaps) Put(k Key, v bpf.SvcValue) error {
	m.logf("frontend %s", k)
	m.frontends[k] = v
	return nil
}

func (m *fakeMaps) DeleteFrontend(k Key) error {
	m.logf("delete frontend %s", k)
	delete(m.frontends, k)
	return nil
}

func (m *fakeMaps) PutBackend(id uint32, b bpf.Backend) error {
	if b == (bpf.Backend{}) {
		m.logf("clear backend %d", id)
	} else {
		m.logf("backend %d", id)
	}
	m.backends[id] = b
	return nil
}

func (m *fakeMaps) PutGuard(sid uint32, g bpf.Guard) error {
	m.logf("guard %d %d", sid, g.State)
	m.guards[sid] = g
	return nil
}

func (m *fakeMaps) ResetStats(sid uint32) error { return nil }

func (m *fakeMaps) LookupEDT(sid uint32) (bpf.EDTValue, error) {
	v, ok := m.edt[sid]
	if !ok {
		return v, ebpf.ErrKeyNotExist
	}
	return v, nil
}

func (m *fakeMaps) PutEDT(sid uint32, v bpf.EDTValue) error {
	m.edt[sid] = v
	return nil
}

func (m *fakeMaps) Index() revindex.Map { return m.index }

func (m *fakeMaps) NewTable(size uint32, entries []uint32) (Table, error) {
	return &fakeTable{size: size, entries: slices.Clone(entries)}, nil
}

func (m *fakeMaps) SwapTable(sid uint32, t Table) error {
	if m.lock != nil && m.lock.held {
		m.lockedSwaps++
	}
	if sid == m.failSwap {
		m.failSwap = 0
		return fmt.Errorf("swap of %d failed (test)", sid)
	}
	if t == nil {
		m.logf("empty table %d", sid)
		delete(m.tables, sid)
		return nil
	}
	m.logf("table %d", sid)
	m.tables[sid] = t.(*fakeTable)
	return nil
}

// fakeTable is an inner map: its size and backend ids by slot.
type fakeTable struct {
	size    uint32
	entries []uint32
}

func (t *fakeTable) Close() error { return nil }

// fakeIndexMap is fluxvm_be2fe in memory.
type fakeIndexMap struct {
	entries map[bpf.Be2feKey]bpf.Be2feValue
}

func (m *fakeIndexMap) Put(key, value any) error {
	m.entries[key.(bpf.Be2feKey)] = value.(bpf.Be2feValue)
	return nil
}

func (m *fakeIndexMap) Delete(key any) error {
	delete(m.entries, key.(bpf.Be2feKey))
	return nil
}

func (m *fakeIndexMap) MaxEntries() uint32 { return 1024 }

// fakeLock is the facade's lock, whose state the fake maps read.
type fakeLock struct {
	mu   sync.Mutex
	held bool
	// onUnlock runs (once) when the lock is released.
	onUnlock func()
}

func (l *fakeLock) Lock() { l.mu.Lock(); l.held = true }
func (l *fakeLock) Unlock() {
	l.held = false
	l.mu.Unlock()
	if f := l.onUnlock; f != nil {
		l.onUnlock = nil
		f()
	}
}

// fakePolicy attaches nothing, and logs detaches.
type fakePolicy struct{ detached []uint32 }

func (p *fakePolicy) Attach(string, uint32) (uint32, error) { return 0, nil }
func (p *fakePolicy) Detach(sid uint32) error {
	p.detached = append(p.detached, sid)
	return nil
}

// rig is a Programmer over fakes, with health states to overlay.
type rig struct {
	p       *Programmer
	m       *fakeMaps
	lock    *fakeLock
	states  map[netip.AddrPort]intent.BackendState
	retried []string
}

func newRig(t *testing.T, caps bpf.Capacities) *rig {
	t.Helper()
	r := &rig{m: newFakeMaps(), lock: &fakeLock{}, states: map[netip.AddrPort]intent.BackendState{}}
	r.m.lock = r.lock
	pacing, err := edt.New(edt.Config{Enabled: true, Horizon: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if caps.MaglevSize == 0 {
		caps.MaglevSize = 1021
	}
	r.p, err = New(Config{Capacities: caps, MaglevSeed: 7}, Deps{
		Maps: r.m, Lock: r.lock, Pacing: pacing, Policy: &fakePolicy{},
		State: func(svc *intent.Service, b *intent.Backend) intent.BackendState {
			if s, ok := r.states[b.Endpoint()]; ok {
				return s
			}
			return b.EffectiveState()
		},
		Retry: func(name string) { r.retried = append(r.retried, name) },
		Tier:  func() bpf.Tier { return bpf.TierS },
	})
	if err != nil {
		t.Fatal(err)
	}
	r.lock.Lock()
	t.Cleanup(func() {
		if r.lock.held {
			r.lock.Unlock()
		}
	})
	return r
}

// apply programs svc as an apply does (Prepare, BuildTables without
// the lock, CommitUnlocked), into s (new when nil), and returns s.
func (r *rig) apply(t *testing.T, svc intent.Service, s *Service) (*Service, error) {
	t.Helper()
	old := s
	s = &Service{Intent: svc, Revision: 1}
	if old != nil {
		s.Revision = old.Revision + 1
	}
	pl, err := r.p.Prepare(svc, s, old)
	if err != nil {
		return s, err
	}
	r.lock.Unlock()
	tables, err := r.p.BuildTables(pl)
	r.lock.Lock()
	if err != nil {
		return s, err
	}
	defer tables.Close()
	return s, r.p.CommitUnlocked(svc, s, pl, tables, old)
}

// svc is service name with VIP 10.96.0.vip, the given ports (TCP) and
// backends 10.200.0.b:8080.
func svc(name string, vip byte, ports []uint16, backends ...byte) intent.Service {
	s := intent.Service{Name: name, VIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 0, vip})}}
	for _, p := range ports {
		s.Ports = append(s.Ports, intent.ServicePort{Port: p, Protocol: intent.TCP})
	}
	for _, b := range backends {
		s.Backends = append(s.Backends, intent.Backend{Address: netip.AddrFrom4([4]byte{10, 200, 0, b}), Port: 8080})
	}
	return s
}

func bep(b byte) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 200, 0, b}), 8080)
}

func fk(vip byte, port uint16) Key {
	return Key{VIP: netip.AddrFrom4([4]byte{10, 96, 0, vip}), Port: port, Proto: 6}
}

// before fails unless the log has an entry starting with a before one
// starting with b.
func (m *fakeMaps) before(t *testing.T, a, b string) {
	t.Helper()
	ia := slices.IndexFunc(m.log, func(s string) bool { return strings.HasPrefix(s, a) })
	ib := slices.IndexFunc(m.log, func(s string) bool { return strings.HasPrefix(s, b) })
	if ia < 0 || ib < 0 || ia > ib {
		t.Errorf("want %q before %q in the writes: %q", a, b, m.log)
	}
}
