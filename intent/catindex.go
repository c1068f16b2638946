package intent

import (
	"fmt"
	"net/netip"
)

// CatalogIndex keeps what ValidateCatalog adds up over the whole catalog
// (frontend owners, VIP markers, the totals compared with Limits), so
// that an apply validates its service against the catalog in time
// independent of the catalog's size. It is not safe for concurrent use:
// fluxvm.Dataplane keeps it under its mutex. Start with NewCatalogIndex
// and Add every service of a restored catalog.
//
// While a change is in flight it holds the larger of the old and the new
// footprint of the service in every total, and the frontends and markers
// of both (Reserve), and drops what the change no longer needs when it
// ends (Commit or Abort). A concurrent change is then validated against
// that, which may refuse it near a limit where a sequential order would
// not have (when another service grows there at the same time), but
// never lets the catalog exceed one; an update that does not change a
// service's size reserves nothing.
type CatalogIndex struct {
	owner      map[catalogFE]string
	markers    map[catalogMarker]int
	dpServices int
	backends   int
	feCount    [2]int
}

// Footprint is what one service adds to a CatalogIndex (FootprintOf).
type Footprint struct {
	frontends  []catalogFE
	markers    []catalogMarker // distinct
	dpServices int
	backends   int
	feCount    [2]int // frontend entries, markers not included
	// eligible is the largest number of eligible backends of a VIP, and
	// eligibleFamily that VIP's family.
	eligible, eligibleFamily int
}

// NewCatalogIndex returns the index of an empty catalog.
func NewCatalogIndex() *CatalogIndex {
	return &CatalogIndex{owner: map[catalogFE]string{}, markers: map[catalogMarker]int{}}
}

// FootprintOf counts s as ValidateCatalog does.
func FootprintOf(s *Service) Footprint {
	var fp Footprint
	seen := map[catalogMarker]bool{}
	for _, vip := range s.VIPs {
		f := addrFamily(vip)
		perFrontend, eligible := backendsOf(s, f)
		if eligible > fp.eligible {
			fp.eligible, fp.eligibleFamily = eligible, f
		}
		for _, p := range s.Ports {
			fp.frontends = append(fp.frontends, catalogFE{vip, p.Port, p.Protocol})
			fp.dpServices++
			fp.backends += perFrontend
			fp.feCount[f]++
			if m := (catalogMarker{vip, p.Protocol}); !seen[m] {
				seen[m] = true
				fp.markers = append(fp.markers, m)
			}
		}
	}
	return fp
}

// Check validates s (already valid on its own) joining the catalog in
// place of the service of the same name, whose footprint is old (nil for
// a new service): the checks of ValidateCatalog, with the same errors
// except that they name the service rather than its index.
func (x *CatalogIndex) Check(s *Service, fp, old *Footprint, limits Limits) error {
	fail := func(e *ValidationError) error {
		return fmt.Errorf("intent: catalog: service %s: %w", quoteName(s.Name), e)
	}
	if fp.eligible > limits.MaglevSize {
		return fail(verr(ErrLimit, "backends", "%d eligible %s backends; a Maglev table of this tier has %d slots", fp.eligible, familyName[fp.eligibleFamily], limits.MaglevSize))
	}
	for i, k := range fp.frontends {
		if o, ok := x.owner[k]; ok && o != s.Name {
			pi := i % max(len(s.Ports), 1)
			return fail(verr(ErrConflict, fmt.Sprintf("ports[%d]", pi), "frontend %s/%s is already served by service %q",
				netip.AddrPortFrom(k.vip, k.port), k.proto, o))
		}
	}
	dps, bes, fes := x.dpServices+fp.dpServices, x.backends+fp.backends, x.feCount
	for f := range fes {
		fes[f] += fp.feCount[f]
	}
	for _, m := range fp.markers {
		if x.markers[m] == 0 {
			fes[addrFamily(m.vip)]++
		}
	}
	if old != nil {
		dps, bes = dps-old.dpServices, bes-old.backends
		for f := range fes {
			fes[f] -= old.feCount[f]
		}
		for _, m := range old.markers {
			if x.markers[m] == 1 && !containsMarker(fp.markers, m) {
				fes[addrFamily(m.vip)]--
			}
		}
	}
	if err := limits.exceeded("the catalog with this service", dps, fes, bes); err != nil {
		return fail(err)
	}
	return nil
}

func containsMarker(ms []catalogMarker, m catalogMarker) bool {
	for _, o := range ms {
		if o == m {
			return true
		}
	}
	return false
}

// Add counts fp, the footprint of service name (a restored service).
func (x *CatalogIndex) Add(name string, fp *Footprint) { x.Reserve(name, fp, nil) }

// Reserve counts a change of service name from old (nil: a new service)
// to fp, for as long as it is in flight: the frontends and markers of
// both, and the larger of the two in every total.
func (x *CatalogIndex) Reserve(name string, fp, old *Footprint) {
	for _, k := range fp.frontends {
		x.owner[k] = name
	}
	x.addMarkers(fp)
	x.addTotals(fp, old, 1)
}

// Commit ends a change reserved with Reserve that succeeded: fp stays.
// old nil with fp the footprint of a deleted service removes it.
func (x *CatalogIndex) Commit(name string, fp, old *Footprint) {
	if old == nil {
		return
	}
	x.drop(name, old, fp)
}

// Abort ends a change reserved with Reserve that failed: old stays.
func (x *CatalogIndex) Abort(name string, fp, old *Footprint) {
	x.drop(name, fp, old)
}

// Remove uncounts fp, the footprint of a deleted service.
func (x *CatalogIndex) Remove(name string, fp *Footprint) { x.drop(name, fp, nil) }

// drop uncounts footprint gone of service name, which keeps footprint
// stays (nil: none).
func (x *CatalogIndex) drop(name string, gone, stays *Footprint) {
	for _, k := range gone.frontends {
		if x.owner[k] == name && (stays == nil || !containsFE(stays.frontends, k)) {
			delete(x.owner, k)
		}
	}
	for _, m := range gone.markers {
		x.markers[m]--
		if x.markers[m] <= 0 {
			delete(x.markers, m)
			x.feCount[addrFamily(m.vip)]--
		}
	}
	// The totals held max(gone, stays); they hold stays now.
	x.addTotals(gone, stays, -1)
}

func (x *CatalogIndex) addMarkers(fp *Footprint) {
	for _, m := range fp.markers {
		if x.markers[m] == 0 {
			x.feCount[addrFamily(m.vip)]++
		}
		x.markers[m]++
	}
}

// addTotals adds (sign 1) or subtracts (sign −1) max(0, a − b) in every
// total; b nil counts as zero.
func (x *CatalogIndex) addTotals(a, b *Footprint, sign int) {
	var z Footprint
	if b == nil {
		b = &z
	}
	pos := func(v int) int { return max(0, v) * sign }
	x.dpServices += pos(a.dpServices - b.dpServices)
	x.backends += pos(a.backends - b.backends)
	for f := range x.feCount {
		x.feCount[f] += pos(a.feCount[f] - b.feCount[f])
	}
}

func containsFE(fs []catalogFE, k catalogFE) bool {
	for _, o := range fs {
		if o == k {
			return true
		}
	}
	return false
}
