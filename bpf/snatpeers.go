package bpf

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"
)

// SNATPeersMax is how many addresses fluxvm_snat_peers holds.
const SNATPeersMax = int(serviceFluxvmAbiConstFLUXVM_SNAT_PEERS_MAX)

// SNATFlagPeers (SNATConfig.Flags) makes the datapath look replies'
// destinations up in fluxvm_snat_peers too.
const SNATFlagPeers = uint32(serviceFluxvmSnatFlagsFLUXVM_SNAT_F_PEERS)

// SNATPeerKey and SNATPeerValue are fluxvm_snat_peers' layouts.
type (
	SNATPeerKey   = serviceFluxvmSnatPeerKey
	SNATPeerValue = serviceFluxvmSnatPeerValue
)

// SNATPeerKeyOf is the key of address a (IPv4 or IPv6; a 4-in-6 address
// is its IPv4 one).
func SNATPeerKeyOf(a netip.Addr) SNATPeerKey {
	a = a.Unmap()
	k := SNATPeerKey{Addr: AddrWords(a), Family: FamilyIPv4}
	if a.Is6() {
		k.Family = FamilyIPv6
	}
	return k
}

// SNATPeerFlagAnnounce (SNATPeerValue.Flags) marks a peer address this
// node announces: it took it over from an edge that is gone. The
// datapath reads only the key; the flag is the control plane's.
const SNATPeerFlagAnnounce = serviceFluxvmSnatPeerFlagsFLUXVM_SNAT_PEER_F_ANNOUNCE

// SNATPeer is one entry of fluxvm_snat_peers.
type SNATPeer struct {
	Addr     netip.Addr
	Announce bool // SNATPeerFlagAnnounce
}

// SNATPeerFilter is the peer_filter word of fluxvm_snat (SNATConfig) for
// the addresses: the bit of each, as the datapath computes it
// (lib/snat.h, fluxvm_snat_peer_bit). The datapath looks an address up in
// fluxvm_snat_peers only when its bit is set, so the word must hold every
// address of the map.
func SNATPeerFilter(addrs []netip.Addr) uint32 {
	var f uint32
	for _, a := range addrs {
		w := AddrWords(a.Unmap())
		x := w[0]
		if a.Unmap().Is6() {
			x ^= w[1] ^ w[2] ^ w[3]
		}
		f |= 1 << ((x * 0x9E3779B1) >> 27)
	}
	return f
}

// SNATPeers reads and writes fluxvm_snat_peers: the SNAT addresses of the
// other edges of this node's group, whose flows (brought here by
// replication) the datapath continues with their own translation and
// whose replies it translates back. The SNATFlagPeers flag of
// fluxvm_snat is the caller's: set it once the addresses are in, clear it
// before the last goes.
type SNATPeers struct{ m *ebpf.Map }

// NewSNATPeers wraps the map m (fluxvm_snat_peers).
func NewSNATPeers(m *ebpf.Map) (SNATPeers, error) {
	if m == nil {
		return SNATPeers{}, errors.New("snat peers: no map")
	}
	return SNATPeers{m: m}, nil
}

// List returns the entries of the map, sorted by address.
func (p SNATPeers) List() ([]SNATPeer, error) {
	var (
		k    SNATPeerKey
		v    SNATPeerValue
		out  []SNATPeer
		iter = p.m.Iterate()
	)
	for iter.Next(&k, &v) {
		if k.Family != FamilyIPv4 && k.Family != FamilyIPv6 {
			return nil, fmt.Errorf("snat peers: entry of family %d", k.Family)
		}
		out = append(out, SNATPeer{Addr: Addr(k.Addr, k.Family), Announce: v.Flags&SNATPeerFlagAnnounce != 0})
	}
	if err := iter.Err(); err != nil {
		return nil, fmt.Errorf("snat peers: list: %w", err)
	}
	slices.SortFunc(out, func(a, b SNATPeer) int { return a.Addr.Compare(b.Addr) })
	return out, nil
}

// Put adds the entries, or updates the flags of those the map has. It
// stops at the first error: the caller puts its earlier set back.
func (p SNATPeers) Put(peers []SNATPeer) error {
	for _, e := range peers {
		var v SNATPeerValue
		if e.Announce {
			v.Flags = SNATPeerFlagAnnounce
		}
		if err := p.m.Update(SNATPeerKeyOf(e.Addr), v, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("snat peers: put %s: %w", e.Addr, err)
		}
	}
	return nil
}

// Remove takes addresses out of the map; absent ones are no error.
func (p SNATPeers) Remove(addrs []netip.Addr) error {
	var errs []error
	for _, a := range addrs {
		if err := p.m.Delete(SNATPeerKeyOf(a)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("snat peers: remove %s: %w", a, err))
		}
	}
	return errors.Join(errs...)
}
