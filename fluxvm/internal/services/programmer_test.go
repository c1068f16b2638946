package services

import (
	"errors"
	"slices"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/idpool"
	"github.com/fluxvm/servicefabric/intent"
)

// TestProgramOrder checks what a first apply writes and in which order:
// backends before the table that names them, the table before the
// frontend entry, the entry before the open guard; and what an update
// and a removal of a frontend write: a backend that left goes only after
// the new table is in place, a dropped frontend's entry goes before its
// table, and its backends and ids after.
func TestProgramOrder(t *testing.T) {
	r := newRig(t, bpf.Capacities{Services: 16, Backends: 64})
	s, err := r.apply(t, svc("web", 1, []uint16{80, 443}, 1, 2), nil)
	if err != nil {
		t.Fatal(err)
	}
	fe := r.p.Frontend(fk(1, 80))
	if fe == nil || !fe.Live() || !fe.GuardOpen() || fe.Eligible() != 2 || fe.BackendCount() != 2 {
		t.Fatalf("frontend after apply: %+v", fe)
	}
	sid, b1, b2 := fe.ID(), fe.BackendID(bep(1)), fe.BackendID(bep(2))
	r.m.before(t, "backend", "table")
	r.m.before(t, "table", "frontend 10.96.0.1:80/tcp")
	r.m.before(t, "frontend 10.96.0.1:80/tcp", "guard "+itoa(sid)+" 1")
	if tb := r.m.tables[sid]; tb == nil || !slices.Contains(tb.entries, b1) || !slices.Contains(tb.entries, b2) {
		t.Errorf("table of %d: %+v, want backends %d and %d", sid, tb, b1, b2)
	}
	if v := r.m.frontends[fk(1, 0)]; v.Flags&bpf.SvcFlagVIPMarker == 0 {
		t.Errorf("VIP marker: %+v", v)
	}
	if r.m.lockedSwaps != 0 {
		t.Errorf("%d table swaps with the lock held, want none", r.m.lockedSwaps)
	}
	if st := r.p.Status(); st.Frontends != 2 || st.ServiceIDs != (idpool.Stats{Capacity: 15, Free: 13}) ||
		st.BackendIDs != (idpool.Stats{Capacity: 63, Free: 59}) || st.IndexedEndpoints != 2 {
		t.Errorf("status after apply: %+v", st)
	}

	// Backend 1 leaves, 3 joins; port 443 goes.
	r.m.log = nil
	sid443 := r.p.Frontend(fk(1, 443)).ID()
	s, err = r.apply(t, svc("web", 1, []uint16{80}, 2, 3), s)
	if err != nil {
		t.Fatal(err)
	}
	b3 := fe.BackendID(bep(3))
	r.m.before(t, "backend "+itoa(b3), "table "+itoa(sid))
	r.m.before(t, "table "+itoa(sid), "clear backend "+itoa(b1))
	r.m.before(t, "delete frontend 10.96.0.1:443/tcp", "empty table "+itoa(sid443))
	r.m.before(t, "empty table "+itoa(sid443), "guard "+itoa(sid443)+" 0")
	if fe.BackendID(bep(1)) != 0 || r.p.BackendIDs().Used(b1) && !quarantined(r.p, b1) {
		t.Errorf("backend 1 still listed, or its id %d neither free nor quarantined", b1)
	}
	if r.p.Frontend(fk(1, 443)) != nil || r.m.tables[sid443] != nil {
		t.Errorf("port 443 still programmed")
	}
	if _, ok := r.m.frontends[fk(1, 443)]; ok {
		t.Errorf("port 443's entry still in the map")
	}
	if len(s.Frontends) != 1 {
		t.Errorf("service lists %d frontends, want 1", len(s.Frontends))
	}

	// Delete: the entry first, then the table, then backends and guard.
	r.m.log = nil
	if err := r.p.UnprogramUnlocked(s); err != nil {
		t.Fatal(err)
	}
	r.m.before(t, "delete frontend 10.96.0.1:80/tcp", "empty table "+itoa(sid))
	r.m.before(t, "empty table "+itoa(sid), "clear backend")
	if r.p.Len() != 0 || len(r.m.frontends) != 0 || len(r.m.tables) != 0 {
		t.Errorf("after delete: %d frontends, entries %v, tables %v", r.p.Len(), r.m.frontends, r.m.tables)
	}
	// The ids the delete released wait for a GC, beside port 443's
	// service id (the update's backend ids went free in quarantined).
	if st := r.p.Status(); st.Frontends != 0 || st.ServiceIDs.Quarantined != 2 || st.ServiceIDs.Free != 13 ||
		st.BackendIDs.Quarantined != 2 || st.IndexedEndpoints != 0 {
		t.Errorf("status after delete: %+v", st)
	}
	if r.m.lockedSwaps != 0 {
		t.Errorf("%d table swaps with the lock held, want none", r.m.lockedSwaps)
	}
}

