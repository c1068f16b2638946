package fluxvm

import (
	"sync"

	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
	"github.com/fluxvm/servicefabric/intent"
)

// applyState is the state of the apply path that lets changes of
// different services run concurrently (ApplyService).
type applyState struct {
	index *intent.CatalogIndex // catalog totals for incremental validation; under mu
	store *catalog.Store       // the catalog's journal; nil without CatalogPath
	busy  map[string]int       // services with a change between prepare and commit; under mu
	// reserved are the intents of applies between their reservation
	// (CatalogIndex.Reserve) and their commit or abort, by service: the
	// maps sized by need count them (needGrowth). Under mu.
	reserved map[string]Service
	// reservations counts the reservations made (under mu): an apply
	// whose grow plan saw the same count sees the catalog it planned for
	// or a smaller one (commits, aborts and deletes add no need).
	reservations uint64
	// unsaved are the services whose delete answered "removed, but the
	// catalog was not saved", with the seq of its record; a retry of the
	// delete makes it durable (DeleteService). Under mu.
	unsaved  map[string]uint64
	inflight sync.WaitGroup // changes under way; Close waits for them
	// names serialise the changes of each service; taken before mu.
	names services.NameLocks
}

// lockService takes the lock of service name and returns its unlock. It
// is taken before d.mu, never while holding it.
func (d *Dataplane) lockService(name string) func() { return d.names.Lock(name) }

// doneBusy ends what ApplyService's d.busy[name]++ began. d.mu must be
// held.
func (d *Dataplane) doneBusy(name string) {
	if d.busy[name]--; d.busy[name] <= 0 {
		delete(d.busy, name)
	}
}
