package policy

import (
	"cmp"
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
// ever meets half of a policy:
//
//   - a policy's rules go under a rule set id its headers do not name
//     (each policy has two, 2*ID and 2*ID+1), the headers switch to them
//     one map update each, and the old set goes after Grace (a packet
//     that read an old header may still look its rules up);
//   - Attach writes the header of a datapath service before the caller
//     sets bpf.SvcFlagPolicy on its frontend, and Detach removes headers
//     only after the caller cleared the flag (a flag without a header
//     drops: fail closed).
//
// An ipcache change is not atomic over several prefixes: a caller that
// must not let any packet be decided by a mix of old and new identities
// closes the guards of the services concerned around SetIPCache and the
// Attach calls that follow (IPCacheChanges tells whether there is one).
//
// A Writer is not safe for concurrent use; the dataplane calls it under
// its lock.
type Writer struct {
	m Maps
	// set is the rule set id each policy (by ID) names now; rules what
	// that set holds.
	set   map[uint32]uint32
	rules map[uint32][]Rule
	// members are the identities each rule set id holds in the map.
	members map[uint32][]uint32
	// heads are the headers written, by datapath service id.
	heads map[uint32]bpf.PolicyValue
	// ipc is the ipcache as the tries hold it.
	ipc map[netip.Prefix]uint32
	// retired are rule sets no header names any more, to go after Grace;
	// retiredRules counts their rules.
	retired      []uint32
	retiredRules int
	// Grace is how long the Writer waits before it removes a rule set no
	// header names any more (BPF programs run in RCU read sections of
	// microseconds). Default DefaultGrace.
	Grace time.Duration
	// Spare bounds the rules of retired sets waiting for their grace (the
	// room fluxvm_spol has beyond the live rules and headers): an Attach
	// that would pass it waits out the grace and removes them first.
	// Default DefaultSpare.
	Spare int
}

// Defaults of a Writer.
const (
	DefaultGrace = 10 * time.Millisecond
	// DefaultSpare is the room the datapath's policy map keeps beyond its
	// rules and headers: one policy's two lists of identities.
	DefaultSpare = 2 * intent.MaxPolicyIdentities
)

// NewWriter checks the maps' layouts and returns a Writer over them. The
// maps may hold a previous process's state: the Writer adopts it (headers,
// rule sets and their contents, the ipcache), so that writing the same
// Program again writes nothing.
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
	w := &Writer{m: m, set: map[uint32]uint32{}, rules: map[uint32][]Rule{}, members: map[uint32][]uint32{},
		heads: map[uint32]bpf.PolicyValue{}, ipc: map[netip.Prefix]uint32{}, Grace: DefaultGrace, Spare: DefaultSpare}
	sets := map[uint32][]Rule{}
	var k bpf.PolicyKey
	var v bpf.PolicyValue
	it := m.Policies.Iterate()
	for it.Next(&k, &v) {
		if k.Identity == bpf.PolicyHeader {
			w.heads[k.Id] = v
			w.set[v.Rules/2] = v.Rules
			continue
		}
		w.members[k.Id] = append(w.members[k.Id], k.Identity)
		sets[k.Id] = append(sets[k.Id], Rule{Identity: intent.Identity(k.Identity), Action: actionOf(v.Action)})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("policy: read fluxvm_spol: %w", err)
	}
	for id, set := range w.set {
		r := sets[set]
		slices.SortFunc(r, func(a, b Rule) int { return cmp.Compare(a.Identity, b.Identity) })
		w.rules[id] = append([]Rule{}, r...)
	}
	for _, t := range []*ebpf.Map{m.SID4, m.SID6} {
		kb := make([]byte, t.KeySize())
		var sv bpf.SIDValue
		it := t.Iterate()
		for it.Next(&kb, &sv) {
			if pf, ok := prefixOf(kb); ok {
				w.ipc[pf] = sv.Identity
			}
		}
		if err := it.Err(); err != nil {
			return nil, fmt.Errorf("policy: read the ipcache: %w", err)
		}
	}
	return w, nil
}

// prefixOf decodes a trie key: its prefix length, then the address.
func prefixOf(k []byte) (netip.Prefix, bool) {
	bits := int(k[0]) | int(k[1])<<8 | int(k[2])<<16 | int(k[3])<<24
	a, ok := netip.AddrFromSlice(k[4:])
	if !ok || bits > a.BitLen() {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, bits), true
}

// IPCacheChanges reports whether SetIPCache(p) would change the tries.
func (w *Writer) IPCacheChanges(p *Program) bool {
	if len(p.IPv4)+len(p.IPv6) != len(w.ipc) {
		return true
	}
	for _, l := range [][]intent.IPCacheEntry{p.IPv4, p.IPv6} {
		for _, e := range l {
			if id, ok := w.ipc[e.Prefix]; !ok || id != uint32(e.Identity) {
				return true
			}
		}
	}
	return false
}

// SetIPCache makes the identity tries hold exactly p's ipcache: new and
// changed prefixes first, then the ones gone. Each prefix changes in one
// update; see Writer for a change over several.
func (w *Writer) SetIPCache(p *Program) error {
	want := make(map[netip.Prefix]bool, len(p.IPv4)+len(p.IPv6))
	for _, l := range [][]intent.IPCacheEntry{p.IPv4, p.IPv6} {
		for _, e := range l {
			want[e.Prefix] = true
			if id, ok := w.ipc[e.Prefix]; ok && id == uint32(e.Identity) {
				continue
			}
			m, k := w.sidKey(e.Prefix)
			if err := m.Put(k, bpf.SIDValue{Identity: uint32(e.Identity)}); err != nil {
				return fmt.Errorf("policy: ipcache %s: %w", e.Prefix, err)
			}
			w.ipc[e.Prefix] = uint32(e.Identity)
		}
	}
	for pf := range w.ipc {
		if want[pf] {
			continue
		}
		m, k := w.sidKey(pf)
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("policy: ipcache %s: %w", pf, err)
		}
		delete(w.ipc, pf)
	}
	return nil
}

