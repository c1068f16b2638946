package bpf

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
)

// Features is a set of node-level datapath features: the parts of the
// programs a node uses or not as a whole, by its configuration, rather
// than per service. Each is a constant the loader sets in the programs
// before they load (lib/config.h, through CollectionSpec.Variables): the
// verifier reads it as a known value, so a feature left out
// (Options.OmitFeatures) is not in the verified program at all, neither
// its instructions nor its cost per packet, whatever the maps say.
//
// A feature loaded is still switched on and off at run time by its own
// setting, as before features were chosen at load: FeatureHA by the meta
// map's MetaFlagHA, FeatureFlowRecords by Meta.FlowSampleRate (0: no
// records), FeatureEDT by each service's entry in fluxvm_edt. Left out,
// the feature does nothing even when its setting says on: the programs
// must be loaded again (Open, which a restart does, staged so that flows
// survive) to turn it on.
//
// Per-service state (a service's policy and its L7 part, host routing,
// DSR, its pacing rate) is not a feature: it arrives at run time through
// the control plane and stays in maps.
type Features uint32

// The features. The names in String are those of Status and the docs.
const (
	// FeatureHA is flow-state replication (lib/ha.h): TC queues a record
	// of every north-south conntrack write a standby must learn in
	// fluxvm_haq, and XDP leaves those packets to TC.
	FeatureHA Features = 1 << iota
	// FeatureFlowRecords is FluxScope (lib/flows.h): records of sampled
	// new flows in fluxvm_sflows, their packet counts each way, and drop
	// records.
	FeatureFlowRecords
	// FeatureEDT is EDT pacing of services' replies (lib/edt.h).
	FeatureEDT

	// AllFeatures is every feature: what an Open that omits none loads.
	AllFeatures = FeatureHA | FeatureFlowRecords | FeatureEDT
)

// ErrUnknownFeature: Options.OmitFeatures names a bit that is no feature.
var ErrUnknownFeature = errors.New("unknown datapath feature")

// featureVars are the C variables of the features (lib/config.h), in the
// order of their bits.
type featureVar struct {
	f    Features
	name string // Features.String
	v    string // the C variable
}

var featureVars = []featureVar{
	{FeatureHA, "ha", "fluxvm_feature_ha"},
	{FeatureFlowRecords, "flow_records", "fluxvm_feature_flows"},
	{FeatureEDT, "edt", "fluxvm_feature_edt"},
}

// Has reports whether every feature of g is in f.
func (f Features) Has(g Features) bool { return f&g == g }

// String lists the features by name, "ha,flow_records,edt", or "none".
func (f Features) String() string {
	var names []string
	for _, fv := range featureVars {
		if f&fv.f != 0 {
			names = append(names, fv.name)
		}
	}
	if rest := f &^ AllFeatures; rest != 0 {
		names = append(names, fmt.Sprintf("0x%x", uint32(rest)))
	}
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ",")
}

// FeaturesFor is the set of features a node needs, from its settings:
// flow-state replication on (ha_epoch), flow records sampled
// (flow_sample_rate not 0), EDT pacing allowed (edt_enabled). The
// reference control plane (package fluxvm) loads exactly these.
func FeaturesFor(ha, flowRecords, edt bool) Features {
	var f Features
	if ha {
		f |= FeatureHA
	}
	if flowRecords {
		f |= FeatureFlowRecords
	}
	if edt {
		f |= FeatureEDT
	}
	return f
}

// loadedFeatures are the features an Open with opts loads.
func loadedFeatures(opts Options) Features { return AllFeatures &^ opts.OmitFeatures }