// quarantined reports whether backend id is released and waits for a GC.
func quarantined(p *Programmer, id uint32) bool {
	mark := p.BackendIDs().QuarantineMark()
	return p.BackendIDs().ReleaseQuarantinedBefore(mark) > 0 && !p.BackendIDs().Used(id)
}

func itoa(n uint32) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}

// TestProgramRefuses checks that a change the maps cannot take is
// refused before anything is written: a frontend another service owns
// (ErrConflict), more frontends or backends than ids are free (ErrLimit).
func TestProgramRefuses(t *testing.T) {
	for _, tt := range []struct {
		name  string
		caps  bpf.Capacities
		first intent.Service
		next  intent.Service
		want  error
	}{
		{"frontend of another service", bpf.Capacities{Services: 16, Backends: 64},
			svc("a", 1, []uint16{80}, 1), svc("b", 1, []uint16{80, 81}, 2), intent.ErrConflict},
		{"no service id left", bpf.Capacities{Services: 3, Backends: 64},
			svc("a", 1, []uint16{80}, 1), svc("b", 2, []uint16{80, 81}, 2), intent.ErrLimit},
		{"no backend id left", bpf.Capacities{Services: 16, Backends: 4},
			svc("a", 1, []uint16{80}, 1, 2), svc("b", 2, []uint16{80}, 3, 4), intent.ErrLimit},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := newRig(t, tt.caps)
			if _, err := r.apply(t, tt.first, nil); err != nil {
				t.Fatal(err)
			}
			before := len(r.m.log)
			err := r.p.CheckIDs(&tt.next)
			if err == nil {
				_, err = r.p.Prepare(tt.next, &Service{Intent: tt.next})
			}
			if !errors.Is(err, tt.want) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
			if errors.Is(tt.want, intent.ErrLimit) && len(r.m.log) != before {
				t.Errorf("a refused change wrote %q", r.m.log[before:])
			}
			if fe := r.p.Frontend(fk(1, 80)); fe == nil || fe.Service() != "a" {
				t.Errorf("service a's frontend: %+v", fe)
			}
		})
	}
}

// TestHealthChangeDuringSwap checks that a backend whose health changed
// while the lock was free (during the table swaps) is programmed as it
// is now: the commit starts over, and the table leaves it out.
func TestHealthChangeDuringSwap(t *testing.T) {
	r := newRig(t, bpf.Capacities{Services: 16, Backends: 64})
	in := svc("web", 1, []uint16{80}, 1, 2)
	in.HealthCheck = &intent.HealthCheck{Kind: intent.HealthCheckKindTCP}
	s := &Service{Intent: in, Revision: 1}
	pl, err := r.p.Prepare(in, s)
	if err != nil {
		t.Fatal(err)
	}
	tables, err := r.p.BuildTables(pl)
	if err != nil {
		t.Fatal(err)
	}
	defer tables.Close()
	r.lock.onUnlock = func() { r.states[bep(2)] = intent.BackendUnhealthy }
	if err := r.p.CommitUnlocked(in, s, pl, tables); err != nil {
		t.Fatal(err)
	}
	fe := r.p.Frontend(fk(1, 80))
	if fe.Eligible() != 1 {
		t.Errorf("eligible %d, want 1 (backend 2 went unhealthy during the swap)", fe.Eligible())
	}
	if b := r.m.backends[fe.BackendID(bep(2))]; b.State != uint8(bpf.BackendUnhealthy) {
		t.Errorf("backend 2 state %d, want unhealthy", b.State)
	}
	if tb := r.m.tables[fe.ID()]; tb == nil || slices.Contains(tb.entries, fe.BackendID(bep(2))) {
		t.Errorf("table %+v names the unhealthy backend", tb)
	}
}

