//go:build linux

package ecmplab

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
)

// peersOf is what the lab sets as e's SNAT peers: the SNAT addresses of
// every other edge of the lab (running or not: a gone edge's flows are
// the ones to continue), and, to announce, those e took over.
func (l *Lab) peersOf(e *Edge) fluxvm.SNATPeers {
	p := fluxvm.SNATPeers{Addresses: []netip.Addr{}}
	for _, o := range l.Edges {
		if o == e {
			continue
		}
		p.Addresses = append(p.Addresses, o.SNAT)
		if l.held[o.SNAT] == e {
			p.Announce = append(p.Announce, o.SNAT)
		}
	}
	return p
}

// setPeers posts e's SNAT peers over REST, as Fabric would, and checks
// the answer names them.
func (l *Lab) setPeers(ctx context.Context, e *Edge) error {
	want := l.peersOf(e)
	var st fluxvm.SNATStatus
	if err := e.Request(ctx, "POST", "/v1/network/services/snat/peers", want, &st); err != nil {
		return fmt.Errorf("ecmplab: SNAT peers of %s: %w", e.Name, err)
	}
	slices.SortFunc(want.Addresses, netip.Addr.Compare)
	slices.SortFunc(want.Announce, netip.Addr.Compare)
	if !slices.Equal(st.Peers, want.Addresses) || !slices.Equal(st.Announced, want.Announce) {
		return fmt.Errorf("ecmplab: %s holds SNAT peers %v announcing %v, want %v announcing %v", e.Name, st.Peers, st.Announced, want.Addresses, want.Announce)
	}
	return nil
}

// syncPeers sets every running edge's SNAT peers.
func (l *Lab) syncPeers(ctx context.Context) error {
	for _, e := range l.Edges {
		if e.Running() {
			if err := l.setPeers(ctx, e); err != nil {
				return err
			}
		}
	}
	return nil
}

// TakeOver makes edge by take over the SNAT address of edge gone, which
// must not run (killed or stopped): by's SNAT peers get gone's address
// to announce (POST /v1/network/services/snat/peers with announce), its
// adapter puts it into BIRD beside the VIPs (kind snat-peer), and the
// router routes it to by. It returns once the router's kernel route to
// the address names by alone, with the time from the POST to that. The
// address goes back to gone when gone starts again (Start). In a group
// the replicator first drops gone from its members (Regroup).
func (l *Lab) TakeOver(ctx context.Context, gone, by *Edge) (time.Duration, error) {
	switch {
	case gone == by:
		return 0, fmt.Errorf("ecmplab: %s cannot take over its own SNAT address", gone.Name)
	case gone.Running():
		return 0, fmt.Errorf("ecmplab: %s still runs: its SNAT address is its own", gone.Name)
	case !by.Running():
		return 0, fmt.Errorf("ecmplab: %s does not run", by.Name)
	}
	if l.cfg.Group {
		// The gone edge leaves the group (its lease ended, for Fabric):
		// the replicator no longer waits for it.
		if err := l.Regroup(ctx); err != nil {
			return 0, err
		}
	}
	prev, had := l.held[gone.SNAT]
	l.held[gone.SNAT] = by
	start := time.Now()
	if err := l.setPeers(ctx, by); err != nil {
		if had {
			l.held[gone.SNAT] = prev
		} else {
			delete(l.held, gone.SNAT)
		}
		return 0, err
	}
	if had && prev != by && prev.Running() {
		if err := l.setPeers(ctx, prev); err != nil { // it no longer announces it
			return 0, err
		}
	}
	if _, err := l.WaitNexthops(ctx, gone.SNAT, []*Edge{by}, 20*time.Second); err != nil {
		return time.Since(start), fmt.Errorf("ecmplab: %s's SNAT address taken over by %s: %w", gone.Name, by.Name, err)
	}
	return time.Since(start), nil
}

// HeldBy is the edge that took e's SNAT address over (TakeOver), nil
// while it is e's own.
func (l *Lab) HeldBy(e *Edge) *Edge { return l.held[e.SNAT] }
