package fluxvm

import (
	"github.com/fluxvm/servicefabric/bpf"
)

// Load-time features. The node-level parts of the datapath (flow-state
// replication, flow records, EDT pacing: bpf.Features) are chosen when
// the programs load: Open loads exactly those its options use, and
// leaves the others out of the verified programs (bpf.Options.OmitFeatures),
// so that a node pays neither verifier room nor per-packet cost for what
// it does not configure. Per-service state (a service's policy and its
// L7 part, host routing, DSR, its pacing rate) arrives at run time and
// stays in maps.
//
// A feature changes with the options, which change only at Open: a
// restart with ha_epoch, flow_sample_rate or edt_enabled changed loads
// the programs with the new set, staged (the programs running keep
// running until the catalog is restored, then every attachment is
// switched at once), and established flows keep their backends as across
// any restart. No run-time path can turn a feature on behind the loaded
// programs' back: a lease update needs HA on (ErrPrerequisite, ha_epoch),
// a service asking for pacing needs edt_enabled (ErrPrerequisite,
// max_egress_mbps), and the flow sample rate is written at Open only.

// neededFeatures are the features o uses: HA with a lease epoch, flow
// records with a sample rate, EDT when pacing is allowed.
func (o Options) neededFeatures() bpf.Features {
	return bpf.FeaturesFor(o.HA.Epoch != 0, o.FlowSampleRate != 0, o.EDT.Enabled)
}

// omitFeatures is what Open leaves out of the programs: every feature o
// does not use, and whatever Loader.OmitFeatures adds. Omitting one that
// o uses is refused by Validate (ErrInvalid): the feature would be
// configured and do nothing.
func (o Options) omitFeatures() bpf.Features {
	return o.Loader.OmitFeatures | bpf.AllFeatures&^o.neededFeatures()
}
