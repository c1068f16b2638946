// Package bpftest loads the real TC object for tests of the packages above
// bpf (conntrack, nat, ...) and makes the map writes a control plane would,
// so that a test drives the real programs with BPF_PROG_TEST_RUN: one
// harness instead of a copy per package. (The bpf package's own tests are
// internal to it and cannot import this package, which imports bpf; they
// keep theirs, built on the same generated types.)
//
// Nothing is pinned or attached: the object lives as long as its handles.
package bpftest

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// TCOK is TC_ACT_OK: the program translated the packet and ended the chain.
const TCOK = 0

// Sizes shrinks the lifecycle maps (preallocated LRU hashes of 64k entries
// and more are pointless for a test; small ones let a test fill them). Zero
// keeps the tier's size.
type Sizes struct{ CT, NAT uint32 }

// Object is a loaded TC object with typed maps and programs.
type Object struct {
	Spec     *ebpf.CollectionSpec
	Maps     bpf.Maps
	Programs bpf.Programs
	tables   map[string]*ebpf.Map // Maglev tables by backend list
	// fe writes fluxvm_svc4 and its index, as the loader does.
	fe *bpf.FrontendIndex
	// What fluxvm_be2fe is written from, as the control plane keeps it.
	fes map[uint32]frontend // by service id
	bes map[uint32]backend  // by backend id
}

type frontend struct {
	vip    netip.AddrPort
	proto  uint8
	stored bool // bpf.SvcFlagRevStored: past the slots of its backends
}

type backend struct {
	sid uint32
	ap  netip.AddrPort
}

// Load loads the object of tier with its lifecycle maps shrunk to sz.
func Load(tier bpf.Tier, sz Sizes) (*Object, error) {
	spec, err := bpf.Spec(tier)
	if err != nil {
		return nil, err
	}
	for name, n := range map[string]uint32{"fluxvm_fct4": sz.CT, "fluxvm_fct6": sz.CT, "fluxvm_nat4": sz.NAT, "fluxvm_nat6": sz.NAT} {
		if n != 0 {
			spec.Maps[name].MaxEntries = n
		}
	}
	o := &Object{Spec: spec, tables: map[string]*ebpf.Map{}, fes: map[uint32]frontend{}, bes: map[uint32]backend{}}
	var objs struct {
		bpf.Maps
		bpf.Programs
	}
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return nil, fmt.Errorf("bpftest: load: %w", err)
	}
	o.Maps, o.Programs = objs.Maps, objs.Programs
	if o.fe, err = bpf.NewFrontendIndex(o.Maps.FluxvmSvc4, o.Maps.FluxvmFe4); err == nil {
		_, err = o.fe.Rebuild()
	}
	if err != nil {
		o.Close()
		return nil, fmt.Errorf("bpftest: %w", err)
	}
	return o, nil
}

// Close releases the object's maps, programs and Maglev tables.
func (o *Object) Close() error {
	errs := []error{o.Maps.Close(), o.Programs.Close()}
	for _, m := range o.tables {
		errs = append(errs, m.Close())
	}
	return errors.Join(errs...)
}

// Service installs frontend vip/proto -> sid with flags (bpf.SvcFlag*),
// opens its guard and fills its Maglev table from bids (Table). The
// backends the service has (Backend) are listed in fluxvm_be2fe for it;
// a frontend with bpf.SvcFlagRevStored is past the slots of every one of
// them (see index).
func (o *Object) Service(sid uint32, vip netip.AddrPort, proto uint8, flags uint32, bids ...uint32) error {
	val := bpf.SvcValue{ServiceId: sid, Flags: flags, Revision: 1}
	w := bpf.AddrWords(vip.Addr())
	var err error
	if vip.Addr().Is4() {
		err = o.fe.Put(bpf.SvcKey4{Vip: w[0], Port: bpf.Port(vip.Port()), Proto: proto}, val)
	} else {
		err = o.Maps.FluxvmSvc6.Put(bpf.SvcKey6{Vip: w, Port: bpf.Port(vip.Port()), Proto: proto}, val)
	}
	if err != nil {
		return fmt.Errorf("bpftest: frontend: %w", err)
	}
	if err := o.Maps.FluxvmSguard.Put(sid, bpf.Guard{State: bpf.GuardOpen, Revision: 1}); err != nil {
		return fmt.Errorf("bpftest: guard: %w", err)
	}
	o.fes[sid] = frontend{vip, proto, flags&bpf.SvcFlagRevStored != 0}
	for _, b := range o.bes {
		if b.sid == sid {
			if err := o.index(b.ap, proto); err != nil {
				return err
			}
		}
	}
	return o.Table(sid, bids...)
}

// Table swaps in a Maglev table for sid, as the control plane does (a
// complete inner map, then one update of the outer slot): the tier's
// largest size, slot i naming bids[i%len(bids)]. Tables are built once per
// backend list and reused: filling thousands of slots is the slowest write
// a test makes.
func (o *Object) Table(sid uint32, bids ...uint32) error {
	if len(bids) == 0 {
		return errors.New("bpftest: a table needs a backend")
	}
	name := fmt.Sprint(bids)
	inner := o.tables[name]
	if inner == nil {
		var err error
		if inner, err = ebpf.NewMap(o.Spec.Maps["fluxvm_maglev"].InnerMap); err != nil {
			return fmt.Errorf("bpftest: table: %w", err)
		}
		n := inner.MaxEntries()
		keys, ids := make([]uint32, n), make([]uint32, n)
		for i := range keys {
			keys[i], ids[i] = uint32(i), bids[i%len(bids)]
		}
		if _, err := inner.BatchUpdate(keys, ids, nil); err != nil {
			inner.Close()
			return fmt.Errorf("bpftest: table: %w", err)
		}
		o.tables[name] = inner
	}
	return o.Maps.FluxvmMaglev.Put(sid, inner)
}

