package intent

import (
	"errors"
	"math/rand/v2"
	"net/netip"
	"testing"
)

// TestCatalogIndexMatchesValidateCatalog: applying and deleting random
// services, the incremental check accepts exactly what ValidateCatalog
// accepts for the catalog the change would make, with the same error
// category, and a reserve/abort or reserve/commit leaves the index as a
// fresh index of the resulting catalog.
func TestCatalogIndexMatchesValidateCatalog(t *testing.T) {
	limits := Limits{Services: 12, Frontends: 10, Backends: 40, MaglevSize: 5}
	var node Node
	rng := rand.New(rand.NewPCG(1, 2))
	random := func(name string) Service {
		s := Service{Name: name}
		vips := []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 0, byte(rng.IntN(4))}), netip.MustParseAddr("fd00::1").Next()}
		for i := range rng.IntN(2) + 1 {
			s.VIPs = append(s.VIPs, vips[i])
		}
		for p := range rng.IntN(3) + 1 {
			proto := TCP
			if rng.IntN(2) == 0 {
				proto = UDP
			}
			s.Ports = append(s.Ports, ServicePort{Port: uint16(80 + p + rng.IntN(2)), Protocol: proto})
		}
		for b := range rng.IntN(7) {
			addr := netip.AddrFrom4([4]byte{10, 200, 0, byte(b + 1)})
			if len(s.VIPs) == 2 && b%2 == 1 {
				addr = netip.MustParseAddr("fd00:200::1")
			}
			s.Backends = append(s.Backends, Backend{Address: addr, Port: uint16(8000 + b)})
		}
		return s
	}
	x := NewCatalogIndex()
	cat := map[string]Service{}
	fps := map[string]Footprint{}
	names := []string{"a", "b", "c", "d", "e", "f"}
	accepted := 0
	for i := range 3000 {
		name := names[rng.IntN(len(names))]
		if _, ok := cat[name]; ok && rng.IntN(4) == 0 {
			fp := fps[name]
			x.Remove(name, &fp)
			delete(cat, name)
			delete(fps, name)
			continue
		}
		svc := random(name)
		if ValidateService(svc, node) != nil {
			continue
		}
		var next []Service
		for n, s := range cat {
			if n != name {
				next = append(next, s)
			}
		}
		next = append(next, svc)
		want := ValidateCatalog(next, node, limits)
		fp := FootprintOf(&svc)
		var old *Footprint
		if o, ok := fps[name]; ok {
			old = &o
		}
		got := x.Check(&svc, &fp, old, limits)
		if (got == nil) != (want == nil) || (want != nil && (errors.Is(got, ErrLimit) != errors.Is(want, ErrLimit) || errors.Is(got, ErrConflict) != errors.Is(want, ErrConflict))) {
			t.Fatalf("step %d: %s: incremental %v, whole catalog %v", i, name, got, want)
		}
		if got != nil {
			continue
		}
		accepted++
		x.Reserve(name, &fp, old)
		if rng.IntN(3) == 0 {
			x.Abort(name, &fp, old)
			continue
		}
		x.Commit(name, &fp, old)
		cat[name], fps[name] = svc, fp
	}
	fresh := NewCatalogIndex()
	for n := range cat {
		fp := fps[n]
		fresh.Add(n, &fp)
	}
	if x.dpServices != fresh.dpServices || x.backends != fresh.backends || x.feCount != fresh.feCount || len(x.owner) != len(fresh.owner) || len(x.markers) != len(fresh.markers) {
		t.Errorf("index after the changes %+v, a fresh one %+v", *x, *fresh)
	}
	if accepted < 100 {
		t.Errorf("only %d changes accepted", accepted)
	}
}
