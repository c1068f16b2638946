package policy

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
)

// ErrInvalidMap: a map given to NewWriter is missing or is not the policy
// map of this schema it should be.
var ErrInvalidMap = errors.New("policy: not a policy map of this schema")

// Maps are the datapath's policy maps: the ipcache's tries and the
// policies (bpf/lib/policy.h).
type Maps struct {
	SID4, SID6 *ebpf.Map // fluxvm_sid4, fluxvm_sid6
	Policies   *ebpf.Map // fluxvm_spol
}

// Writer writes Programs to the datapath's policy maps so that no packet
// ever meets half of a change:
//
//   - a policy's rules go under a rule set id its header does not name
//     (each policy has two, 2*ID and 2*ID+1), and the header switches to
//     them in one map update, then the old set goes;
//   - Attach writes the header of a datapath service before the caller
//     sets bpf.SvcFlagPolicy on its frontend, and Detach removes headers
//     only after the caller cleared the flag (a flag without a header
//     drops: fail closed).
//
// A Writer is not safe for concurrent use; the dataplane calls it under
// its lock.
type Writer struct {
	m Maps
	// set is the rule set id each policy (by ID) names now, and rules
	// what that set holds.
	set   map[uint32]uint32
	rules map[uint32][]Rule
	// heads are the headers written, by datapath service id.
	heads map[uint32]bpf.PolicyValue
	// Grace is how long Prune waits before it removes rule sets no header
	// names any more: a
	// packet that read a header before it switched may still look up the
	// old set's rules (BPF programs run in RCU read sections of
	// microseconds). Default DefaultGrace.
	Grace time.Duration
}

// DefaultGrace is Writer.Grace's default.
const DefaultGrace = 10 * time.Millisecond

