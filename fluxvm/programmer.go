package fluxvm

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/revindex"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
)

// The services' programming is the services component's
// (fluxvm/internal/services: Programmer): planning a change, building
// and swapping the Maglev tables, the frontend entries, markers and
// guards, the reverse translation index. The facade orders it around the
// catalog (ApplyService, DeleteService, restore), under d.mu, and gives
// it the loaded datapath's maps.

// newProgrammer makes the services component of an opening dataplane,
// once its tier is loaded.
func (d *Dataplane) newProgrammer() error {
	inner := d.dp.Spec().Maps["fluxvm_maglev"].InnerMap
	keys := make([]uint32, d.caps.MaglevSize)
	for i := range keys {
		keys[i] = uint32(i)
	}
	p, err := services.New(services.Config{Capacities: d.caps, MaglevSeed: d.opts.MaglevSeed, Catalog: d.opts.CatalogPath != ""}, services.Deps{
		Maps:         datapathMaps{d: d, inner: inner, keys: keys},
		Lock:         &d.mu,
		State:        d.health.EffectiveState,
		Pacing:       d.pacing,
		Policy:       policyHeaders{d},
		StaleSockets: d.staleSockets,
		Retry:        d.health.Retry,
		Tier:         func() bpf.Tier { return d.dp.Status().Tier },
		Log:          d.log,
		BeforeSwap: func(fe *services.Frontend, flags uint32) {
			if d.beforeSwap != nil {
				d.beforeSwap(fe, flags)
			}
		},
	})
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	d.prog = p
	return nil
}

// policyHeaders are the identity policy component's frontend headers,
// read through d so that the component Open makes later is the one used.
type policyHeaders struct{ d *Dataplane }

func (p policyHeaders) Attach(service string, sid uint32) (uint32, error) {
	return p.d.pol.Attach(service, sid)
}
func (p policyHeaders) Detach(sid uint32) error { return p.d.pol.Detach(sid) }

// datapathMaps are the loaded datapath's maps as the services component
// writes them (services.Maps). Each call reads the maps in force.
type datapathMaps struct {
	d     *Dataplane
	inner *ebpf.MapSpec // a Maglev table's inner map
	keys  []uint32      // the inner maps' keys, 0..M−1 for the largest M
}

func (m datapathMaps) maps() *bpf.Maps { return m.d.dp.Maps() }

func svcKey4(k services.Key) bpf.SvcKey4 {
	return bpf.SvcKey4{Vip: bpf.AddrWords(k.VIP)[0], Port: bpf.Port(k.Port), Proto: k.Proto}
}

func svcKey6(k services.Key) bpf.SvcKey6 {
	return bpf.SvcKey6{Vip: bpf.AddrWords(k.VIP), Port: bpf.Port(k.Port), Proto: k.Proto}
}

// Put writes the frontend entry of k; IPv4 ones go through the
// datapath's frontend index (bpf.Datapath.PutFrontend4).
func (m datapathMaps) Put(k services.Key, v bpf.SvcValue) error {
	var err error
	if k.VIP.Is4() {
		err = m.d.dp.PutFrontend4(svcKey4(k), v)
	} else {
		err = m.maps().FluxvmSvc6.Put(svcKey6(k), v)
	}
	if err != nil {
		return fmt.Errorf("frontend entry: %w", err)
	}
	return nil
}

// Lookup reads the frontend entry of k; ok is false when there is none.
func (m datapathMaps) Lookup(k services.Key) (v bpf.SvcValue, ok bool, err error) {
	if k.VIP.Is4() {
		err = m.maps().FluxvmSvc4.Lookup(svcKey4(k), &v)
	} else {
		err = m.maps().FluxvmSvc6.Lookup(svcKey6(k), &v)
	}
	switch {
	case errors.Is(err, ebpf.ErrKeyNotExist):
		return v, false, nil
	case err != nil:
		return v, false, fmt.Errorf("frontend entry: %w", err)
	}
	return v, true, nil
}

func (m datapathMaps) DeleteFrontend(k services.Key) error {
	var err error
	if k.VIP.Is4() {
		err = m.d.dp.DeleteFrontend4(svcKey4(k))
	} else {
		err = m.maps().FluxvmSvc6.Delete(svcKey6(k))
	}
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("frontend entry: %w", err)
	}
	return nil
}

func (m datapathMaps) PutBackend(id uint32, b bpf.Backend) error {
	return m.maps().FluxvmBackends.Put(id, b)
}

func (m datapathMaps) PutGuard(sid uint32, g bpf.Guard) error {
	return m.maps().FluxvmSguard.Put(sid, g)
}

func (m datapathMaps) ResetStats(sid uint32) error {
	return m.maps().FluxvmSvcStats.Put(sid, make([]bpf.ServiceStats, ebpf.MustPossibleCPU()))
}

func (m datapathMaps) LookupEDT(sid uint32) (v bpf.EDTValue, err error) {
	return v, m.maps().FluxvmEdt.Lookup(sid, &v)
}

func (m datapathMaps) PutEDT(sid uint32, v bpf.EDTValue) error {
	return m.maps().FluxvmEdt.Put(sid, v)
}

func (m datapathMaps) Index() revindex.Map { return m.maps().FluxvmBe2fe }

// NewTable makes a Maglev table's inner map of size slots and fills it
// with one batch update.
func (m datapathMaps) NewTable(size uint32, entries []uint32) (services.Table, error) {
	if newTableFault != nil {
		if err := newTableFault(); err != nil {
			return nil, err
		}
	}
	ms := m.inner.Copy()
	ms.MaxEntries = size
	inner, err := ebpf.NewMap(ms)
	if err != nil {
		return nil, err
	}
	if _, err := inner.BatchUpdate(m.keys[:len(entries)], entries, nil); err != nil {
		inner.Close()
		return nil, fmt.Errorf("fill: %w", err)
	}
	return inner, nil
}

// SwapTable puts t in place as the table of sid in fluxvm_maglev (t nil:
// empties the slot; new flows then drop as no_backend). Either returns
// only after an RCU grace period (the kernel waits for the programs that
// may still read the old table), which concurrent callers share.
func (m datapathMaps) SwapTable(sid uint32, t services.Table) error {
	var inner *ebpf.Map
	if t != nil {
		inner = t.(*ebpf.Map)
	}
	if swapFault != nil {
		if err := swapFault(sid, inner); err != nil {
			return err
		}
	}
	outer := m.maps().FluxvmMaglev
	if inner == nil {
		if err := outer.Delete(sid); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
		return nil
	}
	if err := outer.Put(sid, inner); err != nil {
		return fmt.Errorf("swap: %w", err)
	}
	return nil
}

// newTableFault is for tests alone (nil otherwise): NewTable calls it
// first, and fails with its error, as a failed map creation would.
var newTableFault func() error

// swapFault is for tests alone (nil otherwise): SwapTable calls it before
// it updates slot sid of fluxvm_maglev (inner nil: empties it), and fails
// with its error, as a failed map update would, without touching the map.
var swapFault func(sid uint32, inner *ebpf.Map) error
