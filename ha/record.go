package ha

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
)

// Epoch is the lease epoch the control plane gave an edge: every snapshot
// and batch carries its source's, a target refuses data from an epoch
// older than the newest it has accepted, and a source whose epoch was
// superseded serves nothing. 0 is no epoch: refused everywhere.
type Epoch uint64

// Flow is one flow of a service as any node of the pair can apply it.
type Flow struct {
	// Client, VIP and Proto are the conntrack key: the flow as the
	// client sent it. The VIP, its port and the protocol name the
	// service's frontend on every node.
	Client netip.AddrPort `json:"client"`
	VIP    netip.AddrPort `json:"vip"`
	Proto  uint8          `json:"proto"`
	// Backend is the backend the flow is pinned to, by address and port.
	Backend netip.AddrPort `json:"backend"`
	// Kind is how the datapath forwards it (conntrack.EastWest, SNAT,
	// DSR); SNAT is its translated source for Kind SNAT.
	Kind conntrack.Kind `json:"kind"`
	SNAT netip.AddrPort `json:"snat,omitzero"`
	// State is its protocol state; ReverseDerived and Audited the
	// conntrack flags of the same names.
	State          bpf.CTState `json:"state"`
	ReverseDerived bool        `json:"reverse_derived,omitempty"`
	Audited        bool        `json:"audited,omitempty"`
	// Age is the time since the flow was learned, Idle since it was last
	// seen, TTL until its deadline: relative to the exporter's clock at
	// export, turned back into the importer's clock at import.
	Age  time.Duration `json:"age"`
	Idle time.Duration `json:"idle"`
	TTL  time.Duration `json:"ttl"`
	// NAT is its reverse-NAT half, nil when it has none (DSR, east-west
	// flows whose replies are derived).
	NAT *NATHalf `json:"nat,omitempty"`
}

// NATHalf is the reverse-NAT half of a Flow: its key and value follow from
// the flow (backend -> client, or backend -> SNAT for an SNAT mapping
// whose origin is the client); only its own clock differs.
type NATHalf struct {
	Idle time.Duration `json:"idle"` // since a reply last refreshed it
}

// Key is the flow's conntrack key.
func (f *Flow) Key() conntrack.Key {
	return conntrack.Key{Client: f.Client, VIP: f.VIP, Proto: f.Proto}
}

func (f *Flow) String() string {
	return fmt.Sprintf("%s -> %s (%s)", f.Key(), f.Backend, f.Kind)
}

// OpKind is what a journal operation does to a flow.
type OpKind uint8

// Operation kinds.
const (
	// OpUpsert creates or refreshes the flow (Op.Flow).
	OpUpsert OpKind = 1
	// OpDelete removes the flow named by Op.Key and its reverse half.
	OpDelete OpKind = 2
)

func (k OpKind) String() string {
	switch k {
	case OpUpsert:
		return "upsert"
	case OpDelete:
		return "delete"
	}
	return fmt.Sprintf("op(%d)", uint8(k))
}

// Op is one change to a service's flows, as a journal batch carries it.
type Op struct {
	Kind OpKind `json:"op"`
	// Flow is the flow an OpUpsert writes.
	Flow *Flow `json:"flow,omitempty"`
	// Key names the flow an OpDelete removes.
	Key conntrack.Key `json:"key,omitzero"`
	// IdleMS is, for an OpDelete of a flow the source's GC removed, how
	// long the source had not seen it, in milliseconds: a target that saw
	// the flow more recently than that (it carries the flow now: an ECMP
	// router moved it there) keeps it (ImportResult.Fresher). 0: the
	// delete applies whatever the target saw (a source that does not say).
	IdleMS uint64 `json:"idle_ms,omitempty"`
}