// NewWriter checks the maps' layouts and returns a Writer over them. The
// maps may hold a previous process's policies: Apply replaces them.
func NewWriter(m Maps) (*Writer, error) {
	for _, c := range []struct {
		name       string
		m          *ebpf.Map
		typ        ebpf.MapType
		key, value uintptr
	}{
		{"fluxvm_sid4", m.SID4, ebpf.LPMTrie, unsafe.Sizeof(bpf.SIDKey4{}), unsafe.Sizeof(bpf.SIDValue{})},
		{"fluxvm_sid6", m.SID6, ebpf.LPMTrie, unsafe.Sizeof(bpf.SIDKey6{}), unsafe.Sizeof(bpf.SIDValue{})},
		{"fluxvm_spol", m.Policies, ebpf.Hash, unsafe.Sizeof(bpf.PolicyKey{}), unsafe.Sizeof(bpf.PolicyValue{})},
	} {
		switch {
		case c.m == nil:
			return nil, fmt.Errorf("%w: %s: nil map", ErrInvalidMap, c.name)
		case c.m.Type() != c.typ || uintptr(c.m.KeySize()) != c.key || uintptr(c.m.ValueSize()) != c.value:
			return nil, fmt.Errorf("%w: %s: %s with %d/%d-byte keys/values, want %s with %d/%d", ErrInvalidMap, c.name,
				c.m.Type(), c.m.KeySize(), c.m.ValueSize(), c.typ, c.key, c.value)
		}
	}
	w := &Writer{m: m, set: map[uint32]uint32{}, rules: map[uint32][]Rule{}, heads: map[uint32]bpf.PolicyValue{}, Grace: DefaultGrace}
	// Adopt the headers a previous process wrote: their rule sets are in
	// use (their contents unknown here, so the next Attach of each policy
	// writes the other set and switches).
	var k bpf.PolicyKey
	var v bpf.PolicyValue
	it := m.Policies.Iterate()
	for it.Next(&k, &v) {
		if k.Identity == bpf.PolicyHeader {
			w.heads[k.Id] = v
			w.set[v.Rules/2] = v.Rules
			w.rules[v.Rules/2] = nil
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("policy: read fluxvm_spol: %w", err)
	}
	return w, nil
}

// SetIPCache makes the identity tries hold exactly p's ipcache: new and
// changed prefixes first, then the ones gone. A prefix's identity changes
// in one update; a change over several prefixes is seen prefix by prefix
// (every Revision moves with the ipcache, so established flows are decided
// again once the headers name the new revisions).
func (w *Writer) SetIPCache(p *Program) error {
	for _, fam := range []struct {
		m       *ebpf.Map
		entries []intent.IPCacheEntry
		key     func(netip.Prefix) any
	}{
		{w.m.SID4, p.IPv4, func(pf netip.Prefix) any {
			return bpf.SIDKey4{Prefixlen: uint32(pf.Bits()), Addr: bpf.AddrWords(pf.Addr())[0]}
		}},
		{w.m.SID6, p.IPv6, func(pf netip.Prefix) any {
			return bpf.SIDKey6{Prefixlen: uint32(pf.Bits()), Addr: bpf.AddrWords(pf.Addr())}
		}},
	} {
		want := make(map[netip.Prefix]bool, len(fam.entries))
		for _, e := range fam.entries {
			want[e.Prefix] = true
			if err := fam.m.Put(fam.key(e.Prefix), bpf.SIDValue{Identity: uint32(e.Identity)}); err != nil {
				return fmt.Errorf("policy: ipcache %s: %w", e.Prefix, err)
			}
		}
		stale, err := ipcachePrefixes(fam.m, want)
		if err != nil {
			return err
		}
		for _, pf := range stale {
			if err := fam.m.Delete(fam.key(pf)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return fmt.Errorf("policy: ipcache %s: %w", pf, err)
			}
		}
	}
	return nil
}

// ipcachePrefixes lists the prefixes of trie m that want lacks.
func ipcachePrefixes(m *ebpf.Map, want map[netip.Prefix]bool) ([]netip.Prefix, error) {
	var out []netip.Prefix
	k := make([]byte, m.KeySize())
	var v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		bits := int(k[0]) | int(k[1])<<8 | int(k[2])<<16 | int(k[3])<<24
		a, ok := netip.AddrFromSlice(k[4:])
		if !ok || bits > a.BitLen() {
			continue
		}
		pf := netip.PrefixFrom(a, bits)
		if !want[pf] {
			out = append(out, pf)
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("policy: ipcache: %w", err)
	}
	return out, nil
}

// Attach makes the headers of datapath services sids name policy c, with
// c's rules in place first (a new rule set when they changed). Call it
// before setting bpf.SvcFlagPolicy on those frontends; a disabled policy
// has no headers (Detach them).
func (w *Writer) Attach(c *Compiled, sids []uint32) error {
	if c.ID == 0 {
		return fmt.Errorf("policy: attach %s: no policy id", c.Service)
	}
	set, ok := w.set[c.ID]
	// A set adopted from a previous process has unknown rules (nil, not
	// empty): always replaced.
	if !ok || w.rules[c.ID] == nil || !slices.Equal(w.rules[c.ID], c.Rules) {
		next := 2 * c.ID
		if ok && set == next {
			next++
		}
		if err := w.clearSet(next); err != nil {
			return err
		}
		for _, r := range c.Rules {
			if err := w.m.Policies.Put(bpf.PolicyKey{Id: next, Identity: uint32(r.Identity)}, bpf.PolicyValue{Action: action(r.Action)}); err != nil {
				return fmt.Errorf("policy: %s: rule %d: %w", c.Service, r.Identity, err)
			}
		}
		// Every header of the policy moves to the new set, those of the
		// services given here and any other it named before.
		for sid, h := range w.heads {
			if h.Rules == set && ok && !slices.Contains(sids, sid) {
				sids = append(sids, sid)
			}
		}
		w.set[c.ID], w.rules[c.ID] = next, append([]Rule{}, c.Rules...)
		if err := w.putHeads(c, sids); err != nil {
			return err
		}
		return nil // the old set goes in Prune
	}
	return w.putHeads(c, sids)
}

func (w *Writer) putHeads(c *Compiled, sids []uint32) error {
	h := bpf.PolicyValue{Rules: w.set[c.ID], Revision: c.Revision, Action: action(c.Default)}
	if c.AuditOnly {
		h.Flags |= bpf.PolicyFlagAudit
	}
	for _, sid := range sids {
		if old, ok := w.heads[sid]; ok && old == h {
			continue
		}
		if err := w.m.Policies.Put(bpf.PolicyKey{Id: sid, Identity: bpf.PolicyHeader}, h); err != nil {
			return fmt.Errorf("policy: %s: header of service %d: %w", c.Service, sid, err)
		}
		w.heads[sid] = h
	}
	return nil
}

// clearSet removes every rule of rule set id from the map.
func (w *Writer) clearSet(id uint32) error {
	keys, err := w.keys(func(k bpf.PolicyKey) bool { return k.Identity != bpf.PolicyHeader && k.Id == id })
	if err != nil {
		return err
	}
	for _, k := range keys {
		if err := w.m.Policies.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("policy: rule set %d: %w", id, err)
		}
	}
	return nil
}