// setFeatures sets the feature variables of object spec (what, for
// errors) to those opts loads. The TC object (required) without them,
// one built before features were chosen at load (from ObjectDir), has
// every feature in its programs: it loads as long as nothing is to be
// omitted. A side object declares the features its code uses, or none
// (the socket LB object and the iterators use none).
func setFeatures(spec *ebpf.CollectionSpec, opts Options, what string, required bool) error {
	if bad := opts.OmitFeatures &^ AllFeatures; bad != 0 {
		return fmt.Errorf("bpf: open: omit features 0x%x: %w", uint32(bad), ErrUnknownFeature)
	}
	on := loadedFeatures(opts)
	for _, fv := range featureVars {
		v := spec.Variables[fv.v]
		if v == nil {
			if required && !on.Has(fv.f) && declaresNoFeature(spec) {
				return fmt.Errorf("bpf: open: %s object has no load-time features, cannot omit %s: %w", what, fv.name, ErrObjectMismatch)
			}
			continue
		}
		if !v.Constant() || v.Size() != 1 {
			return fmt.Errorf("bpf: open: %s object: feature variable %s is not a one-byte constant: %w", what, fv.v, ErrObjectMismatch)
		}
		val := uint8(0)
		if on.Has(fv.f) {
			val = 1
		}
		if err := v.Set(val); err != nil {
			return fmt.Errorf("bpf: open: %s object: set %s: %w", what, fv.v, err)
		}
	}
	return nil
}

// declaresNoFeature: spec has none of the feature variables (an object
// from before load-time features).
func declaresNoFeature(spec *ebpf.CollectionSpec) bool {
	for _, fv := range featureVars {
		if spec.Variables[fv.v] != nil {
			return false
		}
	}
	return true
}

// dataSection reports whether map name is one of an object's data
// sections (.rodata, .data, .bss: the load-time features live in
// .rodata), which belong to the object's own load: never pinned, shared
// with another object or adopted from the pins.
func dataSection(name string) bool { return strings.HasPrefix(name, ".") }

// Names lists the features by name ("ha", "flow_records", "edt"), in
// bit order; empty for none.
func (f Features) Names() []string {
	names := []string{}
	for _, fv := range featureVars {
		if f&fv.f != 0 {
			names = append(names, fv.name)
		}
	}
	return names
}

// ErrFeatureNotLoaded: a setting switches on a feature that the loaded
// programs do not hold (Options.OmitFeatures). It would do nothing: the
// datapath must be opened again with the feature.
var ErrFeatureNotLoaded = errors.New("datapath feature not loaded")

// checkMetaFeatures refuses a meta update from prev to next that switches
// on a feature the programs were loaded without: the HA flag, or a flow
// sample rate where there was none. A setting already on (carried over
// from an earlier start's meta entry) may stay, and any may go off.
// Before Activate (a staged Open) nothing is refused: the programs of the
// earlier start still run on the maps this Open kept, and may hold the
// feature (a failed start puts their settings back through here).
func (d *Datapath) checkMetaFeatures(prev, next Meta) error {
	if d.staged != nil {
		return nil
	}
	loaded := d.status.Features
	if next.Flags&MetaFlagHA != 0 && prev.Flags&MetaFlagHA == 0 && !loaded.Has(FeatureHA) {
		return fmt.Errorf("bpf: update meta: HA replication switched on, but the programs were loaded without %s (Options.OmitFeatures): open the datapath again with it: %w",
			FeatureHA, ErrFeatureNotLoaded)
	}
	if next.FlowSampleRate != 0 && prev.FlowSampleRate == 0 && !loaded.Has(FeatureFlowRecords) {
		return fmt.Errorf("bpf: update meta: flow sample rate %d, but the programs were loaded without %s (Options.OmitFeatures): open the datapath again with it: %w",
			next.FlowSampleRate, FeatureFlowRecords, ErrFeatureNotLoaded)
	}
	return nil
}

// ParseFeatures reads a set of features as String writes it: names
// separated by commas ("ha,edt"), "none" or "" for the empty set, "all"
// for AllFeatures.
func ParseFeatures(s string) (Features, error) {
	switch s = strings.TrimSpace(s); s {
	case "", "none":
		return 0, nil
	case "all":
		return AllFeatures, nil
	}
	var f Features
	for _, name := range strings.Split(s, ",") {
		name = strings.TrimSpace(name)
		i := slices.IndexFunc(featureVars, func(fv featureVar) bool { return fv.name == name })
		if i < 0 {
			return 0, fmt.Errorf("bpf: feature %q (ha, flow_records, edt): %w", name, ErrUnknownFeature)
		}
		f |= featureVars[i].f
	}
	return f, nil
}
