// Package flows is FluxScope: the flow records the datapath keeps in
// fluxvm_sflows (bpf/lib/flows.h), read as typed Records, and their export.
//
// A Record is one flow as the datapath saw it: the client's own view (its
// address and port, the VIP and port), what it was translated to (the
// backend, and the SNAT address for north-south flows), the verdict with
// the reason of the last drop, and its packets and bytes each way.
package flows

import (
	"net/netip"
	"time"
)

// Verdict is what the datapath did with a flow.
type Verdict string

// Verdicts.
const (
	Forwarded  Verdict = "forwarded"
	Dropped    Verdict = "dropped"
	Audited    Verdict = "audited"    // policy: forwarded, would have been denied
	Redirected Verdict = "redirected" // L7: sent to the proxy
)

// Counts are a direction's packets and bytes (L2 frames, as the TC and XDP
// programs see them).
type Counts struct {
	Packets uint64 `json:"packets"`
	Bytes   uint64 `json:"bytes"`
}

// Record is one flow.
type Record struct {
	// Seq orders records by when the datapath opened them (newer is
	// larger) and identifies one: a slot of the ring holds many records
	// over time.
	Seq uint64 `json:"seq"`
	// Service is the name of the service the flow went to ("" when the
	// reader no longer knows the id); ServiceID and BackendID are the
	// datapath's ids (of the frontend, VIP + port + protocol).
	Service   string `json:"service,omitempty"`
	ServiceID uint32 `json:"service_id"`
	BackendID uint32 `json:"backend_id,omitempty"`
	// Protocol is "tcp" or "udp".
	Protocol string `json:"protocol"`
	// Client and VIP are the flow as the client sent it.
	Client netip.AddrPort `json:"client"`
	VIP    netip.AddrPort `json:"vip"`
	// Backend is where it was sent (invalid when it was dropped before a
	// backend was picked); SNAT is the source the backend saw, for
	// north-south flows (invalid otherwise).
	Backend netip.AddrPort `json:"backend,omitzero"`
	SNAT    netip.AddrPort `json:"snat,omitzero"`
	// Verdict, and the reason of the last drop ("" when none; a drop
	// reason name of the datapath, e.g. "no_backend").
	Verdict Verdict `json:"verdict"`
	Reason  string  `json:"reason,omitempty"`
	// Hook is the program that opened the record: "from_vm", "to_vm",
	// "ns_in", "ns_out" or "xdp"; Interface the interface it ran on (its
	// name where the reader could resolve it, else "if<index>").
	Hook      string `json:"hook"`
	Interface string `json:"interface,omitempty"`
	// FirstSeen and LastSeen are wall-clock times (converted from the
	// datapath's monotonic clock when read).
	FirstSeen time.Time `json:"first_seen"`
	LastSeen  time.Time `json:"last_seen"`
	// Forward is client -> backend, Reply backend -> client.
	Forward Counts `json:"forward"`
	Reply   Counts `json:"reply"`
	// Drops counts the flow's packets the datapath dropped.
	Drops uint64 `json:"drops,omitempty"`
}
