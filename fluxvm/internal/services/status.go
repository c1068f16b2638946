package services

import "github.com/fluxvm/servicefabric/fluxvm/internal/idpool"

// Status is what the services' programming holds in the datapath: its
// frontends, its ids, and its reverse translation index.
type Status struct {
	// Frontends are the (VIP, port, protocol) entries programmed, VIP
	// markers aside; RepairPending those of them closed by a failed
	// change until their service is programmed again.
	Frontends     int `json:"frontends"`
	RepairPending int `json:"repair_pending"`
	// ServiceIDs and BackendIDs are the id pools: a change that needs
	// more new ids than are free is refused (limit_exceeded); released
	// ids wait for a conntrack GC in quarantine.
	ServiceIDs idpool.Stats `json:"service_ids"`
	BackendIDs idpool.Stats `json:"backend_ids"`
	// IndexedEndpoints are the backend endpoints listed in fluxvm_be2fe;
	// IndexOverflowed those listed by more frontends than its slots (some
	// of their frontends' flows store reverse halves).
	IndexedEndpoints int `json:"indexed_endpoints"`
	IndexOverflowed  int `json:"index_overflowed"`
}

// Status says what the Programmer holds now.
func (p *Programmer) Status() Status {
	st := Status{Frontends: len(p.frontends), ServiceIDs: p.sids.Stats(), BackendIDs: p.bids.Stats(),
		IndexedEndpoints: p.index.Len(), IndexOverflowed: p.index.Overflowed()}
	for _, fe := range p.frontends {
		if fe.repair {
			st.RepairPending++
		}
	}
	return st
}
