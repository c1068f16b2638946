// Package conntrack is the typed view of the datapath's forward-affinity
// maps, fluxvm_fct4 and fluxvm_fct6, and their garbage collector.
//
// # What the maps hold
//
// The TC program at the VM edge pins every flow to a backend. The first
// packet of a flow from a client to a service VIP takes the Maglev pick
// among the service's Ready backends; the program then remembers the
// choice in a conntrack entry keyed by the client's view of the flow:
//
//	key   (Key)    client addr:port -> VIP addr:port, protocol
//	value (Entry)  service id, backend id, protocol state,
//	               created, last seen, deadline
//
// Later packets of the flow find the entry and go to the same backend as
// long as it is Ready, or Draining with its drain deadline ahead, even when
// the Maglev table has changed meanwhile. An Unhealthy or removed backend
// makes the flow fail over to a new pick.
//
// For an east-west flow that entry is all the program learns (program
// generation 4 on): replies backend -> client carry no VIP, and the
// program finds their flow through the control plane's index of backend
// endpoints (fluxvm_be2fe: backend -> the frontends that list it), as the
// conntrack entry client -> VIP of one of those frontends that names this
// backend, and translates them from it. Such an entry has
// Entry.ReverseDerived (bpf.CTFlagRevDerived) and no other half.
//
// A frontend the index has no room for (bpf.SvcFlagRevStored), and every
// east-west flow learned by an earlier program generation, also has the
// flow's other half: a reverse-NAT entry keyed by the reply's view
// (backend -> client), which turns replies back into packets from the
// VIP; see package nat. These are stored flows.
//
// # Flow kinds
//
// Entry.Kind says how the flow is forwarded:
//
//   - EastWest: DNAT only, at the VM edge. No NAT half when
//     Entry.ReverseDerived (replies are derived from the entry);
//     otherwise (a stored flow) NAT half (backend -> client).
//   - SNAT: a north-south flow in NAT mode; the source is translated too,
//     to Entry.SNAT (the node's SNAT address and a port allocated for the
//     flow). NAT half (backend -> SNAT addr:port), an SNAT mapping whose
//     origin is the client (nat.Entry.SNAT, nat.Entry.Origin).
//   - DSR: routed direct server return; nothing is translated, the backend
//     answers the client directly, and there is no NAT half.
//   - L7: handed untranslated to an L7 proxy (L7 enforce) on
//     Entry.ProxyIfindex; no backend and no NAT half. GC keeps it until
//     it expires.
//
// The key is the client's view (client -> VIP) for every kind. Entries
// written by program generation 1 carry no kind flags and are EastWest,
// which is what they are. ReverseDerived is not a kind: an east-west flow
// with or without it is forwarded the same way; it says only where its
// replies find their translation.
//
// # Protocol states and deadlines
//
// An entry carries a protocol state (bpf.CTState): TCP SYN, established,
// FIN or RST, or UDP. Each state has its own idle timeout (Timeouts), and
// the datapath sets Deadline to the last packet plus that timeout, at most
// once a second per flow so a busy flow does not write its entry on every
// packet. The datapath never deletes an entry; removing expired ones is
// GC's job. The loader writes the timeouts into the meta map
// (Timeouts.ApplyTo); a zero field there means the built-in default.
//
// # The pairing rule
//
// A stored or SNAT flow is two entries in two LRU maps, and either may be
// evicted alone when a map is full, a known failure of other dataplanes: a
// conntrack entry without its reverse-NAT half black-holes replies, and a
// reverse-NAT entry without its conntrack half is either a flow whose
// forward state was lost or garbage holding a slot. A flow with derived
// replies is one entry: it cannot be half lost, and it never has a half.
// So:
//
//   - a reverse-NAT half never outlives or lacks its conntrack half;
//   - GC removes both halves of a flow together (the NAT key is the
//     backend's address and port, found in fluxvm_backends by the entry's
//     backend id, and the client from the conntrack key, or for an SNAT
//     flow its SNAT address and port; a DSR flow and a flow with derived
//     replies have no NAT half);
//   - a NAT entry pairs only with a conntrack entry of its own kind: an
//     east-west entry with a stored EastWest flow, an SNAT mapping with an
//     SNAT flow translated to the mapping's own address and port; any
//     other conntrack entry at its key supersedes it, a flow with derived
//     replies included (the NAT entry is a leftover of an earlier, stored
//     flow on the tuple);
//   - GC repairs what eviction broke: a conntrack entry without its NAT half
//     gets it back while its backend exists, unless it has derived
//     replies; a NAT entry without its conntrack half gets it back, as a
//     stored flow, if it is fresh (replies seen within the established or
//     UDP timeout) and its backend still keeps flows, and is removed
//     otherwise; a NAT entry whose conntrack half names another backend
//     (the flow failed over) or is not of its kind is removed. A repair
//     never overwrites: an SNAT port another flow took after this flow's
//     mapping was evicted stays that flow's.
//
// The datapath helps from its side: it recreates a missing NAT half when it
// refreshes a stored conntrack entry, and a missing conntrack half from a
// reply that found a stored half. A flow with derived replies whose
// conntrack entry was evicted is lost like any flow whose forward state
// is: its next packet takes a fresh pick.
//
// # GC
//
// Map.GC removes (a) expired entries, (b) entries whose backend is
// Draining past its drain deadline and (c) entries whose backend slot is
// unused or belongs to another service, then repairs orphans, and returns
// a GCResult with counts per reason. It streams the maps in bounded chunks
// with batch map commands (key-by-key iteration on kernels without them),
// so its memory does not grow with the number of flows. Call it
// periodically, e.g. every few seconds; a shorter interval than the
// shortest timeout buys nothing.
//
// # Clocks
//
// Entry times are durations since boot on CLOCK_MONOTONIC_COARSE, the
// clock the datapath reads with bpf_ktime_get_coarse_ns; they are not
// wall-clock times. GC takes its notion of now as an argument so that
// callers (and tests) decide the instant; Now reads the right clock.
package conntrack