// TestFailClosed checks the last resort of a failed change: guards
// closed, RepairPending, the service not InPlace and its health checks
// asked to retry; the next Program repairs it.
func TestFailClosed(t *testing.T) {
	r := newRig(t, bpf.Capacities{Services: 16, Backends: 64})
	in := svc("web", 1, []uint16{80}, 1)
	s, err := r.apply(t, in, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !r.p.InPlace(s) {
		t.Fatal("not in place after apply")
	}
	fe := r.p.Frontend(fk(1, 80))
	r.p.FailClosed("web", errors.New("rollback failed (test)"), s)
	if g := r.m.guards[fe.ID()]; g.State == bpf.GuardOpen || fe.GuardOpen() || !fe.RepairPending() {
		t.Errorf("after FailClosed: guard %+v, open %v, repair %v", g, fe.GuardOpen(), fe.RepairPending())
	}
	if st := r.p.Status(); st.RepairPending != 1 {
		t.Errorf("status: %d frontends pending repair, want 1", st.RepairPending)
	}
	if r.p.InPlace(s) || !slices.Equal(r.retried, []string{"web"}) {
		t.Errorf("in place %v, retried %v", r.p.InPlace(s), r.retried)
	}
	if err := r.p.Program(in, s); err != nil {
		t.Fatal(err)
	}
	if g := r.m.guards[fe.ID()]; g.State != bpf.GuardOpen || fe.RepairPending() || !r.p.InPlace(s) {
		t.Errorf("after Program: guard %+v, repair %v, in place %v", g, fe.RepairPending(), r.p.InPlace(s))
	}
}

// TestSwapFailure checks that a delete whose table swap fails keeps the
// service as it was: its frontend programmed again, its entry and table
// back, its guard open.
func TestSwapFailure(t *testing.T) {
	r := newRig(t, bpf.Capacities{Services: 16, Backends: 64})
	s, err := r.apply(t, svc("web", 1, []uint16{80}, 1), nil)
	if err != nil {
		t.Fatal(err)
	}
	fe := r.p.Frontend(fk(1, 80))
	r.m.failSwap = fe.ID()
	if err := r.p.UnprogramUnlocked(s); err == nil {
		t.Fatal("a delete whose swap failed succeeded")
	}
	if v, ok := r.m.frontends[fk(1, 80)]; !ok || v.ServiceId != fe.ID() || r.p.Frontend(fk(1, 80)) == nil {
		t.Errorf("entry %+v %v after a failed delete; want it kept", v, ok)
	}
	if r.m.tables[fe.ID()] == nil || r.m.guards[fe.ID()].State != bpf.GuardOpen || fe.RepairPending() {
		t.Errorf("after a failed delete: table %v, guard %+v, repair %v", r.m.tables[fe.ID()], r.m.guards[fe.ID()], fe.RepairPending())
	}
}

// TestMarkersShared checks the (VIP, 0, proto) marker of two services on
// one VIP: it stays while either has a frontend there, and goes with
// the last.
func TestMarkersShared(t *testing.T) {
	r := newRig(t, bpf.Capacities{Services: 16, Backends: 64})
	a, err := r.apply(t, svc("a", 1, []uint16{80}, 1), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.apply(t, svc("b", 1, []uint16{81}, 2), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.p.UnprogramUnlocked(a); err != nil {
		t.Fatal(err)
	}
	if v, ok := r.m.frontends[fk(1, 0)]; !ok || v.ServiceId != r.p.Frontend(fk(1, 81)).ID() {
		t.Errorf("marker %+v %v after a's delete; want it naming b's frontend", v, ok)
	}
	if err := r.p.UnprogramUnlocked(b); err != nil {
		t.Fatal(err)
	}
	if _, ok := r.m.frontends[fk(1, 0)]; ok {
		t.Error("marker left after the last frontend on the VIP went")
	}
}

// TestPacer checks EDT pacing across a service's frontends: all share
// the pacer of the lowest id, and an unpaced update clears them.
func TestPacer(t *testing.T) {
	r := newRig(t, bpf.Capacities{Services: 16, Backends: 64})
	in := svc("web", 1, []uint16{80, 81, 82}, 1)
	in.MaxEgressMbps = 100
	s, err := r.apply(t, in, nil)
	if err != nil {
		t.Fatal(err)
	}
	pacer := uint32(0)
	for _, fe := range s.Frontends {
		if pacer == 0 || fe.ID() < pacer {
			pacer = fe.ID()
		}
	}
	for _, fe := range s.Frontends {
		if v := r.m.edt[fe.ID()]; v.Rate == 0 || v.Pacer != pacer || fe.Flags()&bpf.SvcFlagPaced == 0 {
			t.Errorf("frontend %s: edt %+v flags %#x, want paced by %d", fe.Key(), v, fe.Flags(), pacer)
		}
	}
	in.MaxEgressMbps = 0
	if s, err = r.apply(t, in, s); err != nil {
		t.Fatal(err)
	}
	for _, fe := range s.Frontends {
		if v := r.m.edt[fe.ID()]; v != (bpf.EDTValue{}) || fe.Flags()&bpf.SvcFlagPaced != 0 {
			t.Errorf("frontend %s: edt %+v flags %#x after unpacing", fe.Key(), v, fe.Flags())
		}
	}
}
