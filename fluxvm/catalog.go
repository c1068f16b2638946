package fluxvm

import (
	"fmt"
	"slices"
	"sort"

	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
)

// The node-local catalog (CatalogPath) is kept by package
// fluxvm/internal/catalog: a snapshot and a journal of the changes since,
// with compactions in the background, and its lock file (see that
// package and docs/architecture.md, "Catalog persistence"). The dataplane
// appends a record per change under d.mu (journal, journalPolicies),
// waits for it without d.mu (persist), and gives the store the state a
// compaction writes (catalogView): captured under d.mu, written after
// d.mu is let go.

// The catalog's records (package catalog's).
type (
	catalogFile     = catalog.File
	catalogService  = catalog.Service
	catalogFrontend = catalog.Frontend
	catalogBackend  = catalog.Backend
	catalogPolicies = catalog.Policies
)

// catalogVersion is the format of the catalog file.
const catalogVersion = catalog.Version

// CatalogLockSuffix names the lock file next to the catalog:
// CatalogPath + CatalogLockSuffix. Open holds an flock on it while the
// dataplane is open, and Cleanup while it removes the catalog, the
// journal and the HA lease file: state outside bpffs, which the pin
// root's lock does not cover (a cleanup that does not see the pin root,
// or names another one, still finds the catalog held). Dataplane.Cleanup
// and Cleanup remove it last, a failed first Open too; Close leaves it.
const CatalogLockSuffix = catalog.LockSuffix

// ErrCatalogCorrupt reports a catalog journal that lost acknowledged
// changes: a damaged record followed by valid ones, or missing records.
var ErrCatalogCorrupt = catalog.ErrCorrupt

// compactMinBytes is the journal size below which no compaction starts
// (a variable for tests, read at Open; 0: the catalog's default, 1 MiB).
var compactMinBytes int64

// RemoveCatalog removes the node-local catalog at path: the catalog file
// and its journal files (see docs/operations.md). A missing catalog is
// not an error. Use it only on a node whose dataplane is not open.
func RemoveCatalog(path string) error {
	if err := catalog.Remove(path); err != nil {
		return fmt.Errorf("fluxvm: remove catalog %s: %w", path, err)
	}
	return nil
}

// openCatalog makes the store of the catalog at CatalogPath (restore
// loads it).
func (d *Dataplane) openCatalog() (*catalog.Store, error) {
	st, err := catalog.New(catalog.Config{Path: d.opts.CatalogPath, Logger: d.log, CompactMinBytes: compactMinBytes},
		catalog.Deps{Snapshot: d.catalogView})
	if err != nil {
		return nil, fmt.Errorf("fluxvm: restore catalog: %w", err)
	}
	return st, nil
}

// catalogView is the store's Deps.Snapshot: the catalog captured under
// d.mu, the journal cut there too; the store writes it after d.mu is let
// go.
func (d *Dataplane) catalogView(cut func()) catalogFile {
	d.mu.Lock()
	defer d.mu.Unlock()
	cat := d.catalogSnapshot()
	cut()
	return cat
}

// catalogSnapshot is the state of the catalog as a catalogFile (without
// Seq). d.mu must be held.
func (d *Dataplane) catalogSnapshot() catalogFile {
	cat := catalogFile{Version: catalogVersion, Services: make([]catalogService, 0, len(d.services))}
	for _, s := range d.services {
		cat.Services = append(cat.Services, catalogServiceOf(s))
	}
	sort.Slice(cat.Services, func(i, j int) bool { return cat.Services[i].Service.Name < cat.Services[j].Service.Name })
	cat.Policies = d.pol.Saved()
	return cat
}

// catalogServiceOf is s as the catalog records it. d.mu must be held.
func catalogServiceOf(s *service) catalogService {
	cs := catalogService{Service: s.Intent, Revision: s.Revision, AppliedAt: s.Applied}
	for _, fe := range s.Frontends {
		k := fe.Key()
		cf := catalogFrontend{VIP: k.VIP, Port: k.Port, Protocol: protocolOf(k.Proto), ServiceID: fe.ID(),
			Backends: make([]catalogBackend, 0, fe.BackendCount())}
		for ep, id := range fe.Backends() {
			cf.Backends = append(cf.Backends, catalogBackend{Endpoint: ep, BackendID: id})
		}
		slices.SortFunc(cf.Backends, func(a, b catalogBackend) int { return int(a.BackendID) - int(b.BackendID) })
		cs.Frontends = append(cs.Frontends, cf)
	}
	return cs
}

// journal records a change of service name (s nil: deleted) and returns
// the seq to wait for (0 without a catalog file); the store starts a
// compaction when the journal has grown enough. d.mu must be held.
func (d *Dataplane) journal(name string, s *service) (uint64, error) {
	r := catalog.Record{Delete: name}
	if s != nil {
		cs := catalogServiceOf(s)
		r = catalog.Record{Put: &cs}
	}
	return d.appendRecord(r)
}

func (d *Dataplane) appendRecord(r catalog.Record) (uint64, error) {
	if d.store == nil {
		return 0, nil
	}
	return d.store.Append(r)
}

// catchUp returns the seq to wait for (settle) so that the change seq is
// durable, 0 when it is (catalog.Store.CatchUp). d.mu must be held.
func (d *Dataplane) catchUp(seq uint64) uint64 {
	if d.store == nil {
		return 0
	}
	return d.store.CatchUp(seq)
}

// settle waits until the change seq (from catchUp) is durable
// (catalog.Store.Settle). d.mu must not be held.
func (d *Dataplane) settle(seq uint64) error {
	if d.store == nil {
		return nil
	}
	return d.store.Settle(seq)
}

// persist waits until the change seq (from journal) is durable. d.mu
// must not be held.
func (d *Dataplane) persist(seq uint64) error {
	if d.store == nil {
		return nil
	}
	return d.store.Wait(seq)
}

// closeCatalog waits for a compaction under way, compacts what the
// journal holds so that the snapshot alone is the catalog, and closes the
// journal. Close calls it once no change is in flight; d.mu must not be
// held.
func (d *Dataplane) closeCatalog() error {
	if d.store == nil {
		return nil
	}
	return d.store.Close()
}
