package fluxvm

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
)

// edtEntry reads the fluxvm_edt entry at key.
func edtEntry(t *testing.T, d *Dataplane, key uint32) bpf.EDTValue {
	t.Helper()
	var v bpf.EDTValue
	if err := d.dp.Maps().FluxvmEdt.Lookup(key, &v); err != nil {
		t.Fatalf("fluxvm_edt[%d]: %v", key, err)
	}
	return v
}

// edtEntries lists the non-zero fluxvm_edt entries by key.
func edtEntries(t *testing.T, d *Dataplane) map[uint32]bpf.EDTValue {
	t.Helper()
	out := map[uint32]bpf.EDTValue{}
	var (
		k uint32
		v bpf.EDTValue
	)
	it := d.dp.Maps().FluxvmEdt.Iterate()
	for it.Next(&k, &v) {
		if v != (bpf.EDTValue{}) {
			out[k] = v
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// wantPaced checks every frontend of service name: its fluxvm_edt entry
// is want (zero: unpaced), the departure clock aside (the datapath's; see
// wantClocks), and its frontend entry has SvcFlagPaced exactly when want
// has a rate. The VIP markers never have it.
func wantPaced(t *testing.T, d *Dataplane, what, name string, want bpf.EDTValue) {
	t.Helper()
	st, err := d.Service(name)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if len(st.Frontends) == 0 {
		t.Fatalf("%s: %s has no frontends", what, name)
	}
	// Every frontend of a paced service names one pacer: the service's
	// frontend with the lowest id, whose clock they share.
	if want.Rate != 0 {
		want.Pacer = st.Frontends[0].ServiceID
		for _, fe := range st.Frontends {
			want.Pacer = min(want.Pacer, fe.ServiceID)
		}
	}
	for _, fe := range st.Frontends {
		got := edtEntry(t, d, fe.ServiceID)
		got.LastDeparture = 0
		if got != want {
			t.Errorf("%s: %s fluxvm_edt[%d] = %+v, want %+v", what, fe.VIP, fe.ServiceID, got, want)
		}
		v, ok := svcEntry(t, d, fe.VIP.Addr(), fe.VIP.Port(), fe.Protocol)
		if !ok {
			t.Fatalf("%s: no frontend entry %s", what, fe.VIP)
		}
		if paced := v.Flags&bpf.SvcFlagPaced != 0; paced != (want.Rate != 0) {
			t.Errorf("%s: %s/%s flags %#x: paced %v, want %v", what, fe.VIP, fe.Protocol, v.Flags, paced, want.Rate != 0)
		}
		if m, ok := svcEntry(t, d, fe.VIP.Addr(), 0, fe.Protocol); ok && m.Flags&bpf.SvcFlagPaced != 0 {
			t.Errorf("%s: VIP marker of %s flags %#x: paced", what, fe.VIP.Addr(), m.Flags)
		}
	}
}

// pacerOf returns the frontends of service name by id, and the lowest id:
// the service's pacer.
func pacerOf(t *testing.T, d *Dataplane, name string) (map[uint32]FrontendStatus, uint32) {
	t.Helper()
	st, err := d.Service(name)
	if err != nil {
		t.Fatal(err)
	}
	out := map[uint32]FrontendStatus{}
	var pacer uint32
	for _, fe := range st.Frontends {
		out[fe.ServiceID] = fe
		if pacer == 0 || fe.ServiceID < pacer {
			pacer = fe.ServiceID
		}
	}
	return out, pacer
}

// setClocks writes a departure clock into the fluxvm_edt entry of each
// frontend of service name, as the datapath would: pacerClock to the
// pacer's, base+id to the others'.
func setClocks(t *testing.T, d *Dataplane, name string, pacerClock, base uint64) {
	t.Helper()
	fes, pacer := pacerOf(t, d, name)
	for sid := range fes {
		v := edtEntry(t, d, sid)
		v.LastDeparture = base + uint64(sid)
		if sid == pacer {
			v.LastDeparture = pacerClock
		}
		if err := d.dp.Maps().FluxvmEdt.Put(sid, v); err != nil {
			t.Fatal(err)
		}
	}
}

// wantClocks checks the departure clock of every frontend of service
// name: want[id], or base+id for an id not in want.
func wantClocks(t *testing.T, d *Dataplane, what, name string, base uint64, want map[uint32]uint64) {
	t.Helper()
	fes, _ := pacerOf(t, d, name)
	for sid, fe := range fes {
		w, ok := want[sid]
		if !ok {
			w = base + uint64(sid)
		}
		if got := edtEntry(t, d, sid).LastDeparture; got != w {
			t.Errorf("%s: %s (id %d) departure clock %d, want %d", what, fe.VIP, sid, got, w)
		}
	}
}

func wantEDTNode(t *testing.T, d *Dataplane, what string, n uint64) {
	t.Helper()
	if got := edtEntry(t, d, bpf.EDTNodeKey); got != (bpf.EDTValue{Rate: n}) {
		t.Errorf("%s: node entry %+v, want Rate %d (paced north-south services)", what, got, n)
	}
}

// TestEDTApply checks the EDT entries and flags on a real datapath as
// services are applied, changed and deleted, the node entry's count of
// paced north-south services, and their restore into new maps (a tier
// change).
func TestEDTApply(t *testing.T) {
	e := newNSEnv(t)
	e.opts.EDT.Enabled = true
	e.opts.EDT.Horizon = 50 * time.Millisecond
	d := e.open(t)
	ctx := context.Background()
	wantEDTNode(t, d, "empty catalog", 0)

	ns4, ns6 := netip.MustParseAddr("10.96.7.1"), netip.MustParseAddr("fd00:96:7::1")
	ew := e.service(1, 1, 1) // both families, TCP and UDP: 4 frontends
	ns := e.nsService("edge", ns4, ns6, ExposureNorthSouth, ModeNAT, false)
	at := func(mbps uint32) bpf.EDTValue {
		v, err := bpf.NewEDTValue(bpf.MbpsToEDTRate(mbps), e.opts.EDT.Horizon)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	steps := []struct {
		name   string
		ew, ns uint32 // max_egress_mbps of each; 0: unpaced
		del    bool   // delete web
		node   uint64
	}{
		{name: "both unpaced", node: 0},
		{name: "east-west paced", ew: 100, node: 0},
		{name: "north-south paced too", ew: 100, ns: 1000, node: 1},
		{name: "rate change", ew: 250, ns: 1000, node: 1},
		{name: "lowest and highest rates", ew: 1, ns: 100000, node: 1},
		{name: "north-south cap removed", ew: 250, node: 0},
		{name: "north-south paced again", ew: 250, ns: 5, node: 1},
		{name: "east-west deleted", del: true, ns: 5, node: 1},
		{name: "east-west back unpaced", ns: 5, node: 1},
	}
	for _, s := range steps {
		ew.MaxEgressMbps, ns.MaxEgressMbps = s.ew, s.ns
		if s.del {
			if err := d.DeleteService(ctx, "web"); err != nil {
				t.Fatalf("%s: %v", s.name, err)
			}
		} else if _, err := d.ApplyService(ctx, ew); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if _, err := d.ApplyService(ctx, ns); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		var wantEW, wantNS bpf.EDTValue
		if s.ew != 0 {
			wantEW = at(s.ew)
		}
		if s.ns != 0 {
			wantNS = at(s.ns)
		}
		if !s.del {
			wantPaced(t, d, s.name, "web", wantEW)
		}
		wantPaced(t, d, s.name, "edge", wantNS)
		wantEDTNode(t, d, s.name, s.node)
		// Nothing else is paced: a deleted service's ids are zeroed.
		n := 0
		if s.ew != 0 && !s.del {
			n += 4
		}
		if s.ns != 0 {
			n += 2
		}
		if s.node != 0 {
			n++
		}
		if got := edtEntries(t, d); len(got) != n {
			t.Errorf("%s: %d non-zero fluxvm_edt entries %v, want %d", s.name, len(got), got, n)
		}
	}

	// Status: the cap, the rate and horizon, and the counters summed
	// over frontends and CPUs.
	st, err := d.Service("edge")
	if err != nil {
		t.Fatal(err)
	}
	per := make([]bpf.ServiceStats, ebpf.MustPossibleCPU())
	per[0].ReplyBytes, per[0].EdtDrops = 1000, 2
	per[len(per)-1].ReplyBytes += 500
	per[len(per)-1].EdtDrops += 1
	for _, fe := range st.Frontends {
		if err := d.dp.Maps().FluxvmSvcStats.Put(fe.ServiceID, per); err != nil {
			t.Fatal(err)
		}
	}
	want := ServiceEDTStatus{MaxEgressMbps: 5, RateBytesPerSec: 625_000, Horizon: Duration{Duration: 50 * time.Millisecond}, Bytes: 3000, HorizonDrops: 6}
	if st, err = d.Service("edge"); err != nil || st.EDT == nil || *st.EDT != want {
		t.Errorf("edge EDT status %+v (%v), want %+v", st.EDT, err, want)
	}
	stats, err := d.Stats(context.Background())
	if err != nil || stats.EDT["edge"] != want || len(stats.EDT) != 1 {
		t.Errorf("Stats().EDT %+v (%v), want edge %+v alone", stats.EDT, err, want)
	}
	if st, _ := d.Service("web"); st.EDT != nil {
		t.Errorf("unpaced web EDT status %+v", st.EDT)
	}
	if ns := d.Status().EDT; !ns.Enabled || ns.Horizon.Duration != 50*time.Millisecond || len(ns.Interfaces) != 5 {
		t.Errorf("node EDT status %+v, want enabled, 50ms, 5 interfaces (4 VM edges, the uplink)", ns)
	}

	// Refused before anything is written: out of bounds.
	before := edtEntries(t, d)
	bad := ew
	bad.MaxEgressMbps = 100001
	var ve *ValidationError
	if _, err := d.ApplyService(ctx, bad); !errors.Is(err, ErrInvalid) || !errors.As(err, &ve) || ve.Field != "max_egress_mbps" {
		t.Errorf("max_egress_mbps 100001: %v, want ErrInvalid on max_egress_mbps", err)
	}
	if _, err := d.Service("web"); err != nil {
		t.Fatal(err)
	}
	wantPaced(t, d, "after refusal", "web", bpf.EDTValue{})
	if got := edtEntries(t, d); len(got) != len(before) {
		t.Errorf("after refusal: fluxvm_edt %v, want %v", got, before)
	}

	// The pacer's frontend removed (its port): the other frontends name
	// the new lowest id, the removed entries are zeroed, and the clocks
	// stay: the new pacer starts from the old pacer's, the others keep
	// theirs.
	paced := ew
	paced.MaxEgressMbps = 250
	if _, err := d.ApplyService(ctx, paced); err != nil {
		t.Fatal(err)
	}
	wantPaced(t, d, "web paced", "web", at(250))
	fes, oldPacer := pacerOf(t, d, "web")
	const base, pacerClock = 1_000_000_000_000, 5_000_000_000_000
	setClocks(t, d, "web", pacerClock, base)
	drop := fes[oldPacer]
	fewer := paced
	fewer.Ports = nil
	for _, p := range paced.Ports {
		if p.Protocol != drop.Protocol {
			fewer.Ports = append(fewer.Ports, p)
		}
	}
	if _, err := d.ApplyService(ctx, fewer); err != nil {
		t.Fatal(err)
	}
	wantPaced(t, d, "pacer's frontend removed", "web", at(250))
	left, newPacer := pacerOf(t, d, "web")
	if len(left) != 2 || newPacer == oldPacer {
		t.Fatalf("pacer's frontend removed: frontends %v, pacer %d (was %d)", left, newPacer, oldPacer)
	}
	for sid := range fes {
		if _, ok := left[sid]; !ok {
			if v := edtEntry(t, d, sid); v != (bpf.EDTValue{}) {
				t.Errorf("pacer's frontend removed: removed id %d entry %+v, want zeroed", sid, v)
			}
		}
	}
	wantClocks(t, d, "pacer's frontend removed", "web", base, map[uint32]uint64{newPacer: pacerClock})

	// A restart onto the kept maps rewrites nothing: the clocks stay.
	setClocks(t, d, "web", pacerClock, base)
	d.Close()
	d = e.open(t)
	wantPaced(t, d, "reopened", "web", at(250))
	wantClocks(t, d, "reopened", "web", base, map[uint32]uint64{newPacer: pacerClock})

	// The port back: new frontends, with recycled ids. When one of them
	// has the lowest id, it becomes the pacer and starts from the old
	// pacer's clock; the rest keep theirs (the other new one starts
	// empty).
	if _, err := d.ApplyService(ctx, paced); err != nil {
		t.Fatal(err)
	}
	wantPaced(t, d, "port back", "web", at(250))
	all, backPacer := pacerOf(t, d, "web")
	clocks := map[uint32]uint64{}
	for sid := range all {
		if _, ok := left[sid]; !ok {
			clocks[sid] = 0
		}
	}
	clocks[backPacer] = pacerClock
	clocks[newPacer] = pacerClock // its own, kept
	if backPacer == newPacer {
		t.Logf("port back: the new frontends got higher ids (%v), the pacer stays %d", all, newPacer)
	}
	wantClocks(t, d, "port back", "web", base, clocks)

	// A rate change starts every clock empty.
	setClocks(t, d, "web", pacerClock, base)
	paced.MaxEgressMbps = 260
	if _, err := d.ApplyService(ctx, paced); err != nil {
		t.Fatal(err)
	}
	wantPaced(t, d, "rate changed", "web", at(260))
	zero := map[uint32]uint64{}
	for sid := range all {
		zero[sid] = 0
	}
	wantClocks(t, d, "rate changed", "web", base, zero)

	// A tier change recreates the maps: the restore writes the entries
	// and the node's again.
	ew.MaxEgressMbps = 300
	if _, err := d.ApplyService(ctx, ew); err != nil {
		t.Fatal(err)
	}
	d.Close()
	e.opts.Loader.Tier = bpf.TierM
	d = e.open(t)
	if st := d.Status(); !st.Load.TierChanged {
		t.Fatalf("reopen at tier M: load %+v, want a tier change", st.Load)
	}
	wantPaced(t, d, "restored", "web", at(300))
	wantPaced(t, d, "restored", "edge", at(5))
	wantEDTNode(t, d, "restored", 1)
	if got := edtEntries(t, d); len(got) != 7 {
		t.Errorf("restored: fluxvm_edt %v, want 7 entries", got)
	}

	// edt_enabled turned off under a catalog with paced services: the
	// restore refuses it, naming the prerequisite.
	d.Close()
	e.opts.EDT.Enabled = false
	if d2, err := Open(context.Background(), e.opts); !errors.Is(err, ErrPrerequisite) || !strings.Contains(err.Error(), "max_egress_mbps") {
		if d2 != nil {
			d2.Close()
		}
		t.Errorf("Open without edt_enabled over paced services: %v, want ErrPrerequisite on max_egress_mbps", err)
	}
}

// TestEDTNeedsEnabled: max_egress_mbps without edt_enabled is refused
// with ErrPrerequisite, and nothing is written.
func TestEDTNeedsEnabled(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	svc := e.service(1, 1, 1)
	svc.MaxEgressMbps = 100
	var ve *ValidationError
	if _, err := d.ApplyService(context.Background(), svc); !errors.Is(err, ErrPrerequisite) || !errors.As(err, &ve) || ve.Field != "max_egress_mbps" {
		t.Fatalf("apply: %v, want ErrPrerequisite on max_egress_mbps", err)
	}
	if _, err := d.Service("web"); !errors.Is(err, ErrNotFound) {
		t.Errorf("service after refusal: %v", err)
	}
	if got := edtEntries(t, d); len(got) != 0 {
		t.Errorf("fluxvm_edt after refusal: %v", got)
	}
	if st := d.Status(); st.Services != 0 {
		t.Errorf("services after refusal: %d", st.Services)
	}
}