func (w *Writer) sidKey(pf netip.Prefix) (*ebpf.Map, any) {
	if pf.Addr().Is4() {
		return w.m.SID4, bpf.SIDKey4{Prefixlen: uint32(pf.Bits()), Addr: bpf.AddrWords(pf.Addr())[0]}
	}
	return w.m.SID6, bpf.SIDKey6{Prefixlen: uint32(pf.Bits()), Addr: bpf.AddrWords(pf.Addr())}
}

// Attach makes the headers of datapath services sids name policy c, with
// c's rules in place first (a new rule set when they changed: every header
// naming the old set moves to it). Call it before setting
// bpf.SvcFlagPolicy on those frontends; a disabled policy has no headers
// (Detach them).
func (w *Writer) Attach(c *Compiled, sids []uint32) error {
	if c.ID == 0 {
		return fmt.Errorf("policy: attach %s: no policy id", c.Service)
	}
	set, ok := w.set[c.ID]
	if !ok || !slices.Equal(w.rules[c.ID], c.Rules) {
		next := 2 * c.ID
		if ok && set == next {
			next++
		}
		if w.retiredRules+len(c.Rules) > w.Spare {
			if err := w.flush(); err != nil {
				return err
			}
		}
		// A set no header names: whatever it holds goes first.
		if err := w.clearSet(next); err != nil {
			return err
		}
		for _, r := range c.Rules {
			if err := w.m.Policies.Put(bpf.PolicyKey{Id: next, Identity: uint32(r.Identity)}, bpf.PolicyValue{Action: action(r.Action)}); err != nil {
				return fmt.Errorf("policy: %s: rule %d: %w", c.Service, r.Identity, err)
			}
			w.members[next] = append(w.members[next], uint32(r.Identity))
		}
		if ok {
			for sid, h := range w.heads {
				if h.Rules == set && !slices.Contains(sids, sid) {
					sids = append(sids, sid)
				}
			}
		}
		w.set[c.ID], w.rules[c.ID] = next, append([]Rule{}, c.Rules...)
		if err := w.putHeads(c, sids); err != nil {
			return err
		}
		if ok {
			w.retire(set)
		}
		return nil
	}
	return w.putHeads(c, sids)
}

func (w *Writer) putHeads(c *Compiled, sids []uint32) error {
	h := bpf.PolicyValue{Rules: w.set[c.ID], Revision: c.Revision, Action: action(c.Default)}
	if c.AuditOnly {
		h.Flags |= bpf.PolicyFlagAudit
	}
	if c.Redirects() {
		h.Flags |= bpf.PolicyFlagL7
		h.ProxyIfindex = c.ProxyIfindex
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

// retire schedules rule set id to go after the grace.
func (w *Writer) retire(id uint32) {
	if !slices.Contains(w.retired, id) {
		w.retired = append(w.retired, id)
		w.retiredRules += len(w.members[id])
	}
}

// flush waits out the grace and removes the retired rule sets.
func (w *Writer) flush() error {
	if len(w.retired) == 0 {
		return nil
	}
	time.Sleep(w.Grace)
	for len(w.retired) > 0 {
		if err := w.clearSet(w.retired[0]); err != nil {
			return err
		}
		w.retired = w.retired[1:]
	}
	w.retiredRules = 0
	return nil
}

// clearSet removes every rule of rule set id from the map.
func (w *Writer) clearSet(id uint32) error {
	for _, ident := range w.members[id] {
		if err := w.m.Policies.Delete(bpf.PolicyKey{Id: id, Identity: ident}); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("policy: rule set %d: %w", id, err)
		}
	}
	delete(w.members, id)
	return nil
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
// bpf.SvcFlagPolicy), then, after Grace, the rule sets no header names,
// those of policies p lacks or has disabled included.
func (w *Writer) Prune(p *Program, keep func(sid uint32) bool) error {
	for sid := range w.heads {
		if !keep(sid) {
			if err := w.Detach([]uint32{sid}); err != nil {
				return err
			}
		}
	}
	enabled := map[uint32]bool{}
	for _, c := range p.Policies {
		if c.Enabled {
			enabled[c.ID] = true
		}
	}
	named := map[uint32]bool{}
	for _, h := range w.heads {
		named[h.Rules] = true
	}
	for id, s := range w.set {
		if !enabled[id] || !named[s] {
			delete(w.set, id)
			delete(w.rules, id)
		}
	}
	live := map[uint32]bool{}
	for _, s := range w.set {
		live[s] = true
	}
	for s := range w.members {
		if !live[s] {
			w.retire(s)
		}
	}
	return w.flush()
}

func action(a intent.PolicyAction) uint8 {
	if a == intent.PolicyAllow {
		return bpf.PolicyAllow
	}
	return bpf.PolicyDeny
}

func actionOf(a uint8) intent.PolicyAction {
	if a == bpf.PolicyAllow {
		return intent.PolicyAllow
	}
	return intent.PolicyDeny
}
