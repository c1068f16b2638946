package fluxvm

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/ha"
)

// TestOmitFeatures: Open loads exactly the features its options use
// (ha_epoch, flow_sample_rate, edt_enabled), plus leaves out whatever
// Loader.OmitFeatures adds; omitting a feature the options use is
// refused.
func TestOmitFeatures(t *testing.T) {
	for _, tc := range []struct {
		name     string
		opts     Options
		wantOmit bpf.Features
		wantErr  error
	}{
		{"nothing configured", Options{}, bpf.AllFeatures, nil},
		{"ha_epoch", Options{HA: HAOptions{Epoch: 3}, NorthSouth: NorthSouth{Interfaces: []string{"up0"}}}, bpf.FeatureFlowRecords | bpf.FeatureEDT, nil},
		{"flow_sample_rate", Options{FlowSampleRate: 100}, bpf.FeatureHA | bpf.FeatureEDT, nil},
		{"edt_enabled", Options{EDT: EDTOptions{Enabled: true}}, bpf.FeatureHA | bpf.FeatureFlowRecords, nil},
		{"edt_enabled, deprecated field", Options{EDTEnabled: true}, bpf.FeatureHA | bpf.FeatureFlowRecords, nil},
		{"all", Options{HA: HAOptions{Epoch: 1}, NorthSouth: NorthSouth{Interfaces: []string{"up0"}}, FlowSampleRate: 1, EDT: EDTOptions{Enabled: true}}, 0, nil},
		{"embedder omits one not used", Options{FlowSampleRate: 1, Loader: bpf.Options{OmitFeatures: bpf.FeatureEDT}},
			bpf.FeatureHA | bpf.FeatureEDT, nil},
		{"embedder omits one used", Options{FlowSampleRate: 1, Loader: bpf.Options{OmitFeatures: bpf.FeatureFlowRecords}},
			0, ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.opts.Validate()
			got := tc.opts.WithDefaults().omitFeatures()
			if !errors.Is(err, tc.wantErr) || (err == nil && got != tc.wantOmit) {
				t.Errorf("omitFeatures = %s, %v; want %s, %v", got, err, tc.wantOmit, tc.wantErr)
			}
		})
	}
}

// TestFeaturesReloadKeepsFlows: the features follow the options across
// restarts (Status.Load.Features), each restart a staged reload of the
// programs, and a TCP connection through the VIP echoes all along, on
// the same backend (another backend would reset it), while flow records
// and EDT are turned on, off, and on again together with a tier change.
// A feature turned on takes effect (a new flow gets its record), one
// turned off has none; and while a feature is off no run-time path turns
// it on behind the programs' back.
func TestFeaturesReloadKeepsFlows(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	wantFeatures := func(d *Dataplane, when string, want ...string) {
		t.Helper()
		if got := d.Status().Load.Features; !slices.Equal(got, want) || got == nil {
			t.Errorf("%s: features loaded %q, want %q", when, got, want)
		}
	}
	recorded := func(d *Dataplane, client string) bool {
		t.Helper()
		recs, err := d.Flows(context.Background(), flows.MaxLimit, flows.Filter{})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range recs {
			if r.Client == netip.MustParseAddrPort(client) {
				return true
			}
		}
		return false
	}
	newFlowRecorded := func(d *Dataplane) bool {
		t.Helper()
		c := e.dial(t, vip4)
		echo(t, c, "a new flow")
		client := c.LocalAddr().String()
		c.Close()
		return recorded(d, client)
	}
	wantFeatures(d, "default options")

	// Nothing turns a feature on at run time while it is out of the
	// programs: pacing and leases are refused.
	paced := e.service(1, 1, 1)
	paced.MaxEgressMbps = 100
	if _, err := d.ApplyService(ctx, paced); !errors.Is(err, ErrPrerequisite) {
		t.Errorf("pacing while EDT is not loaded: %v, want ErrPrerequisite", err)
	}
	if _, err := d.HA().UpdateLease(context.Background(), HALease{Epoch: 2}); !errors.Is(err, ErrPrerequisite) {
		t.Errorf("a lease while HA is not loaded: %v, want ErrPrerequisite", err)
	}

	c := e.dial(t, vip4)
	echo(t, c, "before the reloads")
	loop := startEchoLoop(c)

	for _, step := range []struct {
		name      string
		rate      uint32
		edt       bool
		tier      bpf.Tier
		want      []string
		recording bool
	}{
		{"flow records and EDT on", 1, true, bpf.TierS, []string{"flow_records", "edt"}, true},
		{"both off again", 0, false, bpf.TierS, []string{}, false},
		{"flow records on with a tier change", 1, false, bpf.TierM, []string{"flow_records"}, true},
	} {
		d.Close()
		e.opts.FlowSampleRate, e.opts.EDT.Enabled, e.opts.Loader.Tier = step.rate, step.edt, step.tier
		d = e.open(t)
		wantFeatures(d, step.name, step.want...)
		if st := d.Status(); st.Load.TierChanged != (step.tier == bpf.TierM) {
			t.Errorf("%s: tier changed %v", step.name, st.Load.TierChanged)
		}
		// The connection carries on (the loop echoes on it).
		n := loop.ok.Load()
		if !waitFor(5*time.Second, func() bool { return loop.ok.Load() >= n+3 || loop.failed.Load() != 0 }) || loop.failed.Load() != 0 {
			t.Fatalf("%s: the connection stopped echoing (%d round trips, %d failed)", step.name, loop.ok.Load(), loop.failed.Load())
		}
		if got := newFlowRecorded(d); got != step.recording {
			t.Errorf("%s: a new flow recorded %v, want %v", step.name, got, step.recording)
		}
		if step.edt {
			if _, err := d.ApplyService(ctx, paced); err != nil {
				t.Errorf("%s: pacing with EDT loaded: %v", step.name, err)
			}
			if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
				t.Fatal(err)
			}
		}
	}
	ok, failed, err := loop.finish()
	if failed != 0 || ok == 0 {
		t.Fatalf("echo loop across the reloads: %d round trips, %d failed (%v)", ok, failed, err)
	}
	echo(t, c, "after the reloads")
	t.Logf("%d round trips on one connection across three reloads", ok)
}