// Backend writes backend slot id: ap of service sid in state, with its
// drain deadline (CLOCK_MONOTONIC ns) for a Draining backend.
func (o *Object) Backend(id, sid uint32, ap netip.AddrPort, state bpf.BackendState, drainUntil uint64) error {
	fam := bpf.FamilyIPv6
	if ap.Addr().Is4() {
		fam = bpf.FamilyIPv4
	}
	if err := o.Maps.FluxvmBackends.Put(id, bpf.Backend{
		Addr: bpf.AddrWords(ap.Addr()), Port: bpf.Port(ap.Port()), Family: fam,
		State: uint8(state), ServiceId: sid, DrainUntilNs: drainUntil,
	}); err != nil {
		return err
	}
	old, had := o.bes[id]
	o.bes[id] = backend{sid, ap}
	if had && (old.ap != ap || old.sid != sid) {
		if err := o.reindex(old); err != nil {
			return err
		}
	}
	return o.reindex(o.bes[id])
}

// RemoveBackend empties backend slot id, as a removal does, and takes it
// out of fluxvm_be2fe.
func (o *Object) RemoveBackend(id uint32) error {
	if err := o.Maps.FluxvmBackends.Put(id, bpf.Backend{}); err != nil {
		return err
	}
	old, had := o.bes[id]
	delete(o.bes, id)
	if had {
		return o.reindex(old)
	}
	return nil
}

func (o *Object) reindex(b backend) error {
	if fe, ok := o.fes[b.sid]; ok {
		return o.index(b.ap, fe.proto)
	}
	return nil
}

// index writes the fluxvm_be2fe entry of backend endpoint ap for proto,
// listing its frontends in backend-id order (past bpf.Be2feSlots the entry
// is only marked overflowing: tests of that set the frontends' flags). A
// frontend with bpf.SvcFlagRevStored takes no slot and marks the entry
// overflowing, as the control plane places the frontends it gives that
// flag: its flows store reverse-NAT halves, which the replies then look
// up.
func (o *Object) index(ap netip.AddrPort, proto uint8) error {
	var v bpf.Be2feValue
	n, stored := 0, false
	for _, id := range slices.Sorted(maps.Keys(o.bes)) {
		b := o.bes[id]
		fe, ok := o.fes[b.sid]
		if !ok || b.ap != ap || fe.proto != proto {
			continue
		}
		if fe.stored {
			v.Flags |= bpf.Be2feFlagOverflow
			stored = true
			continue
		}
		if n < bpf.Be2feSlots {
			v.Slots[n] = bpf.Be2feSlot{Vip: bpf.AddrWords(fe.vip.Addr()), Vport: bpf.Port(fe.vip.Port()), ServiceId: b.sid, BackendId: id}
		} else {
			v.Flags |= bpf.Be2feFlagOverflow
		}
		n++
	}
	k := bpf.MakeBe2feKey(ap, proto)
	if n == 0 && !stored {
		if err := o.Maps.FluxvmBe2fe.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("bpftest: index: %w", err)
		}
		return nil
	}
	v.Count = uint8(min(n, bpf.Be2feSlots))
	if err := o.Maps.FluxvmBe2fe.Put(k, v); err != nil {
		return fmt.Errorf("bpftest: index: %w", err)
	}
	return nil
}

// SNAT writes the north-south SNAT configuration: addresses a4 and a6,
// ports [min, max].
func (o *Object) SNAT(a4, a6 netip.Addr, min, max uint16) error {
	return o.Maps.FluxvmSnat.Put(uint32(0), bpf.SNATConfig{
		Addr4: bpf.AddrWords(a4)[0], Addr6: bpf.AddrWords(a6),
		PortMin: min, PortMax: max, Flags: bpf.SNATFlagV4 | bpf.SNATFlagV6,
	})
}

// Frame is a TCP (with flags f) or UDP packet from src to dst.
func Frame(src, dst netip.AddrPort, proto uint8, f pkt.TCPFlags) []byte {
	if proto == 6 {
		return pkt.TCP(src, dst, f, []byte("fluxvm"))
	}
	return pkt.UDP(src, dst, []byte("fluxvm"))
}

// Run passes frame in through prog once; call it in the test's network
// namespace (testenv.Thread.Do).
func Run(prog *ebpf.Program, in []byte) (uint32, []byte, error) {
	opts := ebpf.RunOptions{Data: in, DataOut: make([]byte, len(in)+256), Repeat: 1}
	ret, err := prog.Run(&opts)
	return ret, opts.DataOut, err
}

// Endpoints decodes the source and destination of a frame (invalid
// AddrPorts when it has no IP or transport layer).
func Endpoints(frame []byte) (src, dst netip.AddrPort) {
	p := pkt.Decode(frame)
	nl, tl := p.NetworkLayer(), p.TransportLayer()
	if nl == nil || tl == nil {
		return src, dst
	}
	ap := func(addr, port []byte) netip.AddrPort {
		a, _ := netip.AddrFromSlice(addr)
		return netip.AddrPortFrom(a.Unmap(), uint16(port[0])<<8|uint16(port[1]))
	}
	return ap(nl.NetworkFlow().Src().Raw(), tl.TransportFlow().Src().Raw()),
		ap(nl.NetworkFlow().Dst().Raw(), tl.TransportFlow().Dst().Raw())
}
