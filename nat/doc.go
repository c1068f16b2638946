// Package nat is the typed view of the datapath's reverse-NAT maps,
// fluxvm_nat4 and fluxvm_nat6.
//
// # What the maps hold
//
// When the TC program at the VM edge sends a new flow from a client to a
// service VIP, it rewrites the destination to the backend it picked (DNAT)
// and learns a conntrack entry, keyed by the client's view of the flow
// (client -> VIP, package conntrack). Since program generation 4 that is
// all a new east-west flow learns: its replies are translated from the
// conntrack entry, which they find through the control plane's index of
// backend endpoints (fluxvm_be2fe), and the flow has no reverse-NAT entry
// (conntrack.Entry.ReverseDerived). A frontend the index has no room for
// (bpf.SvcFlagRevStored) still stores one per flow, as every east-west
// flow of earlier generations did, keyed by the reply as it will leave the
// backend:
//
//	key   (Key)    backend addr:port -> client addr:port, protocol
//	value (Entry)  VIP addr:port, service id, backend id, last seen
//
// A reply from the backend that the index does not find the flow of
// finds this entry by its own addresses and has its source rewritten back
// to the VIP and port the client addressed, so the client never sees the
// backend. Without the entry the reply of such a flow leaves untranslated
// and the client drops it: a reverse-NAT entry is as important as the
// conntrack entry it belongs to. The maps therefore hold fewer entries
// than there are flows: SNAT mappings (below) and the stored east-west
// halves only.
//
// # SNAT mappings
//
// A north-south flow in NAT mode has its source translated as well, to the
// node's SNAT address and a port allocated for the flow, so that the
// backend's replies come back through the node. Its reverse-NAT entry is
// an SNAT mapping (Entry.SNAT):
//
//	key   (Key)    backend addr:port -> SNAT addr:port, protocol
//	value (Entry)  VIP addr:port, service id, backend id, last seen,
//	               SNAT, Origin (the client's own addr:port)
//
// A reply to the SNAT address gets the VIP as its source and Origin as its
// destination back. The datapath allocates the port by inserting the
// mapping with BPF_NOEXIST, so a live mapping's key is never handed to a
// second flow; a flow whose mapping was evicted and whose port another
// flow took is dropped by the datapath (an SNAT conflict) rather than mix
// the two flows' replies. Routed DSR flows are not translated and have no
// reverse-NAT entry at all. Entry.HostRouting marks entries of services
// with host routing, whose replies the datapath forwards by FIB lookup.
//
// Entries written by program generation 1 carry no flags: they read as
// the east-west entries they are.
//
// Both maps are LRU hashes sized by the object's tier. The datapath
// refreshes LastSeen at most once a second per flow, on replies, with
// bpf_ktime_get_coarse_ns; LastSeen is therefore time since boot on
// CLOCK_MONOTONIC_COARSE, not wall-clock time.
//
// # Ownership and the pairing rule
//
// This package is the only code that reads or writes the bytes of these
// maps; everything else goes through Table. A reverse-NAT entry is one half
// of a flow whose other half is the conntrack entry, and a half must never
// outlive or lack the other; a flow with derived replies has no half and
// must never get one (an east-west entry at its key is a leftover of an
// earlier flow on the tuple). Keeping that true is the job of conntrack's
// garbage collector (conntrack.Map.GC), which removes and repairs halves
// through this package; Table itself enforces nothing across the two maps.
//
// # Concurrency
//
// A Table is safe for concurrent use, and the datapath writes the maps all
// the time: an entry read may be refreshed, replaced or evicted a moment
// later. Create never overwrites (use it for repairs), Put always does.
// Scan streams the maps in bounded chunks (batch map commands where the
// kernel has them, key-by-key iteration where it answers
// ebpf.ErrNotSupported), so memory does not grow with the map.
package nat
