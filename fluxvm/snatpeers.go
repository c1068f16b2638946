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

// SetSNATPeers replaces the node's SNAT peers: the SNAT addresses of the
// other edges of its group (edges behind the same ECMP router that
// replicate their north-south flows to each other). A flow another edge
// translated to one of them is imported (ImportFlows, FlowDelta imports)
// instead of skipped as foreign, keeps its translation here (the same
// backend, SNAT address and port: the backend sees nothing change), and
// the backends' replies to that address are translated back here, as
// replies to the node's own address are, wherever they arrive (a VM
// edge, a north-south interface). New flows still take the node's own
// SNAT address. Routing those replies to this node is the routing's: the
// group's BGP announcements (docs/operations.md, "SNAT peers").
//
// addrs is the whole set (empty clears it), at most MaxSNATPeers
// addresses, each a unicast address that is not one of this node's own
// SNAT addresses, none twice (an IPv4-mapped IPv6 address is refused:
// write the IPv4 one). A refused set changes nothing (ValidationError of
// kind ErrInvalid naming addresses[i]); so does a failed write, which
// puts the earlier set back. The set is kept in the pinned map
// fluxvm_snat_peers, so a restart keeps it; a node without a north-south
// edge refuses it (ErrPrerequisite). Taking an address out while flows
// of it live breaks them: do it once the group no longer routes it here.
func (d *Dataplane) SetSNATPeers(ctx context.Context, addrs []netip.Addr) (SNATStatus, error) {
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
	want, err := checkSNATPeers(addrs, cfg.SNATAddressFor(false), cfg.SNATAddressFor(true))
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
	d.log.Info("fluxvm: SNAT peers set", "peers", want)
	return d.snatStatus(), nil
}

// checkSNATPeers validates a set for SetSNATPeers and returns it sorted.
func checkSNATPeers(addrs []netip.Addr, own4, own6 netip.Addr) ([]netip.Addr, error) {
	if len(addrs) > MaxSNATPeers {
		return nil, verr(ErrInvalid, "addresses", "%d addresses, at most %d", len(addrs), MaxSNATPeers)
	}
	seen := make(map[netip.Addr]int, len(addrs))
	for i, a := range addrs {
		field := fmt.Sprintf("addresses[%d]", i)
		if p := snatAddrProblem(a); p != "" {
			return nil, verr(ErrInvalid, field, "%s", p)
		}
		if a == own4 || a == own6 {
			return nil, verr(ErrInvalid, field, "%s is this node's own SNAT address", a)
		}
		if j, dup := seen[a]; dup {
			return nil, verr(ErrInvalid, field, "%s is addresses[%d] too", a, j)
		}
		seen[a] = i
	}
	out := slices.Clone(addrs)
	slices.SortFunc(out, netip.Addr.Compare)
	return out, nil
}

// writeSNATPeers makes fluxvm_snat_peers hold want and fluxvm_snat's
// SNATFlagPeers say whether it holds any, in the order that never
// leaves a packet to an address of either set untranslated: the new
// addresses first, then the flag, then the old ones out. On error it
// puts the earlier set back. d.mu held.
func (d *Dataplane) writeSNATPeers(want []netip.Addr) error {
	peers, err := bpf.NewSNATPeers(d.dp.Maps().FluxvmSnatPeers)
	if err != nil {
		return err
	}
	old := d.snatPeers
	added := slices.DeleteFunc(slices.Clone(want), func(a netip.Addr) bool { return slices.Contains(old, a) })
	gone := slices.DeleteFunc(slices.Clone(old), func(a netip.Addr) bool { return slices.Contains(want, a) })
	if err := peers.Add(added); err != nil {
		return err
	}
	v := d.snat
	v.Flags &^= bpf.SNATFlagPeers
	if len(want) > 0 {
		v.Flags |= bpf.SNATFlagPeers
	}
	if err := d.dp.Maps().FluxvmSnat.Put(uint32(0), v); err != nil {
		return errors.Join(fmt.Errorf("snat config: %w", err), peers.Remove(added))
	}
	if err := peers.Remove(gone); err != nil {
		// Back to the earlier set: its addresses in, its flag.
		return errors.Join(err, peers.Add(gone), d.dp.Maps().FluxvmSnat.Put(uint32(0), d.snat), peers.Remove(added))
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

// snatPeersCopy is the current set, for imports (which run without d.mu).
func (d *Dataplane) snatPeersCopy() []netip.Addr {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.snatPeers)
}
