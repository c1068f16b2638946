package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// The side objects (the north-south XDP object, the socket load-balancing
// object) run on the TC object's maps: loaded with every program load (a
// restart, a reload, a tier change) and switched into their pinned links by
// Activate with the TC programs.

// loadSide loads the side object what of opts's tier on the maps of coll,
// the loaded TC object: every map the side object declares under a name of
// the TC object is the TC object's instance, so state one writes is the
// other's. The object is file(tier) from ObjectDir when that directory has
// it, else the embedded one (spec): an object directory installed before
// the side object existed keeps working. One built before load-time
// features loads only if no feature the embedded object declares is
// omitted (ErrObjectMismatch otherwise), as the TC object.
func loadSide(opts Options, coll *ebpf.Collection, what string,
	spec func(Tier) (*ebpf.CollectionSpec, error), file func(Tier) string) (*ebpf.Collection, error) {
	s, err := spec(opts.Tier)
	if err != nil {
		return nil, err
	}
	emb := s
	if opts.ObjectDir != "" {
		path := filepath.Join(opts.ObjectDir, file(opts.Tier))
		f, err := os.Open(path)
		switch {
		case errors.Is(err, os.ErrNotExist):
		case err != nil:
			return nil, fmt.Errorf("bpf: %s object for tier %s: %w", what, opts.Tier, err)
		default:
			s, err = ebpf.LoadCollectionSpecFromReader(f)
			f.Close()
			if err != nil {
				return nil, fmt.Errorf("bpf: %s: %w", path, err)
			}
		}
	}
	// An object from ObjectDir built before load-time features has every
	// feature in its code: it cannot omit one the embedded object of
	// this release declares (Status.Features would not be true).
	on := loadedFeatures(opts)
	for _, fv := range featureVars {
		if !on.Has(fv.f) && emb.Variables[fv.v] != nil && s.Variables[fv.v] == nil {
			return nil, fmt.Errorf("bpf: open: %s object has no load-time features, cannot omit %s: %w", what, fv.name, ErrObjectMismatch)
		}
	}
	if err := setFeatures(s, opts, what, false); err != nil {
		return nil, err
	}
	repl := map[string]*ebpf.Map{}
	for name, ms := range s.Maps {
		if m := coll.Maps[name]; m != nil && !dataSection(name) {
			ms.MaxEntries = m.MaxEntries()
			repl[name] = m
		}
	}
	c, err := ebpf.NewCollectionWithOptions(s, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		return nil, fmt.Errorf("bpf: open: load the %s object: %w", what, err)
	}
	return c, nil
}

// embeddedSpec returns the embedded object of tier t among the three
// loaders bpf2go generated for it.
func embeddedSpec(t Tier, what string, s, m, l func() (*ebpf.CollectionSpec, error)) (*ebpf.CollectionSpec, error) {
	var load func() (*ebpf.CollectionSpec, error)
	switch t {
	case TierS:
		load = s
	case TierM:
		load = m
	case TierL:
		load = l
	default:
		return nil, fmt.Errorf("bpf: %s spec: %w", what, ErrUnknownTier)
	}
	spec, err := load()
	if err != nil {
		return nil, fmt.Errorf("bpf: embedded %s object of tier %s: %w", what, t, err)
	}
	return spec, nil
}
