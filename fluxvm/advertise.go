package fluxvm

import (
	"fmt"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/fluxvm/internal/advertisements"
)

// VIP advertisements: package fluxvm/internal/advertisements decides and
// publishes them (to Options.AdvertisementsPath, or in memory); this file
// wires it to the dataplane. The entries are computed under d.mu whenever
// their inputs may have changed (advertise: after ApplyService,
// DeleteService, the catalog restore at Open and a health-driven
// reprogram) from servicesView, which gives the component the services
// and each backend's effective state; the component's worker publishes
// them without d.mu. Close publishes the last pending set and stops the
// worker; Cleanup publishes an empty snapshot (every VIP withdrawn) first.

// AdvertisementStatus is the state of the advertisement publisher, in
// Status (package fluxvm/internal/advertisements's).
type AdvertisementStatus = advertisements.Status

// newAdvertiser makes the advertisement component; Open calls it before
// anything can submit entries. It fails only when an existing snapshot
// file cannot be read at all (advert.NewPublisher).
func (d *Dataplane) newAdvertiser() (*advertisements.Advertiser, error) {
	a, err := advertisements.New(advertisements.Config{Path: d.opts.AdvertisementsPath, Node: d.opts.NodeName, Logger: d.log},
		advertisements.Deps{View: servicesView{d}})
	if err != nil {
		return nil, fmt.Errorf("fluxvm: open: %w", err)
	}
	return a, nil
}

// startAdvertiser publishes the entries of the restored catalog now (so
// that the first read is right) and starts the publisher goroutine; Open
// calls it once the catalog is restored. A failed first publish does not
// fail Open: it is logged, shown in Status and retried.
func (d *Dataplane) startAdvertiser() {
	d.mu.Lock()
	d.advertise()
	d.mu.Unlock()
	d.adv.Start()
}

// advertise computes the entries of every service and hands them to the
// publisher. d.mu must be held; it does not block.
func (d *Dataplane) advertise() { d.adv.Update() }

// Advertisements returns the current VIP advertisement snapshot: the
// document the file at Options.AdvertisementsPath holds (GET
// /v1/network/services/advertisements serves it). A set computed but not
// yet written is published first, so the answer reflects every change
// made before the call. When nothing could be published yet (the first
// write failed; Status says why), it returns the computed entries with
// generation 0, which no file ever has. After Close it publishes nothing
// and returns the last snapshot published (after Cleanup, the empty one
// that withdraws every VIP).
func (d *Dataplane) Advertisements() advert.Snapshot {
	// The publisher is what answers; it exists from before the datapath
	// is loaded (newAdvertiser), so ask for it rather than for a
	// datapath.
	if d == nil || d.adv == nil {
		return advert.Snapshot{SchemaVersion: advert.SchemaVersion, Entries: []advert.Entry{}}
	}
	return d.adv.Snapshot()
}