// keys lists the keys of fluxvm_spol that keep selects.
func (w *Writer) keys(keep func(bpf.PolicyKey) bool) ([]bpf.PolicyKey, error) {
	var out []bpf.PolicyKey
	var k bpf.PolicyKey
	var v bpf.PolicyValue
	it := w.m.Policies.Iterate()
	for it.Next(&k, &v) {
		if keep(k) {
			out = append(out, k)
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("policy: list fluxvm_spol: %w", err)
	}
	return out, nil
}

// Detach removes the headers of datapath services sids (those it wrote or
// adopted; Prune removes any other). Call it only once their frontends no
// longer have bpf.SvcFlagPolicy.
func (w *Writer) Detach(sids []uint32) error {
	for _, sid := range sids {
		if _, ok := w.heads[sid]; !ok {
			continue
		}
		if err := w.m.Policies.Delete(bpf.PolicyKey{Id: sid, Identity: bpf.PolicyHeader}); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("policy: header of service %d: %w", sid, err)
		}
		delete(w.heads, sid)
	}
	return nil
}

// Prune removes what p and the headers kept do not use: headers of
// datapath services not in keep (their frontends must not have
// bpf.SvcFlagPolicy), rule sets no header names (after Grace, when Attach
// switched any), and policies p lacks. It also clears what a previous
// process left in the maps.
func (w *Writer) Prune(p *Program, keep func(sid uint32) bool) error {
	enabled := map[uint32]bool{}
	for _, c := range p.Policies {
		if c.Enabled {
			enabled[c.ID] = true
		}
	}
	sets := map[uint32]bool{}
	for id, s := range w.set {
		if enabled[id] {
			sets[s] = true
			continue
		}
		delete(w.set, id)
		delete(w.rules, id)
	}
	heads, err := w.keys(func(k bpf.PolicyKey) bool { return k.Identity == bpf.PolicyHeader && !keep(k.Id) })
	if err != nil {
		return err
	}
	for _, k := range heads {
		if err := w.m.Policies.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("policy: prune header of service %d: %w", k.Id, err)
		}
		delete(w.heads, k.Id)
	}
	rules, err := w.keys(func(k bpf.PolicyKey) bool { return k.Identity != bpf.PolicyHeader && !sets[k.Id] })
	if err != nil || len(rules) == 0 {
		return err
	}
	time.Sleep(w.Grace)
	for _, k := range rules {
		if err := w.m.Policies.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("policy: prune rule set %d: %w", k.Id, err)
		}
	}
	return nil
}

func action(a intent.PolicyAction) uint8 {
	if a == intent.PolicyAllow {
		return bpf.PolicyAllow
	}
	return bpf.PolicyDeny
}
