package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/fluxvm/servicefabric/bpf"
)

// MaxSNATPeers is how many SNAT addresses of other edges a node holds
// (SetSNATPeers).
const MaxSNATPeers = bpf.SNATPeersMax

// SNATPeers is what SetSNATPeers takes, and the body of POST
// /v1/network/services/snat/peers.
type SNATPeers struct {
	// Addresses are the SNAT addresses of the other edges of the node's
	// group: the whole set, at most MaxSNATPeers; empty clears it.
	Addresses []netip.Addr `json:"addresses"`
	// Announce are those of Addresses that the node asks the routing to
	// send to it: the addresses of edges that are gone, which it took
	// over. They are listed in the advertisement snapshot (kind
	// snat-peer), advertised with advertise_snat, so that the adapters
	// announce them beside the VIPs.
	Announce []netip.Addr `json:"announce,omitempty"`
}

// SetSNATPeers replaces the node's SNAT peers: the SNAT addresses of the
// other edges of its group (edges behind the same ECMP router that
// replicate their north-south flows to each other). A flow another edge
// translated to one of them is imported (ImportFlows, FlowDelta imports)
// instead of skipped as foreign, keeps its translation here (the same
// backend, SNAT address and port: the backend sees nothing change), and
// the backends' replies to that address are translated back here, as
// replies to the node's own address are, wherever they arrive (a VM
// edge, a north-south interface). New flows still take the node's own
// SNAT address. Routing those replies here is the routing's: p.Announce
// puts the addresses the node took over into the advertisement snapshot
// (docs/operations.md, "SNAT peers").
//
// p.Addresses is the whole set: unicast addresses, none of them one of
// this node's own SNAT addresses, none twice (an IPv4-mapped IPv6 address
// is refused: write the IPv4 one); p.Announce a subset of it, none twice.
// A refused set changes nothing (ValidationError of kind ErrInvalid
// naming addresses[i] or announce[i]); so does a failed write, which puts
// the earlier set back. The set is kept in the pinned map
// fluxvm_snat_peers, so a restart keeps it; a node without a north-south
// edge refuses it (ErrPrerequisite). Taking an address out while flows
// of it live breaks them: do it once the group no longer routes it here.
func (d *Dataplane) SetSNATPeers(ctx context.Context, p SNATPeers) (SNATStatus, error) {
	if err := d.opened("set SNAT peers"); err != nil {
		return SNATStatus{}, err
	}
	if err := d.needNorthSouth("set SNAT peers"); err != nil {
		return SNATStatus{}, err
	}
	if err := ctx.Err(); err != nil {
		return SNATStatus{}, fmt.Errorf("fluxvm: set SNAT peers: %w", err)
	}
	cfg := d.opts.settings()
	want, err := checkSNATPeers(p, cfg.SNATAddressFor(false), cfg.SNATAddressFor(true))
	if err != nil {
		return SNATStatus{}, fmt.Errorf("fluxvm: set SNAT peers: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("set SNAT peers"); err != nil {
		return SNATStatus{}, err
	}
	if err := d.writeSNATPeers(want); err != nil {
		return SNATStatus{}, fmt.Errorf("fluxvm: set SNAT peers: %w", err)
	}
	d.advertise()
	st := d.snatStatus()
	d.log.Info("fluxvm: SNAT peers set", "peers", st.Peers, "announced", st.Announced)
	return st, nil
}

// checkSNATPeers validates a set for SetSNATPeers and returns its
// entries sorted by address.
func checkSNATPeers(p SNATPeers, own4, own6 netip.Addr) ([]bpf.SNATPeer, error) {
	if len(p.Addresses) > MaxSNATPeers {
		return nil, verr(ErrInvalid, "addresses", "%d addresses, at most %d", len(p.Addresses), MaxSNATPeers)
	}
	index := make(map[netip.Addr]int, len(p.Addresses))
	out := make([]bpf.SNATPeer, 0, len(p.Addresses))
	for i, a := range p.Addresses {
		field := fmt.Sprintf("addresses[%d]", i)
		if why := snatAddrProblem(a); why != "" {
			return nil, verr(ErrInvalid, field, "%s", why)
		}
		if a == own4 || a == own6 {
			return nil, verr(ErrInvalid, field, "%s is this node's own SNAT address", a)
		}
		if j, dup := index[a]; dup {
			return nil, verr(ErrInvalid, field, "%s is addresses[%d] too", a, j)
		}
		index[a] = i
		out = append(out, bpf.SNATPeer{Addr: a})
	}
	announced := make(map[netip.Addr]int, len(p.Announce))
	for i, a := range p.Announce {
		field := fmt.Sprintf("announce[%d]", i)
		j, ok := index[a]
		if !ok {
			return nil, verr(ErrInvalid, field, "%s is not among the addresses: announce only peers' addresses this node holds", a)
		}
		if k, dup := announced[a]; dup {
			return nil, verr(ErrInvalid, field, "%s is announce[%d] too", a, k)
		}
		announced[a] = i
		out[j].Announce = true
	}
	slices.SortFunc(out, func(a, b bpf.SNATPeer) int { return a.Addr.Compare(b.Addr) })
	return out, nil
}

// writeSNATPeers makes fluxvm_snat_peers hold want and fluxvm_snat's
// SNATFlagPeers say whether it holds any, in the order that never
// leaves a packet to an address of either set untranslated: the new
// entries first, then the flag, then the old addresses out. On error it
// puts the earlier set back. d.mu held.
func (d *Dataplane) writeSNATPeers(want []bpf.SNATPeer) error {
	peers, err := bpf.NewSNATPeers(d.dp.Maps().FluxvmSnatPeers)
	if err != nil {
		return err
	}
	old := d.snatPeers
	has := func(set []bpf.SNATPeer, a netip.Addr) bool {
		return slices.ContainsFunc(set, func(p bpf.SNATPeer) bool { return p.Addr == a })
	}
	var gone, added []netip.Addr
	for _, p := range old {
		if !has(want, p.Addr) {
			gone = append(gone, p.Addr)
		}
	}
	for _, p := range want {
		if !has(old, p.Addr) {
			added = append(added, p.Addr)
		}
	}
	undo := func(err error) error {
		return errors.Join(err, peers.Put(old), peers.Remove(added), d.dp.Maps().FluxvmSnat.Put(uint32(0), d.snat))
	}
	if err := peers.Put(want); err != nil {
		return undo(err)
	}
	v := d.snat
	v.Flags &^= bpf.SNATFlagPeers
	if len(want) > 0 {
		v.Flags |= bpf.SNATFlagPeers
	}
	v.PeerFilter = peerFilter(want)
	if err := d.dp.Maps().FluxvmSnat.Put(uint32(0), v); err != nil {
		return undo(fmt.Errorf("snat config: %w", err))
	}
	if err := peers.Remove(gone); err != nil {
		return undo(err)
	}
	d.snat, d.snatPeers = v, want
	return nil
}

// readSNATPeers loads the set an earlier start left in the pinned map
// (Open, before writeSNAT).
func (d *Dataplane) readSNATPeers() error {
	peers, err := bpf.NewSNATPeers(d.dp.Maps().FluxvmSnatPeers)
	if err != nil {
		return err
	}
	d.snatPeers, err = peers.List()
	return err
}

// snatPeerAddrs are the set's addresses, for imports (which run without
// d.mu).
func (d *Dataplane) snatPeerAddrs() []netip.Addr {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]netip.Addr, len(d.snatPeers))
	for i, p := range d.snatPeers {
		out[i] = p.Addr
	}
	return out
}

// peerFilter is fluxvm_snat's peer_filter for a set (bpf.SNATPeerFilter).
func peerFilter(peers []bpf.SNATPeer) uint32 {
	addrs := make([]netip.Addr, len(peers))
	for i, p := range peers {
		addrs[i] = p.Addr
	}
	return bpf.SNATPeerFilter(addrs)
}
