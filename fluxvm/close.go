package fluxvm

import (
	"context"
	"errors"
	"fmt"

	"github.com/fluxvm/servicefabric/advert"
)

// markClosed sets closed and reports whether this call did (false: the
// Dataplane was closed already). It also cancels a GC scan in progress;
// stopGC then waits for it.
func (d *Dataplane) markClosed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return false
	}
	d.closed = true
	if d.gcCancel != nil {
		d.gcCancel()
	}
	return true
}

// unopened reports a Dataplane that Open did not make: a nil *Dataplane
// or a zero Dataplane{}. Every exported method asks first (opened), and
// answers as a closed Dataplane's would (see Close), without panicking.
func (d *Dataplane) unopened() bool { return d == nil || d.dp == nil }

// opened fails with an error matching ErrClosed for a Dataplane that Open
// did not make (unopened).
func (d *Dataplane) opened(op string) error {
	if d.unopened() {
		return fmt.Errorf("fluxvm: %s: the Dataplane is not open (nil, or not made by Open): %w", op, ErrClosed)
	}
	return nil
}

// checkOpen is the first thing every call that uses a map does, with mu
// held.
func (d *Dataplane) checkOpen(op string) error {
	if d.closed {
		return fmt.Errorf("fluxvm: %s: %w", op, ErrClosed)
	}
	return nil
}

// stopGC stops the GC timer and waits for every GC still running (the
// timer's or a manual one; markClosed cancelled their scans), so that no
// scan uses the maps Close releases. Call it after markClosed, without mu.
func (d *Dataplane) stopGC() {
	d.gcTimer.Close()
	d.gcRuns.Wait()
}

// Close stops the health checks and the GC timer, cancels a GC in
// progress and waits for it, publishes the last advertisements not yet
// written and stops their publisher, and releases this process's handles.
// The datapath keeps forwarding: pins and attachments stay in place, and
// so do the fq qdiscs edt_manage_fq installed (the next Open adopts them)
// and the advertisement file, as last published. Changes under way
// finish first, and the catalog journal is compacted into the catalog
// file (package fluxvm/internal/catalog). A second Close does nothing and
// returns nil.
//
// Close lets the pin root go: another Open (or the package-level
// Cleanup) may take it from then on.
//
// After Close (or Cleanup), every method that returns an error, but
// Cleanup, fails with an error matching ErrClosed and touches no map.
// Status, Services, Health and Advertisements, which read only the
// dataplane's memory, keep answering: with the state as it was at Close,
// or after Cleanup that of an empty dataplane (no services, no
// interfaces, every VIP withdrawn).
func (d *Dataplane) Close() error {
	if err := d.opened("close"); err != nil {
		return err
	}
	if !d.markClosed() {
		return nil
	}
	d.stopComponents(false)
	cerr := d.closeCatalog()
	// A compaction finishes first (it holds flowMu to its end).
	d.flowMu.Lock()
	defer d.flowMu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	closeMaps(d.flowMaps[:])
	return errors.Join(cerr, d.dp.Close(), d.lock.Release(), d.catLock.Release())
}

// stopComponents stops the components, in one ordered list, once the
// changes under way have finished (and are journaled): first those that
// act on their own (health rounds, pressure rounds, the GC timer, the HA
// drainer, the socket destroyer, the route watch), then the publisher of
// the advertisements (with withdraw, after it was given the empty
// snapshot that withdraws every VIP: Cleanup), then those that only
// answer calls. The catalog, the maps and the locks go after it, in
// Close and Cleanup. Call it once, after markClosed, without d.mu.
func (d *Dataplane) stopComponents(withdraw bool) {
	d.inflight.Wait()
	d.health.Close()
	d.pressure.Close()
	d.stopGC()
	d.stopHA()
	d.sock.Close()
	d.routes.Close() // its only error is the close of its netlink socket
	if withdraw {
		d.adv.Submit([]advert.Entry{})
	}
	d.adv.Close()
	d.pacing.Close()
	d.scope.Close()
	d.pol.Close()
}

// Cleanup removes everything the dataplane owns: it stops the dataplane
// as Close does, publishes a snapshot with no advertisements, and then
// removes what the package-level Cleanup removes, with the pin root
// still held: the VM-edge, north-south, XDP and socket-hook attachments,
// the pin root (and its parents that Open created, when they are
// empty), the fq qdiscs of edt_manage_fq (on every interface of the
// node's namespace that has FluxVM's, handle f1d0:), the catalog (file and
// journal) and the HA lease file next to it (see Cleanup for why).
// The advertisement file is not removed: Cleanup publishes a snapshot with
// no entries, so that routing adapters withdraw every VIP (a missing file
// would leave them to guess); when that snapshot cannot be written,
// Cleanup still removes the rest and returns an error saying so.
//
// After Close, Cleanup does what the package-level Cleanup does with this
// dataplane's pin root, catalog and advertisement file: it takes the pin
// root again (ErrInUse if another Dataplane opened it meanwhile) and
// removes what the closed dataplane left. So does a second Cleanup, which
// then finds nothing left to remove.
//
// A ctx that ended before Cleanup begins changes nothing (the dataplane
// stays open) and fails with an error wrapping ctx's. Once it began
// (the dataplane marked closed) it is past its point of no return: it
// removes everything and finishes whatever ctx says, since a cleanup left
// half done would leave attachments running on maps no one owns.
func (d *Dataplane) Cleanup(ctx context.Context) error {
	if err := d.begin(ctx, "cleanup"); err != nil {
		return err
	}
	if !d.markClosed() {
		return Cleanup(ctx, d.cleanupOptions())
	}
	d.stopComponents(true)
	var errs []error
	if d.store != nil {
		d.store.Drop()
	}
	// The goroutine's last publish only logs a failure; try once more
	// here, so that Cleanup fails when adapters were not told to withdraw.
	if err := d.adv.Flush(); err != nil {
		errs = append(errs, fmt.Errorf("advertisements: the empty snapshot that withdraws every VIP was not published: %w", err))
	}
	d.flowMu.Lock()
	defer d.flowMu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	closeMaps(d.flowMaps[:])
	errs = append(errs, d.dp.Close(), removeState(d.cleanupOptions()), d.catLock.Remove(), d.lock.Release())
	// What Status, Services and Health report from now on: nothing is
	// left.
	d.services, d.ifaces = map[string]*service{}, map[string]*iface{}
	d.prog.Reset()
	d.sock.Removed()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("fluxvm: cleanup: %w", err)
	}
	return nil
}