// TestFeaturesHAReloadKeepsFlows: flow-state replication turned on and off
// by restarts with and without ha_epoch, on a north-south edge, while an
// external client's TCP connection through the uplink to a north-south
// (SNAT) VIP echoes all along: the connection survives each reload on its
// backend and its SNAT translation, and only the programs loaded with HA
// queue records of new north-south flows (ha_emitted).
func TestFeaturesHAReloadKeepsFlows(t *testing.T) {
	e := newNSEnv(t)
	d := e.open(t)
	ctx := context.Background()
	vip := netip.MustParseAddr("10.96.3.1")
	svc := e.nsService("edge", vip, netip.MustParseAddr("fd00:96:3::1"), ExposureNorthSouth, ModeNAT, false)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	emitted := func(d *Dataplane) uint64 {
		t.Helper()
		st, err := d.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		n, ok := st.Parser["ha_emitted"]
		if !ok {
			t.Fatalf("no ha_emitted counter in %v", st.Parser)
		}
		return n
	}
	newFlowEmits := func(d *Dataplane) bool {
		t.Helper()
		before := emitted(d)
		c, err := e.lab.External.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
		if err != nil {
			t.Fatalf("external client to %s:80: %v", vip, err)
		}
		echo(t, c, "a new north-south flow")
		c.Close()
		return emitted(d) > before
	}
	if got := d.Status().Load.Features; len(got) != 0 {
		t.Fatalf("features without ha_epoch: %q, want none", got)
	}
	if newFlowEmits(d) {
		t.Fatal("HA not loaded, yet a new north-south flow queued a record")
	}
	c, err := e.lab.External.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	echo(t, c, "before the reloads")
	loop := startEchoLoop(c)
	for i, epoch := range []ha.Epoch{3, 0, 4} {
		d.Close()
		e.opts.HA = HAOptions{}
		if epoch != 0 {
			e.opts.HA = HAOptions{Epoch: epoch, Interval: MinHAInterval}
		}
		d = e.open(t)
		want := []string{}
		if epoch != 0 {
			want = []string{"ha"}
		}
		if got := d.Status().Load.Features; !slices.Equal(got, want) {
			t.Errorf("reload %d (ha_epoch %d): features %q, want %q", i, epoch, got, want)
		}
		n := loop.ok.Load()
		if !waitFor(5*time.Second, func() bool { return loop.ok.Load() >= n+3 || loop.failed.Load() != 0 }) || loop.failed.Load() != 0 {
			t.Fatalf("reload %d (ha_epoch %d): the connection stopped echoing (%d round trips, %d failed)", i, epoch, loop.ok.Load(), loop.failed.Load())
		}
		if got := newFlowEmits(d); got != (epoch != 0) {
			t.Errorf("reload %d (ha_epoch %d): a new north-south flow queued a record: %v", i, epoch, got)
		}
	}
	ok, failed, err := loop.finish()
	if failed != 0 || ok == 0 {
		t.Fatalf("echo loop across the reloads: %d round trips, %d failed (%v)", ok, failed, err)
	}
	echo(t, c, "after the reloads")
}
